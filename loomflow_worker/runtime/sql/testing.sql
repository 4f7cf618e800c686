-- The effects log of loomflow_worker.testing (EffectsLog: a side-effect tool that counts its
-- executions), which the demo's agents and the test suite use: a row per execution of the
-- tool, its start and its end stamped on the database's clock, so a test or the demo can
-- tell a step executed twice from one replayed.

-- name: effects_table
-- The log's table, made once per database by EffectsLog.setup (IF NOT EXISTS: every
-- process of a fleet may call it).
CREATE TABLE IF NOT EXISTS loomflow_worker_effects (
    id          BIGSERIAL PRIMARY KEY,
    tag         TEXT NOT NULL,
    pid         INTEGER NOT NULL,
    started_at  TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    finished_at TIMESTAMPTZ
);
-- When the tool was called, on its process's clock: a start recorded late (its process
-- stopped while it connected) still says when the execution began.
ALTER TABLE loomflow_worker_effects ADD COLUMN IF NOT EXISTS entered_at TIMESTAMPTZ;

-- name: effect_started
-- One execution of the tool begins, by this process: its id, to stamp its end with.
INSERT INTO loomflow_worker_effects (tag, pid, entered_at)
VALUES (%(tag)s, %(pid)s, %(entered_at)s) RETURNING id;

-- name: effect_finished
-- The execution's end, stamped once its side effect is done (NULL: it never finished).
UPDATE loomflow_worker_effects SET finished_at = clock_timestamp() WHERE id = %(id)s;

-- name: effect_executions
-- The executions whose tag starts with the prefix, in the order they began.
SELECT tag, pid, started_at, finished_at FROM loomflow_worker_effects
 WHERE starts_with(tag, %(prefix)s) ORDER BY id;
