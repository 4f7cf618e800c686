-- How loaded each worker process is, stamped with its row on every heartbeat
-- interval: the largest lag of its event loop over the last second, the
-- statements waiting for its lock connections, and whether it takes new
-- requests (admission pauses a process that cannot carry more).
ALTER TABLE workers ADD COLUMN IF NOT EXISTS loop_lag DOUBLE PRECISION NOT NULL DEFAULT 0;
ALTER TABLE workers ADD COLUMN IF NOT EXISTS lock_queue INTEGER NOT NULL DEFAULT 0;
ALTER TABLE workers ADD COLUMN IF NOT EXISTS admitting BOOLEAN NOT NULL DEFAULT true;
