-- When the sweeper last dispatched a request again, so it does so once per
-- redispatch interval, not on every sweep.
ALTER TABLE runs ADD COLUMN IF NOT EXISTS swept_at TIMESTAMPTZ;
