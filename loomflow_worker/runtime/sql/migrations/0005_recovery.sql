-- Recovery: the advisory lock key of each request's scope (to see in
-- pg_locks whether its scope is held), and the sweeper's leader lease.
ALTER TABLE runs ADD COLUMN IF NOT EXISTS lock_key BIGINT;

CREATE TABLE IF NOT EXISTS sweeper_leader (
    id           INTEGER PRIMARY KEY CHECK (id = 1),
    holder       TEXT NOT NULL,
    backend_pid  INTEGER NOT NULL,
    heartbeat_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
