-- A durable mailbox for runtime.signal / wait_for_signal: a signal is a
-- row until a waiter consumes it, whatever process sent it and whenever
-- the waiter starts.
CREATE TABLE IF NOT EXISTS signals (
    id         BIGSERIAL PRIMARY KEY,
    session_id TEXT NOT NULL,
    name       TEXT NOT NULL,
    payload    BYTEA NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

CREATE INDEX IF NOT EXISTS signals_mailbox ON signals (session_id, name, id);
