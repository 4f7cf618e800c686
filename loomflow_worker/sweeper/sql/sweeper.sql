-- The sweeper (loomflow_worker.sweeper): every worker process runs one; the one holding the leader
-- lock leads the fleet and finds what the fleet lost: frozen holders, requests whose worker
-- or message is gone, results the result backend lacks. Its own tables (sweeper_leader,
-- sweeper_actions, workers, result_backend_watch) it reaches itself; the ledger only
-- through its two gateways, sweeper.ledger_recovery (these statements on runs, and
-- mark_swept of execution/sql/ledger.sql) and sweeper.ledger_results.

-- name: leader_lock
-- The fleet's one leading sweeper is the one whose connection holds this session advisory
-- lock (LEADER_KEY): tried without waiting on each sweep until taken, released with the
-- connection.
SELECT pg_try_advisory_lock(%(key)s);

-- name: leader_stale
-- The leader's backend pid when it stopped stamping its lease (heartbeat_at older than
-- `lease` seconds): a frozen process still holding the lock, whose connection a follower
-- ends.
SELECT backend_pid FROM sweeper_leader
 WHERE id = 1 AND heartbeat_at < now() - make_interval(secs => %(lease)s);

-- name: terminate_backend
-- A backend's connection ended (a frozen leader's, or a lock connection whose runs stopped
-- heartbeating), which frees its advisory locks; the role must own that backend or have
-- pg_signal_backend.
SELECT pg_terminate_backend(%(pid)s);

-- name: leader_claim
-- The leader's lease stamped on each sweep in the one sweeper_leader row (its worker
-- process, in the column named holder, and its backend pid): the console shows it, and
-- followers take a stale one for a frozen leader.
INSERT INTO sweeper_leader (id, holder, backend_pid) VALUES (1, %(worker)s, pg_backend_pid())
ON CONFLICT (id) DO UPDATE
   SET holder = EXCLUDED.holder, backend_pid = EXCLUDED.backend_pid, heartbeat_at = now();

-- name: stale_running
-- Running requests whose heartbeat is older than the lease: a scan of the
-- running ones, without the lock table (reading pg_locks takes every lock
-- partition of the server, and a fleet's thousand runs hold as many locks).
SELECT request_id
  FROM runs
 WHERE status = 'running' AND lock_key IS NOT NULL
   AND heartbeat_at < now() - make_interval(secs => %(lease)s);

-- name: frozen_holders
-- Of the stale running requests (stale_running), those whose scope's lock is
-- still held, by the backend that holds it; their heartbeat is checked again.
SELECT r.request_id, l.pid
  FROM runs r
  JOIN pg_locks l
    ON l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND l.classid = ((r.lock_key >> 32) & 4294967295)::oid
   AND l.objid = (r.lock_key & 4294967295)::oid
 WHERE r.request_id = ANY(%(request_ids)s)
   AND r.status = 'running' AND r.lock_key IS NOT NULL
   AND r.heartbeat_at < now() - make_interval(secs => %(lease)s)
   AND l.pid = r.holder_pid;

-- name: mark_frozen_lost
-- Attempts whose process stopped heartbeating while it held their locks (frozen,
-- or its loop held past the lease): they end "lost", not crashed, and then the
-- sweeper ends their lock connection (backend `pid`), so their next attempt
-- finds them ended. Those still stale and still held by that backend only.
UPDATE run_attempts a SET ended_at = clock_timestamp(), outcome = 'lost'
  FROM runs r
 WHERE r.request_id = ANY(%(request_ids)s) AND a.request_id = r.request_id
   AND a.attempt = r.attempts AND a.ended_at IS NULL
   AND r.status = 'running' AND r.holder_pid = %(pid)s
   AND r.heartbeat_at < now() - make_interval(secs => %(lease)s);

-- name: queued_queues
-- The queues the queued requests' messages wait in (the default queue for a
-- request with no routing), with how many requests are queued in each,
-- parked or not: the sweeper counts each queue's messages, and the leader
-- reports these counts as the fleet's backlog. A queue that holds only
-- copies out (loomflow_worker_copy_out) is counted too, with none queued
-- (see orphans).
SELECT coalesce(routing->>'queue', %(default_queue)s) AS queue,
       count(*) FILTER (WHERE status = 'queued') AS queued
  FROM runs
 WHERE status = 'queued' OR loomflow_worker_copy_out(status, swept_at, started_at)
 GROUP BY 1;

-- name: orphans
-- The oldest unfinished request of each scope whose lock nobody holds, when its
-- worker died (running) or its message is gone (queued): up to `limit` of them,
-- with its status (`copy_lost`: running, and the copy published since its last
-- start is gone too). Each part below says its rule; the final CASE has one branch per
-- kind of request (parked on a cost budget, for a signal or on a limit; running; queued).
WITH in_broker AS (
    -- Messages the broker may hold, with their age in their queue
    -- (loomflow_worker_in_broker).
    SELECT * FROM loomflow_worker_in_broker(%(default_queue)s::text, %(held_within)s::float8)
), counted AS (
    -- The broker's count of each queue's messages (the arrays `queues` and `waiting`
    -- pair them; a queue not asked, or NULL, is unknown).
    SELECT c.queue, c.waiting
      FROM unnest(%(queues)s::text[], %(waiting)s::bigint[]) AS c(queue, waiting)
), budget AS (
    -- How many of a queue's messages can be gone: its oldest (count - waiting).
    SELECT b.queue, count(*) - min(c.waiting) AS lost
      FROM in_broker b LEFT JOIN counted c USING (queue)
     GROUP BY b.queue
), heads AS (
    -- The oldest unfinished request of each scope (loomflow_worker_scope_heads), read
    -- once for the parts below; whether a live worker says it holds its message
    -- unstarted is loomflow_worker_held.
    SELECT * FROM loomflow_worker_scope_heads
), joined AS MATERIALIZED (
    -- Each head with its message in the broker (`in_broker`, its age there) and its
    -- queue's count of messages that can be gone (`lost`), joined once for the parts
    -- below. Apart, so that Postgres hashes the join: in the final statement, beside
    -- the per-kind CASE, it was planned as a loop reading every broker message again
    -- for each head (1.2 s at 2,000 heads, 36 ms this way).
    SELECT h.*, b.request_id IS NOT NULL AS in_broker, b.age, g.lost
      FROM heads h
      LEFT JOIN in_broker b USING (request_id)
      LEFT JOIN budget g ON g.queue = b.queue
), locks AS MATERIALIZED (
    -- The advisory locks held in this database (the scopes' and the limits' slots).
    SELECT classid, objid FROM loomflow_worker_advisory_locks
), unlocked AS (
    -- The free slots of each concurrency limit some request is parked on.
    SELECT w.waiting_for, count(*) AS free
      FROM (SELECT DISTINCT waiting_for, waiting_slots FROM heads
             WHERE waiting_slots IS NOT NULL) w
     CROSS JOIN unnest(w.waiting_slots) AS k
     WHERE NOT EXISTS (SELECT 1 FROM locks l
                        WHERE l.classid = ((k >> 32) & 4294967295)::oid
                          AND l.objid = (k & 4294967295)::oid)
     GROUP BY w.waiting_for
), outgoing AS (
    -- The messages already on their way to each limit's slots: a request of its
    -- fairness key, of its agent, or published off the limit by next_on_limit, whose
    -- message is out, due, not taken for lost by its queue's count, and published
    -- within `after` or held by a worker (each takes a slot as it starts).
    SELECT x.name, count(DISTINCT h.request_id) AS n
      FROM joined h
     CROSS JOIN unnest(ARRAY['limit per_key:' || h.fairness_key, 'limit agent:' || h.agent,
                             h.waiting_for]) AS x(name)
     WHERE h.status = 'queued' AND h.waiting_slots IS NULL AND x.name IS NOT NULL
       AND (h.received_at IS NULL OR h.dispatched_at > h.received_at)
       AND (h.not_before IS NULL OR h.not_before <= now())
       AND NOT coalesce(h.age <= h.lost, false)
       AND (loomflow_worker_held(h.held_at, h.dispatched_at, %(held_within)s::float8)
            OR h.dispatched_at > now() - make_interval(secs => %(after)s))
     GROUP BY x.name
), room AS (
    -- The room each limit has: its free slots less the messages on their way to them.
    SELECT u.waiting_for, u.free - coalesce(o.n, 0) AS free
      FROM unlocked u LEFT JOIN outgoing o ON o.name = u.waiting_for
), waiting AS (
    -- The place of each request parked on a limit, by priority then age.
    SELECT request_id, waiting_for,
           row_number() OVER (PARTITION BY waiting_for ORDER BY priority_rank, enqueued_at)
           AS place
      FROM heads WHERE waiting_slots IS NOT NULL
)
-- A running one whose copy is gone (see the running branch) reads `copy_lost`.
SELECT h.request_id, h.kind, h.session_id, h.user_id, h.agent, h.prompt, h.metadata,
       h.not_before, h.options, h.routing,
       CASE WHEN loomflow_worker_copy_out(h.status, h.swept_at, h.started_at)
                 AND h.waiting_signal IS NULL AND h.waiting_slots IS NULL
                 AND h.swept_at >= now() - make_interval(secs => %(after)s)
            THEN 'copy_lost' ELSE h.status END AS status
  FROM joined h
 WHERE h.lock_key IS NOT NULL
   -- Parked on a spent cost budget: not an orphan; the leader publishes it once the
   -- budget has room (wake_budget_waiters).
   AND CASE WHEN h.waiting_budget IS NOT NULL THEN false
       WHEN h.waiting_signal IS NOT NULL THEN
            -- Parked for a signal (it gave its slot back to wait): published again once
            -- the signal waits in the session's mailbox it waits on, for its user; at
            -- once unless published since it parked (its signal's sender publishes it
            -- as it sends), then at most every queued_after (mark_swept says the same).
            EXISTS (SELECT 1 FROM signals s
                     WHERE s.session_id = h.waiting_signal_session
                       AND s.name = h.waiting_signal
                       AND (s.user_id IS NULL OR s.user_id = h.user_id))
            AND (h.swept_at IS NULL OR h.swept_at < h.received_at
                 OR h.swept_at < now() - make_interval(secs => %(queued_after)s))
       WHEN h.waiting_slots IS NOT NULL THEN
            -- Parked on a full concurrency limit (queued, or running when its last
            -- attempt's worker died): published again only once the limit has room for
            -- it (the oldest of its parked requests first), then after queued_after.
            EXISTS (SELECT 1 FROM waiting w JOIN room m USING (waiting_for)
                     WHERE w.request_id = h.request_id AND w.place <= m.free)
            AND h.dispatched_at < now() - make_interval(secs => %(queued_after)s)
            AND (h.swept_at IS NULL
                 OR h.swept_at < now() - make_interval(secs => %(queued_after)s))
       WHEN h.status = 'running' THEN
            -- Running with a heartbeat older than dead_after: its worker died (one that
            -- merely lost its lock stops its own run within a heartbeat). Dispatched
            -- again at once, then again only when an attempt started since died too,
            -- or after `after` seconds, or when the copy published since its last start
            -- is gone as a queued request's message is: a copy that went to a process
            -- that died before it started it (as a poison request's second process
            -- does) is in no queue and held by no live worker.
            h.heartbeat_at < now() - make_interval(secs => %(dead_after)s)
            AND (h.swept_at IS NULL OR h.swept_at < h.started_at
                 OR h.swept_at < now() - make_interval(secs => %(after)s)
                 OR (NOT loomflow_worker_held(h.held_at, h.dispatched_at, %(held_within)s::float8)
                     AND h.swept_at < now() - make_interval(secs => %(queued_after)s)
                     AND h.age <= h.lost))
       ELSE
            -- Queued: its message is gone when no live worker holds it and, past
            -- queued_after (a message on its way to a worker is counted nowhere for a
            -- moment), it is among its queue's oldest beyond the broker's count, or its
            -- publish failed (dispatched_at -infinity: published at once, with its eta),
            -- or its queue's count is unknown and `after` seconds passed. One received
            -- and parked, not published since, is in no broker: it goes after
            -- queued_after. One that may not start yet (not_before: a countdown or eta)
            -- has its message held by a worker until then, counted in no queue: it goes
            -- no sooner than queued_after past its not_before.
            NOT loomflow_worker_held(h.held_at, h.dispatched_at, %(held_within)s::float8)
            AND h.dispatched_at < now() - make_interval(secs => %(queued_after)s)
            AND (h.dispatched_at = '-infinity'
                 OR coalesce(h.not_before, '-infinity')
                    < now() - make_interval(secs => %(queued_after)s))
            AND (h.swept_at IS NULL
                 OR h.swept_at < now() - make_interval(secs => %(queued_after)s))
            AND (NOT h.in_broker OR h.dispatched_at = '-infinity'
                 OR h.age <= h.lost
                 OR (h.lost IS NULL
                     AND greatest(h.dispatched_at, h.not_before)
                         < now() - make_interval(secs => %(after)s)))
       END
   -- And nobody holds its scope's lock: a NOT IN over the locks read once, answered
   -- from a hash table (a NOT EXISTS on pg_locks was planned as a loop reading the
   -- lock table again for each head: 0.7 s at 1,500 heads and 230 locks).
   AND (((h.lock_key >> 32) & 4294967295)::oid, (h.lock_key & 4294967295)::oid)
       NOT IN (SELECT classid, objid FROM locks)
 LIMIT %(limit)s;

-- name: unfinished_among
-- Which of the ids Celery revoked are still unfinished in the ledger (revoked while their
-- message waited, so no worker ended them): the sweeper ends those. One primary-key lookup
-- per id.
SELECT request_id FROM runs
 WHERE request_id = ANY(%(request_ids)s::text[]) AND loomflow_worker_unfinished(status);

-- name: unstored_results
-- Finished requests whose worker could not store their result in the result backend, oldest
-- first, at most `limit`: the sweeper stores them from the ledger. Reads the partial index
-- runs_result_unstored.
SELECT request_id FROM runs WHERE NOT result_stored ORDER BY finished_at LIMIT %(limit)s;

-- name: unchecked_results
-- Requests finished between `after` and `within` seconds ago whose result the
-- sweeper has not yet checked in the result backend. A request whose worker
-- process still lives (stamped within two of its heartbeat intervals) stores
-- its result itself, however busy it is: it waits `alive_after` seconds.
SELECT c.request_id FROM results_to_check c
  LEFT JOIN runs r ON r.request_id = c.request_id
  LEFT JOIN workers w
    ON w.worker = r.holder AND w.stopped_at IS NULL
   AND w.seen_at > now() - make_interval(secs => 2 * w.heartbeat_interval)
 WHERE c.finished_at < now() - make_interval(
           secs => CASE WHEN w.worker IS NULL THEN %(after)s ELSE %(alive_after)s END)
   AND c.finished_at > now() - make_interval(secs => %(within)s)
 ORDER BY c.finished_at LIMIT %(limit)s;

-- name: request_outcomes
-- What the result backend lacks for these finished requests, as the ledger has
-- it, and how long ago each ended (its result lives result_expires from then).
SELECT request_id, status, result, error, error_type,
       extract(epoch FROM now() - finished_at)::float8 AS age
  FROM runs
 WHERE request_id = ANY(%(request_ids)s) AND loomflow_worker_finished(status);

-- name: mark_result_stored
-- The results the sweeper stored from the ledger: no longer waiting (they leave
-- runs_result_unstored).
UPDATE runs SET result_stored = true
 WHERE request_id = ANY(%(request_ids)s);

-- name: mark_result_checked
-- The results checked (found in the backend, stored from the ledger, or whose request was
-- pruned) leave results_to_check, and with them those past looking back to (finished over
-- `within` seconds ago).
DELETE FROM results_to_check
 WHERE request_id = ANY(%(request_ids)s)
    OR finished_at < now() - make_interval(secs => %(within)s);

-- name: forget_workers
-- Worker processes not seen for `after` seconds (an autoscaled fleet's
-- long-gone ones), and the agents they served; how many processes.
WITH gone AS (
    DELETE FROM workers WHERE seen_at < now() - make_interval(secs => %(after)s)
    RETURNING worker
), agents AS (
    DELETE FROM worker_agents a USING gone g WHERE a.worker = g.worker
)
SELECT count(*) FROM gone;

-- name: record_sweeper_actions
-- What one sweep did, in one statement that also keeps the table short: the
-- last `keep` actions, none older than `keep_for` seconds.
WITH added AS (
    INSERT INTO sweeper_actions (worker, action, request_id, detail)
    SELECT %(worker)s, a.action, a.request_id, a.detail
      FROM unnest(%(actions)s::text[], %(request_ids)s::text[], %(details)s::text[])
           AS a(action, request_id, detail)
    RETURNING id
)
DELETE FROM sweeper_actions
 WHERE id <= (SELECT max(id) FROM added) - %(keep)s
    OR at < now() - make_interval(secs => %(keep_for)s);

-- name: next_orphan
-- In how many seconds the next running request whose lock nobody holds (its
-- worker died a moment ago) is dead_after past its last heartbeat, and so an
-- orphan: the leader sweeps again then, not up to a sweep interval later.
-- NULL: no such request.
SELECT extract(epoch FROM min(r.heartbeat_at) - now())::float8 + %(dead_after)s
  FROM runs r
 WHERE r.status = 'running' AND r.lock_key IS NOT NULL
   AND r.heartbeat_at >= now() - make_interval(secs => %(dead_after)s)
   AND NOT EXISTS (
       SELECT 1 FROM loomflow_worker_advisory_locks l
        WHERE l.classid = ((r.lock_key >> 32) & 4294967295)::oid
          AND l.objid = (r.lock_key & 4294967295)::oid);

-- name: mark_unswept
-- The broker refused the sweeper's batch (which of its messages went is
-- unknown): each goes again on the next sweep the broker answers, a queued
-- one first among its queue's, as if never published.
UPDATE runs SET swept_at = NULL,
       dispatched_at = CASE WHEN status = 'queued' THEN '-infinity' ELSE dispatched_at END
 WHERE request_id = ANY(%(request_ids)s::text[]);

-- name: backend_watch
-- What the sweeper's leader last knew of the result backend (see the table
-- result_backend_watch), and the database's clock: the mark it leaves next.
SELECT token, mark, evicted, recheck_at, recheck_seq, recheck_until, now() AS now
  FROM result_backend_watch WHERE id = 1;

-- name: backend_watched
-- What the leader knows now of the result backend: the mark it left, the
-- evictions counted, how far a re-check got (none: NULL); a re-check `widen`ed
-- reaches the requests ended until now. The database's clock comes back, the
-- mark it leaves next.
UPDATE result_backend_watch
   SET mark = %(mark)s, evicted = %(evicted)s,
       recheck_at = %(recheck_at)s, recheck_seq = %(recheck_seq)s,
       recheck_until = CASE WHEN %(recheck_at)s::timestamptz IS NULL THEN NULL
                            WHEN %(widen)s THEN now() ELSE recheck_until END
 WHERE id = 1
RETURNING now(), recheck_until;

-- name: results_to_recheck
-- The next finished requests whose result is wanted, in the order they ended,
-- after (`at`, `seq`) and until `until`: what a re-check of the result backend
-- looks for, a batch at a time (through runs_finished).
SELECT request_id, finished_at, seq FROM runs
 WHERE finished_at IS NOT NULL AND NOT ignore_result
   AND (finished_at, seq) > (%(at)s::timestamptz, %(seq)s::bigint)
   AND finished_at <= coalesce(%(until)s::timestamptz, now())
 ORDER BY finished_at, seq LIMIT %(limit)s;
