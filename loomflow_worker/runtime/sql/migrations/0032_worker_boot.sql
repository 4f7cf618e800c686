-- A worker process's incarnation (`boot`, new at each start of a process):
-- its worker id (node and pid) repeats when a container restarts in place,
-- under the same host name and, in a pid namespace of its own, the same pid.
-- The process's row in `workers` and each attempt it starts carry it, so that
-- an attempt of a process that died is not taken for one of the process now
-- stamping the same row. NULL for a worker of an earlier release.
ALTER TABLE workers ADD COLUMN IF NOT EXISTS boot TEXT;
ALTER TABLE run_attempts ADD COLUMN IF NOT EXISTS boot TEXT;

-- The previous attempt of a request, and whether it died with other runs of
-- its process (shared): of the same worker id and the same incarnation.
CREATE OR REPLACE FUNCTION loomflow_worker_last_attempt(req TEXT, att INTEGER,
                                                        OUT outcome TEXT, OUT shared BOOLEAN)
LANGUAGE sql STABLE AS $$
    SELECT a.outcome,
           a.outcome IS NULL AND EXISTS (
               SELECT 1 FROM run_attempts b
                WHERE b.worker = a.worker AND b.boot IS NOT DISTINCT FROM a.boot
                  AND b.outcome IS NULL AND b.request_id <> a.request_id)
      FROM run_attempts a
     WHERE a.request_id = req AND a.attempt = att
$$;
