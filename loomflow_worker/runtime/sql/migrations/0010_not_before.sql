-- When a request may start (Celery's countdown or eta; NULL: at once): the
-- sweeper never takes its message for lost before then, and every message
-- published again for it carries it as its eta.
ALTER TABLE runs ADD COLUMN IF NOT EXISTS not_before TIMESTAMPTZ;
-- What the request's message carried besides its arguments (chain links,
-- errbacks, chord and group membership, headers, priority, time limits), as
-- Celery's own retry rebuilds it: recorded when a worker takes the message,
-- and carried by every message published again for the request (a handoff
-- after it parked, the sweeper's).
ALTER TABLE runs ADD COLUMN IF NOT EXISTS options JSONB;
