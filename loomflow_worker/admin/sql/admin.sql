-- Operating the fleet (loomflow_worker.admin, the CLI, the console): the doctor's checks, a
-- request's journal, and the direct runs of web processes. Their reads of the ledger are
-- execution/sql/ledger_reads.sql; send_signal is in runtime/sql/signals.sql, and
-- schema_versions in migrate.sql.

-- name: admin_server_version
-- The server's version, which the doctor reports with the database it reached.
SELECT current_setting('server_version');

-- name: get_run_journal
-- The entries of one run, oldest first, at most `limit` (NULL: all): its
-- scope's "<epoch>/..." keys, or at epoch 0 the keys in no namespace; the
-- scope's epoch bookkeeping left out, the stream entries' chunks in.
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
 ORDER BY created_at, step_name
 LIMIT %(limit)s;


-- name: list_direct_runs
-- Runs made through PostgresRuntime outside Celery (direct_runs: a web
-- process's own agent.run), newest first, of a session and user when given.
SELECT run_id, session_id, user_id, epoch, process, started_at, finished_at, outcome, error
  FROM direct_runs
 WHERE (%(session_id)s::text IS NULL OR session_id = %(session_id)s)
   AND (%(user_id)s::text IS NULL OR user_id = %(user_id)s)
 ORDER BY started_at DESC
 LIMIT %(limit)s;

-- name: get_direct_run
-- One run made outside Celery, read as `show` and the console's run page read
-- a request (admin.RequestDetail), of kind "direct": its journal is its
-- scope's at its epoch. Not ended: "running" (or its process died).
SELECT run_id AS request_id, 0::bigint AS seq, scope, session_id, user_id,
       '(outside Celery)' AS agent, 'direct' AS kind, '' AS prompt, 0 AS prompt_length,
       '{}'::jsonb AS metadata,
       CASE outcome WHEN 'succeeded' THEN 'succeeded' WHEN 'raised' THEN 'failed'
                    ELSE 'running' END AS status,
       epoch, 1 AS attempts_count, (outcome = 'raised')::int AS failures, 0 AS crashes,
       process AS worker, false AS cancel_requested, NULL::jsonb AS result, error,
       NULL::text AS error_type, started_at AS enqueued_at, started_at,
       started_at AS heartbeat_at, finished_at, NULL::timestamptz AS not_before, now() AS now,
       pid, outcome
  FROM direct_runs
 WHERE run_id = %(request_id)s;
