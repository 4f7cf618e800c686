-- Runs made through PostgresRuntime outside Celery (a web process calling
-- agent.run itself): no request, so no row in the ledger. The runtime records
-- each outermost run it opens without a worker's lease here, as it opens and
-- as it ends, so that `requests --direct`, `show` and the console list them
-- with their journal (their scope and epoch). `outcome` NULL: still running,
-- or its process died before it ended.
CREATE TABLE IF NOT EXISTS direct_runs (
    run_id      TEXT PRIMARY KEY,
    scope       TEXT NOT NULL,
    session_id  TEXT NOT NULL,
    user_id     TEXT,
    epoch       INTEGER NOT NULL,
    process     TEXT NOT NULL,
    pid         INTEGER NOT NULL,
    started_at  TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    finished_at TIMESTAMPTZ,
    outcome     TEXT CHECK (outcome IN ('succeeded', 'raised')),
    error       TEXT
);
CREATE INDEX IF NOT EXISTS direct_runs_started ON direct_runs (started_at DESC);
