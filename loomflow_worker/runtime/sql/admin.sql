-- Operating the fleet (loomflow_worker.admin, the CLI): the doctor's checks and the reads
-- behind `loomflow-worker runs`, `show` and the commands that wait for a request.
-- send_signal is in signals.sql, and schema_versions in migrate.sql.

-- name: admin_server_version
-- The server's version, which the doctor reports with the database it reached.
SELECT current_setting('server_version');

-- name: admin_schema_present
-- Whether the schema table exists (to_regclass is NULL when not): the doctor reads
-- schema_versions only then, so a database never migrated is reported, not an error.
SELECT to_regclass('loomflow_worker_schema') IS NOT NULL;

-- name: admin_list_runs
-- `loomflow-worker runs`: requests newest first (seq) matching every filter given (NULL:
-- none), ages by enqueue time on the database's clock, at most `limit`.
SELECT request_id, session_id, user_id, agent, status, attempts, enqueued_at, finished_at,
       holder AS worker, not_before
  FROM runs
 WHERE (%(session_id)s::text IS NULL OR session_id = %(session_id)s::text)
   AND (%(user_id)s::text IS NULL OR user_id = %(user_id)s::text)
   AND (%(statuses)s::text[] IS NULL OR status = ANY(%(statuses)s::text[]))
   AND (%(older)s::float8 IS NULL OR enqueued_at < now() - make_interval(secs => %(older)s))
   AND (%(newer)s::float8 IS NULL OR enqueued_at >= now() - make_interval(secs => %(newer)s))
 ORDER BY seq DESC
 LIMIT %(limit)s;

-- name: admin_run_status
-- A request's status and outcome (result or error): run_status, and wait_for which polls it.
-- A primary-key lookup.
SELECT status, result, error, error_type FROM runs WHERE request_id = %(request_id)s;

-- name: get_run
-- `loomflow-worker show`: one request's row (admin.get_run); its attempts and journal follow
-- (admin_run_attempts, admin_run_journal).
SELECT request_id, seq, scope, session_id, user_id, agent, kind, prompt, metadata, status,
       epoch, attempts AS attempts_count, failures, crashes, holder, result, error, error_type,
       enqueued_at, started_at, finished_at, not_before
  FROM runs WHERE request_id = %(request_id)s;

-- name: admin_run_attempts
-- A request's attempts in order (its rows of the run_attempts primary key): who ran each,
-- when, and how it ended.
SELECT attempt, worker, pid, epoch, started_at, ended_at, outcome
  FROM run_attempts WHERE request_id = %(request_id)s
 ORDER BY attempt;

-- name: admin_run_journal
-- The entries of one run: its scope's "<epoch>/..." keys, or at epoch 0 the
-- keys in no namespace; the scope's epoch bookkeeping left out.
SELECT false AS stream, step_name, created_at, value FROM journal_steps
 WHERE session_id = %(scope)s
   AND step_name NOT IN ('__run_epoch__', '__last_run_epoch__')
   AND CASE WHEN %(epoch)s::integer > 0
            THEN step_name COLLATE "C" >= %(lo)s AND step_name COLLATE "C" < %(hi)s
            ELSE step_name !~ '^([0-9]+|[0-9a-f]{16})/' END
UNION ALL
SELECT true, step_name, created_at, chunks FROM journal_streams
 WHERE session_id = %(scope)s
   AND CASE WHEN %(epoch)s::integer > 0
            THEN step_name COLLATE "C" >= %(lo)s AND step_name COLLATE "C" < %(hi)s
            ELSE step_name !~ '^([0-9]+|[0-9a-f]{16})/' END
 ORDER BY created_at, step_name;
