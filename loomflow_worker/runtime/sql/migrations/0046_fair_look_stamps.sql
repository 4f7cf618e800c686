-- A worker process's fair look first stamps how many runs the process carries
-- now in its own row of `workers`. What may wait in the broker follows the
-- fleet's free slots (loomflow_worker_fair_depth) as the rows say them; stamped
-- only each heartbeat interval, a process whose runs ended together (a wave of
-- a backlog, a deploy's drain) still said it was full until its next stamp, and
-- its freed slots waited for the floor's few requests at a time. The look that
-- each run's end asks for now says them as they are. Stamped only while
-- requests are withheld (otherwise there is nothing for a look to publish, and
-- the heartbeat's stamp is enough), and only when the count changed.
CREATE OR REPLACE FUNCTION loomflow_worker_fair_next(wait BOOLEAN, page INTEGER,
                                                     worker_name TEXT, worker_runs INTEGER)
RETURNS TABLE (request_id TEXT, kind TEXT, session_id TEXT, user_id TEXT, agent TEXT,
               prompt TEXT, metadata JSONB, not_before TIMESTAMPTZ, options JSONB,
               routing JSONB)
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM runs r
                    WHERE r.waiting_for = 'limit fair_queue' AND r.status = 'queued') THEN
        RETURN;
    END IF;
    UPDATE workers w SET runs = worker_runs
     WHERE w.worker = worker_name AND w.stopped_at IS NULL
       AND w.runs IS DISTINCT FROM worker_runs;
    RETURN QUERY SELECT * FROM loomflow_worker_fair_next(wait, page);
END
$$;
