-- Fencing tokens. An attempt's journal writes and its request's end carry the
-- attempt (request id and attempt number) and land only while that attempt is
-- open in run_attempts: once the sweeper ended it (a worker stopped past its
-- lease) or the request's next attempt started, its writes are refused by the
-- database, whatever its worker believes about its lock connection. A write
-- with no attempt (a run outside a worker, which no sweeper resumes) is not
-- checked.
--
-- loomflow_worker_holds(request, attempt) is that check, for the journal's
-- statements (which name no ledger table) and the ledger's finish: true while
-- the attempt is open (or for no attempt), else it raises SQLSTATE LW001
-- (loomflow_worker.runtime.errors.FENCED_SQLSTATE) and the statement lands
-- nothing. A primary-key lookup. STABLE: it reads the calling statement's
-- snapshot, so a finish that closes the attempt in the same statement is
-- checked against the attempt as it was (only IMMUTABLE calls are folded into
-- a plan).
CREATE OR REPLACE FUNCTION loomflow_worker_holds(req TEXT, att INTEGER) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF req IS NULL OR EXISTS (
        SELECT 1 FROM run_attempts
         WHERE request_id = req AND attempt = att AND ended_at IS NULL) THEN
        RETURN true;
    END IF;
    RAISE EXCEPTION 'attempt % of request % has ended: its writes are refused', att, req
        USING ERRCODE = 'LW001',
              HINT = 'the request was resumed by another attempt: this one was fenced';
END $$;

-- An attempt that never ended (its process died, or was stopped past its
-- lease) is ended "died" when its request's next attempt starts, so no attempt
-- stays open once its death is known. A death is still shared with the other
-- attempts of its process, as one never ended was: "died" counts as open there.
CREATE INDEX IF NOT EXISTS run_attempts_died ON run_attempts (worker)
    WHERE outcome IS NULL OR outcome = 'died';

CREATE OR REPLACE FUNCTION loomflow_worker_last_attempt(req TEXT, att INTEGER,
                                                        OUT outcome TEXT, OUT shared BOOLEAN)
LANGUAGE sql STABLE AS $$
    SELECT nullif(a.outcome, 'died'),
           coalesce(a.outcome, 'died') = 'died' AND (EXISTS (
               SELECT 1 FROM run_attempts b
                WHERE b.worker = a.worker AND b.boot IS NOT DISTINCT FROM a.boot
                  AND (b.outcome IS NULL OR b.outcome = 'died') AND b.request_id <> a.request_id)
           OR a.isolation = 1 AND EXISTS (
               SELECT 1 FROM run_attempts b
                WHERE b.worker = a.worker AND b.boot IS NOT DISTINCT FROM a.boot
                  AND b.isolation = 1 AND b.request_id <> a.request_id))
      FROM run_attempts a
     WHERE a.request_id = req AND a.attempt = att
$$;
