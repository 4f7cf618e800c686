-- The fleet as the console sees it. `workers`: one row per worker process (the
-- node:pid the runs name as their holder), stamped on every heartbeat interval
-- whether it runs anything or not, marked stopped when it closes cleanly; the
-- sweeper forgets rows not seen for a day. `sweeper_actions`: what the sweeper
-- did, the last thousand or the last day, whichever is less.
CREATE TABLE IF NOT EXISTS workers (
    worker TEXT PRIMARY KEY,
    hostname TEXT NOT NULL,
    pid INTEGER NOT NULL,
    slots INTEGER NOT NULL,
    heartbeat_interval DOUBLE PRECISION NOT NULL,
    runs INTEGER NOT NULL DEFAULT 0,
    started_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    seen_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    stopped_at TIMESTAMPTZ
);
CREATE INDEX IF NOT EXISTS workers_seen ON workers (seen_at);

CREATE TABLE IF NOT EXISTS sweeper_actions (
    id BIGSERIAL PRIMARY KEY,
    at TIMESTAMPTZ NOT NULL DEFAULT now(),
    worker TEXT NOT NULL,
    action TEXT NOT NULL,
    request_id TEXT,
    detail TEXT NOT NULL DEFAULT ''
);
