-- Pruning (runtime.prune: `loomflow-worker prune`, the store's prune, the sweeper's
-- retention). One set of rules. What matches every filter given goes: journal entries,
-- streams and checkpoints written before "before" (epoch seconds), undelivered signals
-- sent before "cutoff" and runs made outside Celery (direct_runs) started and ended (or never
-- recorded an end) before it, of the scope "scope"; then requests finished before "cutoff" (the
-- same moment; their attempts cascade), of that scope. The scopes of unfinished requests
-- keep their journal (a run parked on a signal for longer than the cutoff still needs it to
-- resume), and unless one scope is named, every scope keeps its epoch bookkeeping (a later
-- run must not reuse an old epoch). NULL: no filter.
--
-- The ledger is read and pruned through its two views (migration 0030): the scopes with
-- an unfinished request, and the finished requests.
--
-- Each batch deletes by ctid (or primary key) from an ARRAY of at most `batch` rows, DELETE
-- having no LIMIT, and skips the rows a running step has locked.

-- name: prune_cutoff
-- The moment ``age`` seconds ago on the database's clock: every age the ledger
-- and journal hold is measured on it, whatever the caller's clock says.
SELECT now() - make_interval(secs => %(age)s::float8) AS cutoff;

-- name: prune_counts
-- What the prune_* queries would delete now (a progress bar's length).
SELECT (SELECT count(*) FROM journal_steps j
         WHERE (%(before)s::float8 IS NULL OR j.created_at < %(before)s::float8)
           AND (%(scope)s::text IS NULL OR j.session_id = %(scope)s::text)
           AND (%(scope)s::text IS NOT NULL
                OR j.step_name NOT IN ('__run_epoch__', '__last_run_epoch__'))
           AND NOT EXISTS (SELECT 1 FROM loomflow_worker_unfinished_scopes u
                              WHERE u.scope = j.session_id)) AS journal_steps,
       (SELECT count(*) FROM journal_streams j
         WHERE (%(before)s::float8 IS NULL OR j.created_at < %(before)s::float8)
           AND (%(scope)s::text IS NULL OR j.session_id = %(scope)s::text)
           AND NOT EXISTS (SELECT 1 FROM loomflow_worker_unfinished_scopes u
                              WHERE u.scope = j.session_id)) AS journal_streams,
       (SELECT count(*) FROM checkpoints c
         WHERE (%(before)s::float8 IS NULL OR c.created_at < %(before)s::float8)
           AND (%(scope)s::text IS NULL OR c.session_id = %(scope)s::text)
           AND NOT EXISTS (SELECT 1 FROM loomflow_worker_unfinished_scopes u
                              WHERE u.scope = c.session_id)) AS checkpoints,
       (SELECT count(*) FROM signals s
         WHERE (%(cutoff)s::timestamptz IS NULL OR s.created_at < %(cutoff)s::timestamptz)
           AND (%(scope)s::text IS NULL OR s.scope = %(scope)s::text)
           AND NOT loomflow_worker_signal_awaited(s.scope, s.session_id, s.user_id))
       AS signals,
       (SELECT count(*) FROM direct_runs d
         WHERE (%(cutoff)s::timestamptz IS NULL
                OR coalesce(d.finished_at, d.started_at) < %(cutoff)s::timestamptz)
           AND (%(scope)s::text IS NULL OR d.scope = %(scope)s::text)) AS direct_runs,
       (SELECT count(*) FROM loomflow_worker_finished_requests
         WHERE (%(cutoff)s::timestamptz IS NULL
                OR (enqueued_at < %(cutoff)s::timestamptz
                    AND finished_at < %(cutoff)s::timestamptz))
           AND (%(scope)s::text IS NULL OR scope = %(scope)s::text)) AS runs,
       (SELECT count(*) FROM fairness_keys f
         WHERE %(scope)s::text IS NULL
           AND loomflow_worker_fair_key_at_rest(
                   f, coalesce((SELECT c.vtime FROM fair_clock c WHERE c.id = 1), 0)))
       AS fairness_keys;

-- name: prune_steps
-- One batch of journal steps that the rules above prune; the age filter reads
-- journal_steps_created, the scope filter the primary key.
DELETE FROM journal_steps WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM journal_steps j
     WHERE (%(before)s::float8 IS NULL OR j.created_at < %(before)s::float8)
       AND (%(scope)s::text IS NULL OR j.session_id = %(scope)s::text)
       AND (%(scope)s::text IS NOT NULL
            OR j.step_name NOT IN ('__run_epoch__', '__last_run_epoch__'))
       AND NOT EXISTS (SELECT 1 FROM loomflow_worker_unfinished_scopes u
                          WHERE u.scope = j.session_id)
     LIMIT %(batch)s FOR UPDATE SKIP LOCKED));

-- name: prune_streams
-- One batch of journal streams that the rules above prune, as prune_steps (streams hold no
-- epoch bookkeeping).
DELETE FROM journal_streams WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM journal_streams j
     WHERE (%(before)s::float8 IS NULL OR j.created_at < %(before)s::float8)
       AND (%(scope)s::text IS NULL OR j.session_id = %(scope)s::text)
       AND NOT EXISTS (SELECT 1 FROM loomflow_worker_unfinished_scopes u
                          WHERE u.scope = j.session_id)
     LIMIT %(batch)s FOR UPDATE SKIP LOCKED));

-- name: prune_checkpoints
-- One batch of checkpoints that the rules above prune, as prune_steps (checkpoints_created
-- for the age).
DELETE FROM checkpoints WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM checkpoints c
     WHERE (%(before)s::float8 IS NULL OR c.created_at < %(before)s::float8)
       AND (%(scope)s::text IS NULL OR c.session_id = %(scope)s::text)
       AND NOT EXISTS (SELECT 1 FROM loomflow_worker_unfinished_scopes u
                          WHERE u.scope = c.session_id)
     LIMIT %(batch)s FOR UPDATE SKIP LOCKED));

-- name: prune_signals
-- Undelivered signals sent before the cutoff, of the scope. A session with an
-- unfinished request keeps those sent to its request's user, and those sent
-- to no user (any user's run may take them).
DELETE FROM signals WHERE id = ANY(ARRAY(
    SELECT id FROM signals s
     WHERE (%(cutoff)s::timestamptz IS NULL OR s.created_at < %(cutoff)s::timestamptz)
       AND (%(scope)s::text IS NULL OR s.scope = %(scope)s::text)
       AND NOT loomflow_worker_signal_awaited(s.scope, s.session_id, s.user_id)
     LIMIT %(batch)s FOR UPDATE SKIP LOCKED));

-- name: prune_direct_runs
-- One batch of runs made outside Celery that ended before the cutoff, or started before it
-- and never recorded an end (their process died); direct_runs_started bounds the scan (a
-- run that ended before the cutoff started before it).
DELETE FROM direct_runs WHERE run_id = ANY(ARRAY(
    SELECT run_id FROM direct_runs d
     WHERE (%(cutoff)s::timestamptz IS NULL
            OR (d.started_at < %(cutoff)s::timestamptz
                AND coalesce(d.finished_at, d.started_at) < %(cutoff)s::timestamptz))
       AND (%(scope)s::text IS NULL OR d.scope = %(scope)s::text)
     LIMIT %(batch)s FOR UPDATE SKIP LOCKED));

-- name: prune_runs
-- One batch of finished requests that the rules above prune (their attempts cascade).
-- enqueued_at bounds the scan of runs_status: a request finished before the cutoff was
-- enqueued before it.
DELETE FROM loomflow_worker_finished_requests WHERE request_id = ANY(ARRAY(
    SELECT request_id FROM loomflow_worker_finished_requests
     WHERE (%(cutoff)s::timestamptz IS NULL
            OR (enqueued_at < %(cutoff)s::timestamptz AND finished_at < %(cutoff)s::timestamptz))
       AND (%(scope)s::text IS NULL OR scope = %(scope)s::text)
     LIMIT %(batch)s FOR UPDATE SKIP LOCKED));

-- name: prune_fairness_keys
-- One batch of fairness keys at rest (loomflow_worker_fair_key_at_rest: a look
-- would take the key for one it never saw), whatever their age: such a row says
-- nothing a missing one does not. None when one scope is named (a key is no
-- scope's). A key an enqueue is marking, or a look is weighing, is locked: skipped.
DELETE FROM fairness_keys WHERE fairness_key = ANY(ARRAY(
    SELECT f.fairness_key FROM fairness_keys f
     WHERE %(scope)s::text IS NULL
       AND loomflow_worker_fair_key_at_rest(
               f, coalesce((SELECT c.vtime FROM fair_clock c WHERE c.id = 1), 0))
     LIMIT %(batch)s FOR UPDATE SKIP LOCKED));
