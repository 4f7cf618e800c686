-- Whether the caller said it does not want the request's result (Celery's
-- ignore_result, from apply_async or the task's default), recorded at enqueue:
-- the sweeper never stores such a result, so fire-and-forget stays so.
ALTER TABLE runs ADD COLUMN IF NOT EXISTS ignore_result BOOLEAN NOT NULL DEFAULT false;

-- A finished request goes to results_to_check only when its result is wanted.
-- Its worker takes it off once it stored the result itself (with the stamp of
-- its row in `workers`), so the sweeper checks only results whose worker died
-- before storing them, and never stores again one a caller has since forgotten.
CREATE OR REPLACE FUNCTION loomflow_worker_result_to_check() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.ignore_result THEN
        RETURN NULL;
    END IF;
    INSERT INTO results_to_check (request_id, finished_at)
    VALUES (NEW.request_id, coalesce(NEW.finished_at, now()))
    ON CONFLICT (request_id) DO NOTHING;
    RETURN NULL;
END
$$;
