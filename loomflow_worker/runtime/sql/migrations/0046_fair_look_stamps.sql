-- A worker process's fair look first stamps how many runs the process carries
-- now, and whether it takes new requests, in its own row of `workers`. What may
-- wait in the broker follows the fleet's free slots (loomflow_worker_fair_depth)
-- as the rows say them; stamped only each heartbeat interval, a process whose
-- runs ended together (the waves of a backlog) still said it was full until its
-- next stamp, one that admission had paused and resumed still said it took
-- nothing, and their free slots waited for the floor's few requests at a time.
-- The look that each run's end asks for now says them as they are. Stamped only
-- while requests are withheld (otherwise there is nothing for a look to
-- publish, and the heartbeat's stamp is enough), and only when they changed.
CREATE OR REPLACE FUNCTION loomflow_worker_fair_next(wait BOOLEAN, page INTEGER,
                                                     worker_name TEXT, worker_runs INTEGER,
                                                     worker_admitting BOOLEAN)
RETURNS TABLE (request_id TEXT, kind TEXT, session_id TEXT, user_id TEXT, agent TEXT,
               prompt TEXT, metadata JSONB, not_before TIMESTAMPTZ, options JSONB,
               routing JSONB)
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM runs r
                    WHERE r.waiting_for = 'limit fair_queue' AND r.status = 'queued') THEN
        RETURN;
    END IF;
    UPDATE workers w SET runs = worker_runs, admitting = worker_admitting
     WHERE w.worker = worker_name AND w.stopped_at IS NULL
       AND (w.runs, w.admitting) IS DISTINCT FROM (worker_runs, worker_admitting);
    RETURN QUERY SELECT * FROM loomflow_worker_fair_next(wait, page);
END
$$;
