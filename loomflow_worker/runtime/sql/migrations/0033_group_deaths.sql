-- How apart from other runs an attempt ran (`isolation`, as the worker's
-- context has it): 0 in a shared process, 1 in a process of quarantine among a
-- few suspects, 2 alone (a process of quarantine of its own, or a pool child
-- of one slot). A group's process runs its members side by side and takes a
-- new one as another leaves, so a member whose attempt has replied may have
-- left behind what kills the process later (a tool's thread still running,
-- memory it keeps). A death there is shared with every attempt the process
-- ran, ended or not; elsewhere, with the attempts still open when it died, as
-- before. A worker of an earlier release records 0.
ALTER TABLE run_attempts ADD COLUMN IF NOT EXISTS isolation SMALLINT NOT NULL DEFAULT 0;
CREATE INDEX IF NOT EXISTS run_attempts_grouped ON run_attempts (worker) WHERE isolation = 1;

CREATE OR REPLACE FUNCTION loomflow_worker_last_attempt(req TEXT, att INTEGER,
                                                        OUT outcome TEXT, OUT shared BOOLEAN)
LANGUAGE sql STABLE AS $$
    SELECT a.outcome,
           a.outcome IS NULL AND (EXISTS (
               SELECT 1 FROM run_attempts b
                WHERE b.worker = a.worker AND b.boot IS NOT DISTINCT FROM a.boot
                  AND b.outcome IS NULL AND b.request_id <> a.request_id)
           OR a.isolation = 1 AND EXISTS (
               SELECT 1 FROM run_attempts b
                WHERE b.worker = a.worker AND b.boot IS NOT DISTINCT FROM a.boot
                  AND b.isolation = 1 AND b.request_id <> a.request_id))
      FROM run_attempts a
     WHERE a.request_id = req AND a.attempt = att
$$;
