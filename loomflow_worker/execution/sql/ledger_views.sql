-- The ledger as the run console reads it, run by its gateway execution.ledger_views (the
-- console's other reads are in console/sql/console.sql): read only, on connections that plan
-- each statement with its values (so a filter given as NULL costs nothing and each one given
-- uses its index, 0010_console.sql). A prompt leaves the database cut to prompt_chars, except
-- on a run's own page when asked.

-- name: console_requests
-- console: the requests list, newest first; keyset paging on seq (before: the last
-- seq of the page shown).
SELECT request_id, seq, session_id, user_id, agent, kind, status, attempts, crashes,
       left(prompt, %(prompt_chars)s) AS prompt, length(prompt) AS prompt_length,
       enqueued_at, started_at, finished_at, holder AS worker
  FROM runs
 WHERE (%(status)s::text IS NULL OR status = %(status)s::text)
   AND (%(session_id)s::text IS NULL OR session_id = %(session_id)s::text)
   AND (%(user_id)s::text IS NULL OR user_id = %(user_id)s::text)
   AND (%(agent)s::text IS NULL OR agent = %(agent)s::text)
   AND (%(since)s::timestamptz IS NULL OR enqueued_at >= %(since)s::timestamptz)
   AND (%(until)s::timestamptz IS NULL OR enqueued_at < %(until)s::timestamptz)
   -- The time window again as bounds on seq, the order of every index above: a
   -- request is numbered moments after its enqueue began (enqueued_at), so every
   -- request enqueued before a time is numbered before any enqueued a minute later.
   AND (%(since)s::timestamptz IS NULL OR seq > coalesce((
           SELECT seq FROM runs
            WHERE enqueued_at < %(since)s::timestamptz - interval '1 minute'
            ORDER BY enqueued_at DESC LIMIT 1), 0))
   AND (%(until)s::timestamptz IS NULL OR seq < coalesce((
           SELECT seq FROM runs
            WHERE enqueued_at >= %(until)s::timestamptz + interval '1 minute'
            ORDER BY enqueued_at LIMIT 1), 9223372036854775807))
   AND (%(before)s::bigint IS NULL OR seq < %(before)s::bigint)
 ORDER BY seq DESC
 LIMIT %(limit)s;

-- name: console_session
-- console: a session's latest requests (every user's scope of it), with whether
-- the request's scope lock is held by the backend the request recorded.
SELECT r.request_id, r.seq, r.session_id, r.user_id, r.agent, r.kind, r.status, r.attempts, r.crashes,
       left(r.prompt, %(prompt_chars)s) AS prompt, length(r.prompt) AS prompt_length,
       r.enqueued_at, r.started_at, r.finished_at, r.holder AS worker, r.cancel_requested,
       (r.status = 'running' AND EXISTS (
           SELECT 1 FROM pg_locks l
            WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
              AND l.pid = r.holder_pid
              AND l.classid = ((r.lock_key >> 32) & 4294967295)::oid
              AND l.objid = (r.lock_key & 4294967295)::oid)) AS holds_lock
  FROM runs r
 WHERE r.session_id = %(session_id)s
 ORDER BY r.seq DESC
 LIMIT %(limit)s;

-- name: console_queue
-- console: the ledger's queue (the queue of record): queued requests ready to
-- run, those waiting out a retry's backoff, and running ones.
SELECT count(*) FILTER (WHERE status = 'queued' AND dispatched_at <= now()) AS ready,
       count(*) FILTER (WHERE status = 'queued' AND dispatched_at > now()) AS backing_off,
       count(*) FILTER (WHERE status = 'running') AS running,
       min(enqueued_at) FILTER (WHERE status = 'queued') AS oldest_queued
  FROM runs WHERE loomflow_worker_unfinished(status);

-- name: console_in_flight
-- console: running requests by the worker process running them (node:pid, stored in the
-- ledger's holder column, which keeps its old name).
SELECT holder AS worker, count(*) AS running, min(started_at) AS oldest_start,
       max(heartbeat_at) AS last_heartbeat, min(heartbeat_at) AS stalest_heartbeat
  FROM runs WHERE status = 'running'
 GROUP BY holder ORDER BY holder;

-- name: console_recent_workers
-- console: worker processes that started attempts within `window` seconds, and how
-- those attempts ended ("died": ended as the next attempt started; a NULL outcome with a
-- later attempt, from a release that left them open: the worker died).
SELECT a.worker, count(*) AS attempts, max(a.started_at) AS last_start,
       count(*) FILTER (WHERE a.outcome = 'died' OR a.outcome IS NULL AND a.ended_at IS NULL
                          AND EXISTS (SELECT 1 FROM run_attempts n
                                       WHERE n.request_id = a.request_id
                                         AND n.attempt > a.attempt)) AS died,
       count(*) FILTER (WHERE a.outcome IN ('interrupted', 'lost')) AS interrupted
  FROM run_attempts a
 WHERE a.started_at > now() - make_interval(secs => %(window)s)
 GROUP BY a.worker ORDER BY max(a.started_at) DESC;

-- name: console_swept
-- console: the requests the sweeper dispatched again, latest first.
SELECT request_id, session_id, user_id, status, attempts, swept_at
  FROM runs WHERE swept_at IS NOT NULL
 ORDER BY swept_at DESC LIMIT %(limit)s;

-- name: console_key_backlog
-- The fleet page's fairness keys with unfinished requests, the most waiting
-- first: how many wait (withheld or parked on a limit among them) and how
-- many run.
SELECT coalesce(fairness_key, coalesce(user_id, session_id)) AS fairness_key,
       count(*) FILTER (WHERE status = 'queued') AS queued,
       count(*) FILTER (WHERE status = 'queued' AND waiting_slots IS NOT NULL) AS on_limit,
       count(*) FILTER (WHERE status = 'running') AS running
  FROM runs WHERE loomflow_worker_unfinished(status)
 GROUP BY 1 ORDER BY queued DESC, running DESC, 1 LIMIT %(limit)s;
