-- Faults are charged to their cause. A worker process carries many runs: when
-- it dies, each of its runs' next attempt finds its own attempt died "shared"
-- (other runs of the process died with it), which is no evidence against it.
-- `suspicion` counts such shared deaths in a row without a completed step
-- (a request past one runs alone, in quarantine, where a death is its own);
-- `lost_streak` counts attempts in a row that lost their lock connection (a
-- frozen process, a loop held past the lease) without a completed step, so a
-- request that keeps stalling its process ends instead of looping. Both go
-- back to 0 once an attempt completes a step. `run_attempts_open` finds the
-- attempts of one process that never ended (running, or died with it).
ALTER TABLE runs ADD COLUMN IF NOT EXISTS suspicion INTEGER NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS lost_streak INTEGER NOT NULL DEFAULT 0;
CREATE INDEX IF NOT EXISTS run_attempts_open ON run_attempts (worker) WHERE outcome IS NULL;

-- How a request's attempt `att` ended (NULL: it died with its process, or it
-- runs), and whether other attempts of its process never ended either: they
-- died with it, so the death may be any of theirs.
CREATE OR REPLACE FUNCTION loomflow_worker_last_attempt(req TEXT, att INTEGER,
                                                        OUT outcome TEXT, OUT shared BOOLEAN)
LANGUAGE sql STABLE AS $$
    SELECT a.outcome,
           a.outcome IS NULL AND EXISTS (
               SELECT 1 FROM run_attempts b
                WHERE b.worker = a.worker AND b.outcome IS NULL AND b.request_id <> a.request_id)
      FROM run_attempts a
     WHERE a.request_id = req AND a.attempt = att
$$;
