-- The run console's own reads (loomflow_worker.console.data): the fleet's workers, their
-- connections, the sweeper's leader and its actions, read only, on connections that plan
-- each statement with its values. Its reads of the ledger's tables (runs, run_attempts) are
-- the ledger's, run by its gateway execution.ledger_views (execution/sql/ledger_views.sql).

-- name: console_workers
-- console: worker processes seen by heartbeat within `window` seconds, latest
-- first: live, stale (no beat for over two of its intervals: gone without
-- closing, or frozen) or stopped (closed cleanly); with its load at its last
-- beat (loop lag, lock-connection queue, whether it took new requests).
SELECT worker, hostname, pid, slots, runs, heartbeat_interval, started_at, seen_at,
       stopped_at, loop_lag, lock_queue, admitting,
       CASE WHEN stopped_at IS NOT NULL THEN 'stopped'
            WHEN seen_at < now() - make_interval(secs => 2 * heartbeat_interval) THEN 'stale'
            ELSE 'live' END AS state
  FROM workers
 WHERE seen_at > now() - make_interval(secs => %(window)s)
 ORDER BY (stopped_at IS NULL) DESC, seen_at DESC, worker
 LIMIT %(limit)s;

-- name: console_connections
-- console: the fleet's Postgres connections by role (lock, sweeper, pool...) and
-- client address: each worker process keeps one sweeper connection.
SELECT application_name, client_addr::text AS client_addr, count(*) AS connections,
       min(backend_start) AS oldest
  FROM pg_stat_activity
 WHERE datname = current_database() AND starts_with(application_name, 'loomflow-worker')
 GROUP BY application_name, client_addr ORDER BY application_name, client_addr;

-- name: console_leader
-- console: the sweeper's leader (the worker process leading, in the holder column) and
-- whether its connection is still there.
SELECT holder AS worker, backend_pid, heartbeat_at, now() - heartbeat_at AS age,
       EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = l.backend_pid) AS connected
  FROM sweeper_leader l WHERE id = 1;

-- name: console_sweeper_actions
-- console: the sweeper's latest actions, latest first.
SELECT id, at, worker, action, request_id, detail
  FROM sweeper_actions
 ORDER BY id DESC LIMIT %(limit)s;
