-- The ledger as the operator tools read it (loomflow_worker.admin, the CLI, the console's
-- run and usage pages), run by its gateways execution.ledger_reads and ledger_views: the
-- reads behind `loomflow-worker requests`, `show`, `versions`, `usage` and the commands that
-- wait for a request. The operator tools' other reads are in admin/sql/admin.sql.

-- name: admin_list_runs
-- `loomflow-worker requests`: requests newest first (seq) matching every filter given (NULL:
-- none), ages by enqueue time on the database's clock, at least min_cost dollars, at most
-- `limit`; with each one's executed (billed) tokens and cost. Why it waits
-- (waiting_for): when queued, or parked on a cost budget or a concurrency
-- limit while still marked running (its last attempt's worker died and the
-- attempt that resumed it parked before it started).
SELECT request_id, session_id, user_id, agent, status, attempts, enqueued_at, finished_at,
       holder AS worker, not_before,
       CASE WHEN status = 'queued' OR waiting_budget IS NOT NULL OR waiting_slots IS NOT NULL
            THEN waiting_for END AS waiting_for, agent_version,
       CASE WHEN status = 'queued' THEN version_wait_since END AS version_wait_since,
       model_calls, input_tokens + output_tokens + cache_read_tokens + cache_write_tokens
           AS tokens, cost, price_unknown
  FROM runs
 WHERE (%(session_id)s::text IS NULL OR session_id = %(session_id)s::text)
   AND (%(user_id)s::text IS NULL OR user_id = %(user_id)s::text)
   AND (%(statuses)s::text[] IS NULL OR status = ANY(%(statuses)s::text[]))
   AND (%(older)s::float8 IS NULL OR enqueued_at < now() - make_interval(secs => %(older)s))
   AND (%(newer)s::float8 IS NULL OR enqueued_at >= now() - make_interval(secs => %(newer)s))
   AND (%(min_cost)s::numeric IS NULL OR cost >= %(min_cost)s::numeric)
 ORDER BY seq DESC
 LIMIT %(limit)s;

-- name: admin_list_runs_by_cost
-- `loomflow-worker requests --sort cost`: as admin_list_runs, the requests that cost
-- something, the costliest first: a scan of runs_cost (migration 0039) in its order.
SELECT request_id, session_id, user_id, agent, status, attempts, enqueued_at, finished_at,
       holder AS worker, not_before,
       CASE WHEN status = 'queued' OR waiting_budget IS NOT NULL OR waiting_slots IS NOT NULL
            THEN waiting_for END AS waiting_for, agent_version,
       CASE WHEN status = 'queued' THEN version_wait_since END AS version_wait_since,
       model_calls, input_tokens + output_tokens + cache_read_tokens + cache_write_tokens
           AS tokens, cost, price_unknown
  FROM runs
 WHERE cost > 0
   AND (%(session_id)s::text IS NULL OR session_id = %(session_id)s::text)
   AND (%(user_id)s::text IS NULL OR user_id = %(user_id)s::text)
   AND (%(statuses)s::text[] IS NULL OR status = ANY(%(statuses)s::text[]))
   AND (%(older)s::float8 IS NULL OR enqueued_at < now() - make_interval(secs => %(older)s))
   AND (%(newer)s::float8 IS NULL OR enqueued_at >= now() - make_interval(secs => %(newer)s))
   AND (%(min_cost)s::numeric IS NULL OR cost >= %(min_cost)s::numeric)
 ORDER BY cost DESC, seq DESC
 LIMIT %(limit)s;

-- name: admin_run_status
-- A request's status and outcome (result or error): run_status, and wait_for which polls it.
-- A primary-key lookup.
SELECT status, result, error, error_type FROM runs WHERE request_id = %(request_id)s;

-- name: get_run
-- One request as `show` and the console's run page read it (admin.RunDetail),
-- its prompt cut to `prompt_chars` characters (NULL: whole), with the
-- database's clock. The version of its agent it is pinned to, since when it
-- waits for a worker of that version (queued), whether a live worker serves
-- that version, and when one was last seen (NULL: none known); how many
-- deaths it shared with other runs of its process since it last completed a
-- step (suspicion).
SELECT request_id, seq, scope, session_id, user_id, agent, kind,
       CASE WHEN %(prompt_chars)s::integer IS NULL THEN prompt
            ELSE left(prompt, %(prompt_chars)s) END AS prompt,
       length(prompt) AS prompt_length, metadata, status, epoch, attempts AS attempts_count,
       failures, crashes, holder AS worker, cancel_requested, result, error, error_type, enqueued_at,
       started_at, heartbeat_at, finished_at, not_before, now() AS now,
       CASE WHEN status = 'queued' OR waiting_budget IS NOT NULL OR waiting_slots IS NOT NULL
            THEN waiting_for END AS waiting_for,
       agent_version, CASE WHEN status = 'queued' THEN version_wait_since END AS version_wait_since,
       v.live AS version_live, v.seen_at AS version_seen_at,
       suspicion,
       model_calls, input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, cost,
       price_unknown, replayed_calls, replayed_tokens, replayed_cost
  FROM runs r
  LEFT JOIN LATERAL (
      SELECT bool_or(w.stopped_at IS NULL
                     AND w.seen_at > now() - make_interval(secs => 2 * w.heartbeat_interval))
             AS live,
             max(w.seen_at) AS seen_at
        FROM worker_agents a JOIN workers w USING (worker)
       WHERE a.agent = r.agent AND a.version = r.agent_version
  ) v ON r.agent_version IS NOT NULL
 WHERE r.request_id = %(request_id)s;

-- name: get_run_upgrades
-- The moves of a request to another version of its agent, oldest first.
SELECT at, from_version, to_version, by FROM run_upgrades
 WHERE request_id = %(request_id)s ORDER BY at;

-- name: get_run_attempts
-- A request's attempts, each with the start of the one after it (where the
-- console's lane of an attempt whose worker died ends), how apart from other
-- runs it ran, and, for one whose worker died, whether that death was shared
-- with other runs of its process (then not a crash of this request, as
-- start_request charges it) and how many other requests' runs died with it;
-- and its model calls' usage (NULL: it recorded none).
SELECT a.attempt, a.worker, a.pid, a.epoch, a.started_at, a.ended_at, a.outcome,
       a.agent_version, a.isolation,
       lead(a.started_at) OVER (ORDER BY a.attempt) AS next_started_at,
       coalesce(d.shared, false) AS shared, coalesce(d.died_with, 0) AS died_with, a.usage
  FROM run_attempts a
  LEFT JOIN LATERAL (
      SELECT (loomflow_worker_last_attempt(a.request_id, a.attempt)).shared,
             (SELECT count(DISTINCT b.request_id) FROM run_attempts b
               WHERE b.worker = a.worker AND b.boot IS NOT DISTINCT FROM a.boot
                 AND (b.outcome IS NULL OR b.outcome = 'died')
                 AND b.request_id <> a.request_id)::integer AS died_with
  ) d ON a.outcome = 'died' OR a.outcome IS NULL AND a.ended_at IS NULL
 WHERE a.request_id = %(request_id)s
 ORDER BY a.attempt;

-- name: agent_versions
-- `loomflow-worker versions`, the console's fleet page and the sweeper's
-- watch: each version of each agent, from the fleet's registry (its live
-- workers, when a worker of it was last seen and built it, whether declared)
-- and from the requests pinned to it (running; queued and waiting for a
-- worker of it, since when; queued otherwise). Newest build first per agent.
WITH served AS (
    SELECT a.agent, a.version, bool_or(a.declared) AS declared,
           array_agg(a.worker ORDER BY a.worker) FILTER (WHERE l.live) AS workers,
           max(w.seen_at) AS seen_at, max(a.built_at) AS built_at
      FROM worker_agents a
      LEFT JOIN workers w USING (worker)
     CROSS JOIN LATERAL (
         SELECT coalesce(w.stopped_at IS NULL AND w.seen_at > now()
                         - make_interval(secs => 2 * w.heartbeat_interval), false) AS live) l
     GROUP BY a.agent, a.version
), pinned AS (
    SELECT agent, agent_version AS version,
           count(*) FILTER (WHERE status = 'running') AS running,
           count(*) FILTER (WHERE status = 'queued' AND version_wait_since IS NOT NULL)
               AS waiting,
           count(*) FILTER (WHERE status = 'queued' AND version_wait_since IS NULL) AS queued,
           min(version_wait_since) AS waiting_since
      FROM runs
     WHERE loomflow_worker_unfinished(status) AND agent_version IS NOT NULL
     GROUP BY agent, agent_version
)
SELECT coalesce(s.agent, p.agent) AS agent, coalesce(s.version, p.version) AS version,
       coalesce(s.declared, false) AS declared, coalesce(s.workers, '{}') AS workers,
       s.seen_at, s.built_at, coalesce(p.running, 0) AS running,
       coalesce(p.waiting, 0) AS waiting, coalesce(p.queued, 0) AS queued, p.waiting_since,
       now() AS now
  FROM served s FULL JOIN pinned p ON p.agent = s.agent AND p.version = s.version
 ORDER BY 1, s.built_at DESC NULLS LAST, 2;

-- name: usage_report
-- `loomflow-worker usage` and the console's usage page: the requests enqueued since `since`
-- that called a model, grouped by agent, fairness key, user or day (UTC): how many, their
-- model calls, executed (billed) tokens by kind and cost, whether some price is unknown, and
-- what replays saved (tokens and cost answered from the journal). An index-only scan of the
-- window on runs_usage (migration 0039), costliest group first.
SELECT CASE %(by)s::text WHEN 'agent' THEN agent
                         WHEN 'key' THEN fairness_key
                         WHEN 'user' THEN user_id
                         ELSE ((enqueued_at AT TIME ZONE 'UTC')::date)::text END AS grp,
       count(*) AS requests, sum(model_calls) AS model_calls,
       sum(input_tokens) AS input_tokens, sum(output_tokens) AS output_tokens,
       sum(cache_read_tokens) AS cache_read_tokens, sum(cache_write_tokens) AS cache_write_tokens,
       sum(cost) AS cost, bool_or(price_unknown) AS price_unknown,
       sum(replayed_calls) AS replayed_calls, sum(replayed_tokens) AS replayed_tokens,
       sum(replayed_cost) AS replayed_cost
  FROM runs
 WHERE enqueued_at >= %(since)s AND (model_calls > 0 OR replayed_calls > 0)
 GROUP BY 1
 ORDER BY sum(cost) DESC, 1
 LIMIT %(limit)s;
