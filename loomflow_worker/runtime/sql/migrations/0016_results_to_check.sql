-- Finished requests whose result the sweeper has yet to find in the Celery
-- result backend (a worker can die between its finishing commit and storing
-- it): a row each, written when the request ends (by a trigger, so every way
-- a request ends is covered, by workers of any version) and deleted once the
-- sweeper checked it. This replaces flipping runs.result_checked, an update
-- of the request's own row that wrote a new entry in every index of runs.
CREATE TABLE IF NOT EXISTS results_to_check (
    request_id TEXT PRIMARY KEY,
    finished_at TIMESTAMPTZ NOT NULL
);
CREATE INDEX IF NOT EXISTS results_to_check_finished ON results_to_check (finished_at);

CREATE OR REPLACE FUNCTION loomflow_worker_result_to_check() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO results_to_check (request_id, finished_at)
    VALUES (NEW.request_id, coalesce(NEW.finished_at, now()))
    ON CONFLICT (request_id) DO NOTHING;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS runs_result_to_check_inserted ON runs;
CREATE TRIGGER runs_result_to_check_inserted AFTER INSERT ON runs
    FOR EACH ROW WHEN (loomflow_worker_finished(NEW.status))
    EXECUTE FUNCTION loomflow_worker_result_to_check();
DROP TRIGGER IF EXISTS runs_result_to_check_ended ON runs;
CREATE TRIGGER runs_result_to_check_ended AFTER UPDATE OF status ON runs
    FOR EACH ROW WHEN (loomflow_worker_finished(NEW.status)
                       AND NOT loomflow_worker_finished(OLD.status))
    EXECUTE FUNCTION loomflow_worker_result_to_check();

-- What was waiting for a check carries over (the sweeper looks back an hour).
INSERT INTO results_to_check (request_id, finished_at)
SELECT request_id, finished_at FROM runs
 WHERE NOT result_checked AND loomflow_worker_finished(status)
   AND finished_at > now() - interval '1 hour'
ON CONFLICT (request_id) DO NOTHING;

-- New requests no longer enter runs_unchecked (which only workers of earlier
-- versions read).
ALTER TABLE runs ALTER COLUMN result_checked SET DEFAULT true;
