-- The journal, in loomflow's own layout: a journal written by
-- loomflow.runtime.PostgresRuntime carries over unchanged.
CREATE TABLE IF NOT EXISTS journal_steps (
    session_id TEXT NOT NULL,
    step_name  TEXT NOT NULL,
    value      BYTEA NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (session_id, step_name)
);

CREATE TABLE IF NOT EXISTS journal_streams (
    session_id TEXT NOT NULL,
    step_name  TEXT NOT NULL,
    chunks     BYTEA NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (session_id, step_name)
);

CREATE TABLE IF NOT EXISTS checkpoints (
    session_id    TEXT NOT NULL,
    checkpoint_id TEXT NOT NULL PRIMARY KEY,
    turn          INTEGER NOT NULL,
    created_at    DOUBLE PRECISION NOT NULL,
    payload       JSONB NOT NULL
);

CREATE INDEX IF NOT EXISTS checkpoints_session_created
    ON checkpoints (session_id, created_at DESC);

-- A run's namespace ("<epoch>/..." keys) is loaded with one range scan
-- whatever the database's collation is.
CREATE INDEX IF NOT EXISTS journal_steps_namespace
    ON journal_steps (session_id, step_name COLLATE "C");
CREATE INDEX IF NOT EXISTS journal_streams_namespace
    ON journal_streams (session_id, step_name COLLATE "C");

-- Batched pruning by age.
CREATE INDEX IF NOT EXISTS journal_steps_created ON journal_steps (created_at);
CREATE INDEX IF NOT EXISTS journal_streams_created ON journal_streams (created_at);
CREATE INDEX IF NOT EXISTS checkpoints_created ON checkpoints (created_at);
