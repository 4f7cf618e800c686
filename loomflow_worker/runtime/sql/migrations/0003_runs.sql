-- The run ledger: the queue of record for requests sent to workers.
CREATE TABLE IF NOT EXISTS runs (
    request_id       TEXT PRIMARY KEY,
    seq              BIGSERIAL NOT NULL UNIQUE,
    scope            TEXT NOT NULL,
    session_id       TEXT NOT NULL,
    user_id          TEXT,
    agent            TEXT NOT NULL,
    kind             TEXT NOT NULL DEFAULT 'run' CHECK (kind IN ('run', 'resume')),
    prompt           TEXT NOT NULL,
    metadata         JSONB NOT NULL DEFAULT '{}'::jsonb,
    status           TEXT NOT NULL DEFAULT 'queued' CHECK (
                         status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled', 'dead')),
    epoch            INTEGER,
    attempts         INTEGER NOT NULL DEFAULT 0,
    failures         INTEGER NOT NULL DEFAULT 0,
    crashes          INTEGER NOT NULL DEFAULT 0,
    holder           TEXT,
    holder_pid       INTEGER,
    cancel_requested BOOLEAN NOT NULL DEFAULT false,
    result           JSONB,
    error            TEXT,
    error_type       TEXT,
    enqueued_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    dispatched_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    started_at       TIMESTAMPTZ,
    heartbeat_at     TIMESTAMPTZ,
    finished_at      TIMESTAMPTZ
);

-- Unfinished requests of a scope, in the order they were accepted.
CREATE INDEX IF NOT EXISTS runs_scope_open ON runs (scope, seq)
    WHERE status IN ('queued', 'running');
CREATE INDEX IF NOT EXISTS runs_status ON runs (status, enqueued_at);
CREATE INDEX IF NOT EXISTS runs_session ON runs (session_id, seq);

-- One row per execution of a request: who ran it, when, how it ended.
CREATE TABLE IF NOT EXISTS run_attempts (
    request_id TEXT NOT NULL REFERENCES runs (request_id) ON DELETE CASCADE,
    attempt    INTEGER NOT NULL,
    worker     TEXT NOT NULL,
    pid        INTEGER NOT NULL,
    epoch      INTEGER NOT NULL,
    started_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    ended_at   TIMESTAMPTZ,
    outcome    TEXT,
    PRIMARY KEY (request_id, attempt)
);
