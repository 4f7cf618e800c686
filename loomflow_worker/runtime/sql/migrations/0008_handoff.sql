-- The handoff between consecutive requests of a scope: a worker that parks a
-- request stamps received_at; a finishing request that hands the scope on
-- stamps handed_at. Each sets its stamp and reads the other's in one UPDATE
-- of the same row, so one of them always sees the other: the hander publishes
-- the request again only when its message was already taken and parked, and
-- otherwise the message still on its way runs it.
ALTER TABLE runs ADD COLUMN IF NOT EXISTS received_at TIMESTAMPTZ;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS handed_at TIMESTAMPTZ;
