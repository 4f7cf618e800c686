-- The run ledger (execution.ledger): one row per request in runs (seq: its order of
-- acceptance) and one per attempt in run_attempts. A scope's unfinished requests are found
-- through runs_scope_open, the partial index (scope, seq) of queued and running requests:
-- loomflow_worker_unfinished(status) is inlined, so the planner uses it
-- (tests/integration/test_sql_plans.py). Statuses are named by the SQL functions of
-- 0014_vocabulary.sql, never spelled out as a list here. The worker running a request
-- (node:pid) is stored in runs.holder: the column keeps its old name, since renaming it
-- would break workers of the previous release during a rolling deploy.

-- name: enqueue_lock
-- Enqueues on one scope take turns: a transaction-level lock on the scope's enqueue key (not
-- its run lock, which a running request holds), so on_busy "reject" and "interrupt" look at
-- the scope's unfinished requests and insert with no enqueue between.
SELECT pg_advisory_xact_lock(%(key)s);

-- name: recorded_request
-- What a request was enqueued with: a second enqueue under its id must match.
SELECT kind, session_id, user_id, agent, prompt, metadata FROM runs
 WHERE request_id = %(request_id)s;

-- name: scope_busy
-- The scope's oldest unfinished request, if any (runs_scope_open): on_busy "reject" refuses
-- the enqueue and names it.
SELECT request_id, status FROM runs
 WHERE scope = %(scope)s AND loomflow_worker_unfinished(status)
 ORDER BY seq LIMIT 1;

-- name: generic_plans
-- What an enqueue pool's connection says first: its prepared statements are planned once,
-- not at each call. Postgres plans a prepared statement with its values (a custom plan)
-- until a plan for any values (a generic one) looks as cheap: insert_run's never does, as
-- its checks for the per_key and fair_queue limits, skipped by their parameters at run
-- time, count in its generic plan's cost; it was planned again at every enqueue, 0.76 ms
-- of the server's CPU against 0.17 ms to run it. Every statement of this pool finds its
-- rows by a key it is given or in an index its parameters name, whatever their values.
SET plan_cache_mode = force_generic_plan;

-- name: insert_run
-- A request recorded queued (an enqueue, or a message that came with no row); no row back
-- when the id is taken (recorded_request says by whom), else its not_before and whether it
-- was withheld. A countdown is measured on the database's clock, an eta is a moment.
-- With hold_after (the per_key concurrency limit), a request whose fairness key has that
-- many unfinished requests already out (published, running, or waiting for their session:
-- runs_fairness_open), or has requests withheld already (runs_waiting_for), is
-- withheld, parked on its key's limit as a worker would park it, and not published: the
-- broker then holds a handful of one tenant's backlog, not all of it, and the others'
-- requests are not queued behind it. Those withheld are published one per slot that frees,
-- in their order (next_on_limit), and a new request waits behind them: it neither jumps
-- the key's line nor takes the slot a run that ends hands on. (That look asks "not
-- finished" rather than "unfinished", the same thing, so that it probes runs_waiting_for
-- alone, not a bitmap of every withheld request with runs_scope_open.)
-- With fair_depth (the fair_queue limit), a request that may start now is withheld too
-- while others wait in line for their fair share, or while fair_depth requests wait in the
-- broker already (runs_in_broker): loomflow_worker_fair_next publishes it in its turn.
INSERT INTO runs (request_id, scope, session_id, user_id, agent, kind, prompt, metadata,
                  lock_key, not_before, ignore_result, routing, fairness_key, waiting_for,
                  waiting_slots, received_at, options, priority_rank)
SELECT %(request_id)s, %(scope)s, %(session_id)s, %(user_id)s, %(agent)s, %(kind)s,
       %(prompt)s, %(metadata)s, %(lock_key)s,
       CASE WHEN %(countdown)s::float8 IS NOT NULL
            THEN now() + make_interval(secs => %(countdown)s::float8)
            ELSE %(eta)s::timestamptz END,
       %(ignore_result)s, %(routing)s::jsonb, %(fairness_key)s::text,
       CASE WHEN h.held THEN 'limit per_key:' || %(fairness_key)s::text
            WHEN h.fair THEN 'limit fair_queue' END,
       CASE WHEN h.held THEN %(slots)s::bigint[] WHEN h.fair THEN '{}'::bigint[] END,
       CASE WHEN h.held OR h.fair THEN now() END,
       CASE WHEN h.held OR h.fair THEN %(options)s::jsonb END, %(priority_rank)s
  FROM (SELECT %(hold_after)s::integer IS NOT NULL
               AND (EXISTS (SELECT 1 FROM runs
                             WHERE waiting_slots IS NOT NULL
                               AND waiting_for = 'limit per_key:' || %(fairness_key)s::text
                               AND NOT loomflow_worker_finished(status))
                    OR (SELECT count(*) FROM (
                           SELECT 1 FROM runs
                            WHERE fairness_key = %(fairness_key)s::text
                              AND loomflow_worker_unfinished(status) AND waiting_slots IS NULL
                            LIMIT %(hold_after)s::integer) o) >= %(hold_after)s::integer)
               AS held,
               %(fair_depth)s::integer IS NOT NULL AND %(options)s::jsonb IS NOT NULL
               AND %(countdown)s::float8 IS NULL AND %(eta)s::timestamptz IS NULL
               AND (EXISTS (SELECT 1 FROM runs
                             WHERE waiting_for = 'limit fair_queue' AND status = 'queued')
                    OR (SELECT count(*) FROM (
                           SELECT 1 FROM runs
                            WHERE status = 'queued' AND waiting_slots IS NULL
                              AND not_before IS NULL
                              AND (received_at IS NULL OR dispatched_at > received_at)
                            LIMIT %(fair_depth)s::integer) o) >= %(fair_depth)s::integer)
               AS fair) h
ON CONFLICT (request_id) DO NOTHING
RETURNING not_before, waiting_slots IS NOT NULL AS held;

-- name: fair_next
-- Withheld requests published in their fair turn (see loomflow_worker_fair_next), at most
-- `page`; `wait` false: none when another caller is publishing them.
SELECT * FROM loomflow_worker_fair_next(%(wait)s, %(page)s);

-- name: fair_next_stamped
-- The same, looked for by worker process `worker`, which carries `runs` runs now and
-- takes new requests or not (`admitting`): its row says so first (see
-- loomflow_worker_fair_next with five arguments).
SELECT * FROM loomflow_worker_fair_next(%(wait)s, %(page)s, %(worker)s, %(runs)s,
                                        %(admitting)s);

-- name: set_call_weight
-- The weight a request stated for its fairness key (fairness_weight), used while no
-- weight is set for the key.
INSERT INTO fairness_keys (fairness_key, call_weight) VALUES (%(fairness_key)s, %(weight)s)
ON CONFLICT (fairness_key) DO UPDATE SET call_weight = EXCLUDED.call_weight, updated_at = now()
 WHERE fairness_keys.call_weight IS DISTINCT FROM EXCLUDED.call_weight;

-- name: cancel_requests
-- Cancel one request (request_id), or every unfinished request of a scope
-- older than a given one (scope and by). A queued request that never started
-- is cancelled on the spot (it has no epoch and journaled nothing); any other
-- unfinished one is flagged and stops at its next step boundary, or when it
-- is next picked up: by any worker, whatever version it is pinned to (one
-- waiting for a version goes back to its own queue's routing).
UPDATE runs
   SET cancel_requested = true,
       status = CASE WHEN status = 'queued' AND epoch IS NULL THEN 'cancelled' ELSE status END,
       error = CASE WHEN status = 'queued' AND epoch IS NULL THEN %(reason)s ELSE error END,
       error_type = CASE WHEN status = 'queued' AND epoch IS NULL THEN 'Cancelled'
                         ELSE error_type END,
       finished_at = CASE WHEN status = 'queued' AND epoch IS NULL THEN now()
                          ELSE finished_at END,
       version_wait_since = NULL,
       routing = CASE WHEN routing ? 'version' THEN routing -> 'base' ELSE routing END
 WHERE (%(request_id)s::text IS NOT NULL AND request_id = %(request_id)s::text)
    OR (%(by)s::text IS NOT NULL AND scope = %(scope)s::text
        AND loomflow_worker_unfinished(status) AND request_id <> %(by)s::text
        AND seq < (SELECT seq FROM runs WHERE request_id = %(by)s::text))
RETURNING status, request_id, kind, session_id, user_id, agent, prompt, metadata,
          CASE WHEN status = 'queued' THEN not_before END AS not_before, options, routing;

-- name: mark_undispatched
-- The broker refused a request's message: it is the first the sweeper
-- publishes once the broker is back.
UPDATE runs SET dispatched_at = '-infinity'
 WHERE request_id = %(request_id)s AND status = 'queued' AND received_at IS NULL;

-- name: cancel_queued
-- Drop waiting work: every queued request (of a session, of a user, or all),
-- as cancel_requests does for one: one that never started is cancelled on the
-- spot; one that started before (queued for a retry) is flagged, and ends
-- cancelled when it is next picked up.
UPDATE runs
   SET cancel_requested = true,
       status = CASE WHEN epoch IS NULL THEN 'cancelled' ELSE status END,
       error = CASE WHEN epoch IS NULL THEN %(reason)s ELSE error END,
       error_type = CASE WHEN epoch IS NULL THEN 'Cancelled' ELSE error_type END,
       finished_at = CASE WHEN epoch IS NULL THEN now() ELSE finished_at END,
       version_wait_since = NULL,
       routing = CASE WHEN routing ? 'version' THEN routing -> 'base' ELSE routing END
 WHERE status = 'queued'
   AND (%(session_id)s::text IS NULL OR session_id = %(session_id)s::text)
   AND (%(user_id)s::text IS NULL OR user_id = %(user_id)s::text)
RETURNING status, request_id, kind, session_id, user_id, agent, prompt, metadata,
          CASE WHEN status = 'queued' THEN not_before END AS not_before, options, routing;

-- name: known_requests
-- Which of these requests the ledger has (any status).
SELECT request_id FROM runs WHERE request_id = ANY(%(request_ids)s::text[]);

-- name: mark_held
-- A worker holds these requests' messages, received but not started (a rate
-- limit, a prefetch), queued ones or the copy the sweeper published of a
-- running one whose worker died: stamped, so the sweeper does not take them
-- for lost while the worker keeps saying so.
UPDATE runs SET held_at = now()
 WHERE request_id = ANY(%(request_ids)s::text[])
   AND (status = 'queued' OR loomflow_worker_copy_out(status, swept_at, started_at))
RETURNING request_id;

-- name: insert_failed_run
-- A request whose message arrived with input a worker refuses, and which the
-- ledger did not have: recorded failed. A row under its id is never touched
-- here (see fail_invalid_run).
INSERT INTO runs (request_id, scope, session_id, user_id, agent, kind, prompt, metadata,
                  status, error, error_type, finished_at)
VALUES (%(request_id)s, %(scope)s, %(session_id)s, %(user_id)s, %(agent)s, %(kind)s,
        %(prompt)s, %(metadata)s, 'failed', %(error)s, %(error_type)s, now())
ON CONFLICT (request_id) DO NOTHING;

-- name: fail_invalid_run
-- A request the ledger accepted whose own arguments a worker refuses (an agent
-- it does not have, a lower limit): it ends failed, unless it ended already.
UPDATE runs SET status = 'failed', error = %(error)s, error_type = %(error_type)s,
       finished_at = now()
 WHERE request_id = %(request_id)s AND loomflow_worker_unfinished(status);

-- name: precheck_run
-- The request, which of the message's arguments differ from its row (the
-- message runs only what the ledger accepted; its prompt, which may be long,
-- is compared by its SHA-256), the oldest unfinished request of its scope
-- before it, and, in the same statement, the scope's lock when the request is
-- unfinished, its message is its own and nothing is before it (NULL: not
-- tried). A request that died with other runs of its process twice in a row
-- without completing a step (counting its last attempt, which its start
-- counts) must run in quarantine, among a few such suspects (isolation 1);
-- one that died there too, or lost its lock connection twice in a row, must
-- run alone (isolation 2). In a process that gives it less isolation
-- than that (`isolation`: 0 for a shared process) it takes no lock and says
-- what it needs (`quarantine`, else 0).
SELECT r.status, r.result, r.error, r.epoch AS pinned, m.differ,
       o.request_id, o.kind, o.session_id, o.user_id, o.agent, o.prompt, o.metadata,
       o.not_before, o.options, o.routing, o.stale, q.quarantine, r.fairness_key,
       CASE WHEN loomflow_worker_unfinished(r.status) AND o.request_id IS NULL
                 AND cardinality(m.differ) = 0 AND q.quarantine = 0
            THEN CASE WHEN %(may_lock)s THEN pg_try_advisory_lock(%(key)s) ELSE false END
       END AS locked
  FROM runs r
  CROSS JOIN LATERAL (
      -- Its last attempt is looked at only for a running request in a process
      -- that is not alone (a first delivery, nearly every one, skips it), or
      -- a suspect queued again (its attempt interrupted by a shutdown).
      SELECT CASE WHEN %(isolation)s < 2
                       AND (r.status = 'running' OR (r.status = 'queued' AND r.suspicion >= 2))
                  THEN coalesce((
                 SELECT CASE WHEN n.needs > %(isolation)s THEN n.needs ELSE 0 END
                   FROM loomflow_worker_last_attempt(r.request_id, r.attempts) p
                  CROSS JOIN LATERAL (
                      SELECT CASE WHEN r.lost_streak + (p.outcome = 'lost')::int >= 2
                                    OR (r.suspicion >= 2 AND p.outcome IS NULL) THEN 2
                                  WHEN r.suspicion + p.shared::int >= 2 THEN 1
                                  ELSE 0 END AS needs) n), 0)
             ELSE 0 END AS quarantine) q
 CROSS JOIN LATERAL (
      SELECT array_remove(ARRAY[
          CASE WHEN r.kind IS DISTINCT FROM %(kind)s::text THEN 'kind' END,
          CASE WHEN r.session_id IS DISTINCT FROM %(session_id)s::text THEN 'session_id' END,
          CASE WHEN r.user_id IS DISTINCT FROM %(user_id)s::text THEN 'user_id' END,
          CASE WHEN r.agent IS DISTINCT FROM %(agent)s::text THEN 'agent' END,
          CASE WHEN sha256(convert_to(r.prompt, 'UTF8')) IS DISTINCT FROM %(prompt_sha256)s::bytea
               THEN 'prompt' END,
          CASE WHEN r.metadata IS DISTINCT FROM %(metadata)s::jsonb THEN 'metadata' END
      ], NULL) AS differ) m
  LEFT JOIN LATERAL (
      SELECT request_id, kind, session_id, user_id, agent, prompt, metadata, not_before,
             CASE WHEN status = 'queued' THEN options END AS options, routing,
             greatest(dispatched_at, not_before) < now() - make_interval(secs => %(stale)s)
             AS stale
        FROM runs o
       WHERE o.scope = r.scope AND loomflow_worker_unfinished(o.status) AND o.seq < r.seq
       ORDER BY o.seq LIMIT 1) o ON true
 WHERE r.request_id = %(request_id)s;

-- name: park_request
-- A worker parks the request whose message it took: stamped, so the request
-- that hands the scope on publishes it again, with the options its message
-- carried. Already handed the scope (the older request finished since this
-- worker looked), it must not park.
-- Those options travel only with a message published again for a queued
-- request (every query that picks one says CASE WHEN status = 'queued'): the
-- message of a running request is held by its worker, or requeued by the
-- broker when the worker died, and carries them itself; a copy carrying them
-- too would call its callbacks (and count its chord part) a second time.
UPDATE runs SET received_at = now(), options = coalesce(%(options)s::jsonb, options)
 WHERE request_id = %(request_id)s
RETURNING handed_at IS NOT NULL;

-- name: park_on_limit
-- A worker parks the request whose message it took because a concurrency
-- limit of it is full: as park_request, saying which limit (waiting_for) and
-- the slots it waits for (waiting_slots), so that the run that frees one, or
-- the sweeper once one is free, publishes it again. A request still marked
-- running (its last attempt's worker died) parks too, its options kept for a
-- queued one only (see park_request).
UPDATE runs SET received_at = now(), waiting_for = %(reason)s,
       waiting_slots = %(slots)s::bigint[],
       options = CASE WHEN status = 'queued' THEN coalesce(%(options)s::jsonb, options)
                      ELSE options END
 WHERE request_id = %(request_id)s AND loomflow_worker_unfinished(status);

-- name: next_on_limit
-- A run freed a slot of a concurrency limit: the oldest requests parked on it
-- (as many as slots were freed; by priority, then age), stamped dispatched, and
-- parked no more (waiting_slots cleared; waiting_for still names the limit):
-- their messages go out again, and until they start they count as out, like a
-- request published at its enqueue (insert_run), and as on their way to the
-- limit's slots (the sweeper's orphans), so nothing else publishes another
-- request for the slots they will take.
WITH next AS (
    -- "Not finished" (as insert_run asks): the limit's parked requests in the
    -- order of runs_waiting_for, not a bitmap of all of them sorted.
    SELECT request_id FROM runs
     WHERE waiting_slots IS NOT NULL AND waiting_for = %(reason)s
       AND NOT loomflow_worker_finished(status) AND received_at >= dispatched_at
     ORDER BY priority_rank, enqueued_at LIMIT %(count)s
       FOR UPDATE SKIP LOCKED
)
UPDATE runs r SET dispatched_at = now(), waiting_slots = NULL
  FROM next WHERE r.request_id = next.request_id
RETURNING r.request_id, r.kind, r.session_id, r.user_id, r.agent, r.prompt, r.metadata,
          r.not_before, CASE WHEN r.status = 'queued' THEN r.options END AS options,
          r.routing;

-- name: mark_dispatched
-- The request ahead of a parking one looked stale (its message unseen for `stale` seconds)
-- and the parker publishes it again: stamped dispatched now, so neither the next parker nor
-- the sweeper publishes it again before its grace.
UPDATE runs SET dispatched_at = now() WHERE request_id = %(request_id)s;

-- name: mark_swept
-- The sweeper publishes these requests again (one statement for its batch),
-- or one is handed to a process of its own: dispatched now. Those it marks
-- come back, and only those are published. A request parked for a signal is
-- published by the signal's sender and by the sweeper, whichever marks it
-- first: it is marked only when nobody published it since it parked, or
-- (again_after: the sweeper's, for a message lost since) that many seconds ago.
UPDATE runs SET swept_at = now(), dispatched_at = greatest(dispatched_at, now())
 WHERE request_id = ANY(%(request_ids)s::text[])
   AND (waiting_signal IS NULL OR swept_at IS NULL OR swept_at < received_at
        OR swept_at < now() - make_interval(secs => %(again_after)s::float8))
RETURNING request_id;

-- name: start_request
-- Under the scope lock, in one statement: read the request, and when it is not
-- finished and nothing makes it wait (an older unfinished request on its scope,
-- a previous attempt that may still be running, a pin to another version of its
-- agent), count the attempt, pin the epoch on the first one and mark it running.
-- Each part below says its rule.
WITH r AS (
    -- The request, locked for the statement.
    SELECT request_id, seq, scope, session_id, status, epoch, kind, attempts,
           cancel_requested, result, error, error_type, heartbeat_at, enqueued_at, booked_key,
           booked_at, agent_version
      FROM runs WHERE request_id = %(request_id)s FOR UPDATE
), other AS (
    -- The version of its agent, other than the worker's, it is pinned to: it does not
    -- start (unless asked to cancel: it starts only to end so), and `other_version`
    -- names it (see await_version). The first attempt pins the request to the
    -- worker's version (`version`; NULL: a caller with none, which pins nothing).
    SELECT r.agent_version FROM r
     WHERE loomflow_worker_unfinished(r.status) AND NOT r.cancel_requested
       AND %(version)s::text IS NOT NULL
       AND r.agent_version IS DISTINCT FROM %(version)s AND r.agent_version IS NOT NULL
), prev AS (
    -- The previous attempt, if the request was running: how it ended, and
    -- whether other runs of its process died with it.
    SELECT p.outcome, p.shared
      FROM r, loomflow_worker_last_attempt(r.request_id, r.attempts) p
     WHERE r.status = 'running'
), previous_open AS (
    -- The worker of a previous attempt that may still be running
    -- (loomflow_worker_open_attempt: its worker lives and has not yet stopped its step,
    -- and the request's heartbeat is within the lease): the request waits for it,
    -- named by `previous_worker`.
    SELECT p.worker
      FROM r, loomflow_worker_open_attempt(r.request_id, r.attempts, r.heartbeat_at,
                                           %(lease)s::float8, %(interval)s::float8) p
     WHERE r.status = 'running'
), older AS (
    -- The oldest older unfinished request on the scope: this one waits for it, and
    -- the caller makes sure it is dispatched (`stale`: its message looks lost).
    SELECT o.request_id, o.kind, o.session_id, o.user_id, o.agent, o.prompt, o.metadata,
           o.not_before, CASE WHEN o.status = 'queued' THEN o.options END AS options, o.routing,
           greatest(o.dispatched_at, o.not_before) < now() - make_interval(secs => %(stale)s)
           AS stale
      FROM runs o JOIN r ON o.scope = r.scope
     WHERE loomflow_worker_unfinished(o.status) AND o.seq < r.seq
     ORDER BY o.seq LIMIT 1
), marks AS (
    -- The scope's epochs as the journal has them, to pin the first attempt's.
    SELECT current, last FROM loomflow_worker_scope_epochs(%(scope)s::text)
), started AS (
    -- The attempt starts. A previous one that ended "interrupted" (its worker shut
    -- down for a deploy) or "lost" (its worker lost its database connection and
    -- lived) counts no crash, nor one that died with other runs of its process
    -- (shared; in a process of quarantine among a few suspects, with any other attempt
    -- that process ran): that raises the request's suspicion instead. A lost one
    -- lengthens its streak of lost attempts. It records its agent's version, clears
    -- the request's wait for one, and takes back the routing the request had before
    -- it was sent to its version's queue.
    UPDATE runs u
       SET status = 'running',
           epoch = coalesce(u.epoch, CASE WHEN r.kind = 'resume' AND m.last IS NOT NULL
                                          THEN m.last ELSE coalesce(m.current, 0) END),
           attempts = u.attempts + 1,
           crashes = u.crashes + (r.status = 'running'
               AND coalesce(p.outcome IS NULL AND NOT p.shared, true))::int,
           suspicion = u.suspicion + coalesce(p.shared, false)::int,
           lost_streak = u.lost_streak + coalesce(p.outcome = 'lost', false)::int,
           holder = %(worker)s,
           holder_pid = pg_backend_pid(),
           started_at = now(),
           heartbeat_at = now(),
           waiting_for = NULL, waiting_slots = NULL, booked_key = NULL, booked_at = NULL,
           waiting_signal = NULL, waiting_signal_session = NULL, waiting_budget = NULL,
           agent_version = coalesce(u.agent_version, %(version)s), version_wait_since = NULL,
           routing = CASE WHEN u.routing ? 'version' THEN u.routing -> 'base' ELSE u.routing END
      FROM r CROSS JOIN marks m LEFT JOIN prev p ON true
     WHERE u.request_id = r.request_id AND loomflow_worker_unfinished(r.status)
       AND NOT EXISTS (SELECT 1 FROM older) AND NOT EXISTS (SELECT 1 FROM previous_open)
       AND NOT EXISTS (SELECT 1 FROM other)
    RETURNING u.epoch, u.attempts, u.crashes, u.failures, u.suspicion, u.lost_streak
), buried AS (
    -- The previous attempt, if it never ended (its process died, or was
    -- stopped past the lease): ended now that the next one starts, "died".
    UPDATE run_attempts a SET ended_at = clock_timestamp(), outcome = 'died'
      FROM r, started s
     WHERE a.request_id = r.request_id AND a.attempt = r.attempts AND a.ended_at IS NULL
), attempt_row AS (
    -- The attempt's row, recording how apart it runs (`isolation`).
    INSERT INTO run_attempts (request_id, attempt, worker, pid, epoch, boot, isolation,
                              agent_version)
    SELECT %(request_id)s, attempts, %(worker)s, %(pid)s, epoch, %(boot)s, %(isolation)s,
           %(version)s
      FROM started
    ON CONFLICT (request_id, attempt) DO NOTHING
)
-- What the caller decides on: the request, the attempt started (none: it waits),
-- what it waits for, and `upgraded`: it was moved to another version on purpose.
SELECT r.status, r.seq, r.result, r.error, r.error_type, r.cancel_requested,
       s.epoch, s.attempts, s.crashes, s.failures, s.suspicion, s.lost_streak,
       CASE WHEN r.status = 'running'
            THEN extract(epoch FROM now() - r.heartbeat_at)::float8 END AS since_heartbeat,
       -- The request before it on its scope, when it finished after this one was
       -- enqueued (it handed the scope over): found through runs_session (a scope is
       -- one session's), not by walking the ledger back from this request's seq.
       (SELECT CASE WHEN p.finished_at > r.enqueued_at
                    THEN extract(epoch FROM now() - p.finished_at)::float8 END
          FROM runs p
         WHERE p.session_id = r.session_id AND p.scope = r.scope AND p.seq < r.seq
         ORDER BY p.seq DESC LIMIT 1) AS since_handoff,
       o.request_id, o.kind, o.session_id, o.user_id, o.agent, o.prompt, o.metadata,
       o.not_before, o.options, o.routing, o.stale,
       (SELECT worker FROM previous_open) AS previous_worker,
       (SELECT agent_version FROM other) AS other_version,
       EXISTS (SELECT 1 FROM run_upgrades g WHERE g.request_id = r.request_id) AS upgraded,
       CASE WHEN s.attempts IS NOT NULL THEN r.booked_key END AS booked_key,
       CASE WHEN s.attempts IS NOT NULL
            THEN extract(epoch FROM r.booked_at - now())::float8 END AS booked_in
  FROM r
  LEFT JOIN started s ON true
  LEFT JOIN older o ON true;

-- name: await_version
-- Under the scope lock: the request is pinned to a version of its agent this
-- worker does not run (start_request said `other_version`). It goes back to
-- queued, waiting for that version since now (or since it first waited), its
-- messages routed to the version's queue (loomflow_worker_version_routing);
-- its previous attempt, if it
-- never ended, ends "died", and is charged as start_request charges it. What
-- the message the worker took carried (`options`) is kept as park_request
-- keeps it, and its columns come back for the worker to publish it there;
-- `first` is false when it waited already: its message is in its version's
-- queue (a copy arrived elsewhere), and nothing is published or changed for
-- it (the sweeper publishes it again should that message be lost).
WITH r AS (
    SELECT request_id, status, attempts, version_wait_since IS NULL AS first FROM runs
     WHERE request_id = %(request_id)s FOR UPDATE
), prev AS (
    SELECT p.outcome, p.shared
      FROM r, loomflow_worker_last_attempt(r.request_id, r.attempts) p
     WHERE r.status = 'running'
), buried AS (
    UPDATE run_attempts a SET ended_at = clock_timestamp(), outcome = 'died'
      FROM r
     WHERE a.request_id = r.request_id AND a.attempt = r.attempts AND a.ended_at IS NULL
       AND r.status = 'running'
)
UPDATE runs u
   SET status = 'queued',
       crashes = u.crashes + (r.status = 'running'
           AND coalesce(p.outcome IS NULL AND NOT p.shared, true))::int,
       suspicion = u.suspicion + coalesce(p.shared, false)::int,
       lost_streak = u.lost_streak + coalesce(p.outcome = 'lost', false)::int,
       version_wait_since = coalesce(u.version_wait_since, now()), holder_pid = NULL,
       dispatched_at = CASE WHEN r.first THEN clock_timestamp() ELSE u.dispatched_at END,
       received_at = CASE WHEN r.first THEN now() ELSE u.received_at END,
       options = CASE WHEN r.first THEN coalesce(%(options)s::jsonb, u.options)
                      ELSE u.options END,
       routing = CASE WHEN r.first
                      THEN loomflow_worker_version_routing(u.routing, %(default_queue)s,
                                                           %(suffix)s, u.agent_version)
                      ELSE u.routing END
  FROM r LEFT JOIN prev p ON true
 WHERE u.request_id = r.request_id AND loomflow_worker_unfinished(r.status)
RETURNING u.request_id, u.kind, u.session_id, u.user_id, u.agent, u.prompt, u.metadata,
          u.not_before, u.options, u.routing, u.agent_version, r.first;

-- name: upgrade_requests
-- Move queued requests pinned to another version of their agent to version
-- `to` (`request_id`, or every one of `agent` pinned to `from`): pinned to it,
-- waiting for no version, routed to its queue (`suffix`, see
-- loomflow_worker_version_routing), each move recorded in run_upgrades with
-- `by`. A running request is not moved (its attempt runs on, or dies and then
-- waits). The moved requests come back, to publish.
WITH target AS (
    SELECT request_id, agent_version AS from_version
      FROM runs
     WHERE CASE WHEN %(request_id)s::text IS NOT NULL THEN request_id = %(request_id)s
                ELSE agent = %(agent)s AND agent_version = %(from)s END
       AND status = 'queued' AND agent_version IS NOT NULL AND agent_version <> %(to)s
       FOR UPDATE
), logged AS (
    INSERT INTO run_upgrades (request_id, from_version, to_version, by)
    SELECT request_id, from_version, %(to)s, %(by)s FROM target
)
UPDATE runs u
   SET agent_version = %(to)s, version_wait_since = NULL, dispatched_at = clock_timestamp(),
       routing = loomflow_worker_version_routing(u.routing, %(default_queue)s, %(suffix)s,
                                                 %(to)s)
  FROM target t
 WHERE u.request_id = t.request_id
RETURNING u.request_id, u.kind, u.session_id, u.user_id, u.agent, u.prompt, u.metadata,
          u.not_before, u.options, u.routing, t.from_version;

-- name: known_versions
-- Each version of `agent` the fleet's registry knows, newest build first, and
-- whether a live worker serves it (what `upgrade` checks its target against).
SELECT a.version, bool_or(w.stopped_at IS NULL
                          AND w.seen_at > now() - make_interval(secs => 2 * w.heartbeat_interval))
       AS live, max(a.built_at) AS built_at
  FROM worker_agents a LEFT JOIN workers w USING (worker)
 WHERE a.agent = %(agent)s
 GROUP BY a.version
 ORDER BY max(a.built_at) DESC;

-- name: waiting_for_version
-- Requests of `agent` waiting for a worker of `version`, oldest first, at
-- most `limit` (the on_version_gone policy cancels them).
SELECT request_id FROM runs
 WHERE agent = %(agent)s AND agent_version = %(version)s AND status = 'queued'
   AND version_wait_since IS NOT NULL
 ORDER BY version_wait_since LIMIT %(limit)s;

-- name: fleet_agent
-- An agent as the fleet's workers last recorded it, for a process that
-- enqueues without its code (a sort of
-- its few rows; the worker_agents_version index).
SELECT fairness_key, limits, time_limit, model_key FROM worker_agents
 WHERE agent = %(agent)s ORDER BY built_at DESC LIMIT 1;

-- name: fleet_agent_names
-- Every agent the fleet's workers recorded, to name them when an enqueue
-- names another (worker_agents_version index).
SELECT DISTINCT agent FROM worker_agents ORDER BY agent;

-- name: heartbeat
-- Every running request of one lock connection, stamped in one statement;
-- those asked to stop come back.
UPDATE runs SET heartbeat_at = now()
 WHERE request_id = ANY(%(request_ids)s::text[]) AND status = 'running'
RETURNING request_id, cancel_requested;

-- name: clear_suspicion
-- An attempt of a suspected request completed a step: its record is clean again.
UPDATE runs SET suspicion = 0, lost_streak = 0 WHERE request_id = %(request_id)s;

-- name: worker_seen
-- A worker process's own row, stamped once per heartbeat interval: how many
-- runs it carries now, of how many slots, and how loaded it is (a restarted
-- pid starts a new row, and so does a new process under the same worker id:
-- another `boot`); the results it stored since its last stamp need no check by
-- the sweeper.
WITH stored AS (
    DELETE FROM results_to_check WHERE request_id = ANY(%(stored)s::text[])
)
INSERT INTO workers AS w (worker, hostname, pid, slots, heartbeat_interval, runs, loop_lag,
                          lock_queue, admitting, boot)
VALUES (%(worker)s, %(hostname)s, %(pid)s, %(slots)s, %(interval)s, %(runs)s, %(loop_lag)s,
        %(lock_queue)s, %(admitting)s, %(boot)s)
ON CONFLICT (worker) DO UPDATE
   SET runs = EXCLUDED.runs, slots = EXCLUDED.slots,
       heartbeat_interval = EXCLUDED.heartbeat_interval, seen_at = now(),
       loop_lag = EXCLUDED.loop_lag, lock_queue = EXCLUDED.lock_queue,
       admitting = EXCLUDED.admitting,
       started_at = CASE WHEN w.stopped_at IS NULL AND w.boot IS NOT DISTINCT FROM EXCLUDED.boot
                         THEN w.started_at ELSE now() END,
       stopped_at = NULL, boot = EXCLUDED.boot;

-- name: agent_built
-- A worker process built an agent: its row in worker_agents says which
-- version it serves and what enqueuing needs of the agent.
INSERT INTO worker_agents AS a (worker, agent, version, declared, fairness_key, limits,
                                time_limit, model_key)
VALUES (%(worker)s, %(agent)s, %(version)s, %(declared)s, %(fairness_key)s,
        %(limits)s::text[], %(time_limit)s, %(model_key)s)
ON CONFLICT (worker, agent) DO UPDATE
   SET version = EXCLUDED.version, declared = EXCLUDED.declared,
       fairness_key = EXCLUDED.fairness_key, limits = EXCLUDED.limits,
       time_limit = EXCLUDED.time_limit, model_key = EXCLUDED.model_key, built_at = now();

-- name: worker_stopped
-- A worker process that closes cleanly (and the results it stored since its
-- last stamp, as worker_seen).
WITH stored AS (
    DELETE FROM results_to_check WHERE request_id = ANY(%(stored)s::text[])
)
UPDATE workers SET stopped_at = now(), seen_at = now(), runs = 0 WHERE worker = %(worker)s;

-- name: retry_run
-- A failed attempt to be retried: the request queued again with its failures counted and its
-- error kept, dispatched_at and not_before at the end of the backoff (the console counts it
-- backing off, the sweeper leaves it until then). Only while running: ended meanwhile, it
-- stays ended.
UPDATE runs
   SET status = 'queued', failures = failures + 1, error = %(error)s, error_type = %(error_type)s,
       dispatched_at = now() + make_interval(secs => %(countdown)s),
       not_before = now() + make_interval(secs => %(countdown)s), holder_pid = NULL
 WHERE request_id = %(request_id)s AND status = 'running';

-- name: pause_request
-- A run whose model call would wait long for its key (its budget, or its
-- provider's pause) gives its slot back: the attempt ends "paused" (no crash,
-- no failure) and the request is queued again until `countdown` seconds from
-- now (its message published with that eta), saying why in waiting_for and
-- keeping the place its call booked (booked_key, booked_at) for its next
-- attempt. Only while running: ended meanwhile, it stays ended.
WITH ended AS (
    UPDATE run_attempts SET ended_at = clock_timestamp(), outcome = 'paused'
     WHERE request_id = %(request_id)s AND attempt = %(attempt)s
)
UPDATE runs
   SET status = 'queued', holder_pid = NULL, waiting_for = %(reason)s,
       dispatched_at = now() + make_interval(secs => %(countdown)s),
       not_before = now() + make_interval(secs => %(countdown)s),
       booked_key = %(booked_key)s,
       booked_at = now() + make_interval(secs => %(booked_in)s)
 WHERE request_id = %(request_id)s AND status = 'running';

-- name: park_on_signal
-- A run that waited PARK_AFTER for a signal gives its slot back: the attempt
-- ends "paused", and the request is queued again, parked (its message acked,
-- what it carried kept as park_request keeps it) until the sweeper sees a
-- signal of that name in its session's mailbox and publishes it, or the
-- signal's sender does (signal_waiters). Only while running: ended meanwhile,
-- it stays ended.
WITH ended AS (
    UPDATE run_attempts SET ended_at = clock_timestamp(), outcome = 'paused'
     WHERE request_id = %(request_id)s AND attempt = %(attempt)s
)
UPDATE runs
   SET status = 'queued', holder_pid = NULL, received_at = now(), waiting_for = %(reason)s,
       waiting_signal = %(signal)s, waiting_signal_session = %(session_id)s,
       options = coalesce(%(options)s::jsonb, options)
 WHERE request_id = %(request_id)s AND status = 'running';

-- name: signal_waiters
-- The requests parked waiting for the signal `name` of a session (see
-- park_on_signal) that a signal now in its mailbox may wake (one sent to their
-- user or to none), through runs_signal_waiting: the signal's sender
-- publishes them, once mark_swept marks them.
SELECT r.request_id, r.kind, r.session_id, r.user_id, r.agent, r.prompt, r.metadata,
       r.not_before, r.options, r.routing
  FROM runs r
 WHERE r.waiting_signal_session = %(session_id)s AND r.waiting_signal = %(name)s
   AND r.status = 'queued'
   AND EXISTS (SELECT 1 FROM signals s
                WHERE s.session_id = r.waiting_signal_session AND s.name = r.waiting_signal
                  AND (s.user_id IS NULL OR s.user_id = r.user_id));

-- name: end_attempt
-- One attempt closed with its outcome while its request goes on: "retry" (with retry_run),
-- "handed_back" (cleared to run shared again), "interrupted" (a shutdown). An attempt that
-- ends its request is closed by finish_request.
UPDATE run_attempts SET ended_at = clock_timestamp(), outcome = %(outcome)s
 WHERE request_id = %(request_id)s AND attempt = %(attempt)s;

-- name: finish_request
-- The request's end in one statement: the scope's epoch advanced past the
-- pinned one (forward only), the status, result and error recorded, the
-- attempt closed, and the next unfinished request of the scope chosen. Only
-- while the attempt is open (its fencing token, as the journal's writes): an
-- attempt ended meanwhile (fenced, resumed elsewhere) is refused with LW001
-- and nothing of the statement lands.
WITH held AS (
    SELECT loomflow_worker_holds(%(request_id)s, %(attempt)s) AS ok
), advanced AS (
    INSERT INTO journal_steps (session_id, step_name, value, created_at)
    SELECT %(scope)s, '__run_epoch__', %(epoch_value)s, extract(epoch FROM clock_timestamp())
      FROM held WHERE held.ok
    ON CONFLICT (session_id, step_name) DO UPDATE
       SET value = EXCLUDED.value, created_at = EXCLUDED.created_at
     WHERE coalesce(loomflow_worker_epoch(journal_steps.value), -1) < %(new_epoch)s
), finished AS (
    UPDATE runs
       SET status = %(status)s, result = %(result)s, error = %(error)s,
           error_type = %(error_type)s, finished_at = now(), holder_pid = NULL
     WHERE request_id = %(request_id)s AND loomflow_worker_unfinished(status)
), closed AS (
    UPDATE run_attempts SET ended_at = clock_timestamp(), outcome = %(status)s
     WHERE request_id = %(request_id)s AND attempt = %(attempt)s
), chosen AS (
    SELECT request_id, kind, session_id, user_id, agent, prompt, metadata, not_before,
           CASE WHEN status = 'queued' THEN options END AS options, routing
      FROM runs
     WHERE scope = %(scope)s AND loomflow_worker_unfinished(status) AND request_id <> %(request_id)s
     ORDER BY seq LIMIT 1
), handed AS (
    -- Handed the scope; published again after this commit when a worker
    -- already took its message and parked it (see park_request). One waiting
    -- its fair turn has no message yet: loomflow_worker_fair_next publishes
    -- it in its turn, once.
    UPDATE runs SET dispatched_at = now(), handed_at = now()
     WHERE request_id = (SELECT request_id FROM chosen)
    RETURNING request_id,
              received_at IS NOT NULL AND waiting_for IS DISTINCT FROM 'limit fair_queue'
              AS received
)
SELECT c.*, h.received FROM chosen c JOIN handed h USING (request_id);

-- name: hand_off
-- Hand the scope to its oldest unfinished request (as finish_request does,
-- one waiting its fair turn left to its turn) unless it was handed already.
UPDATE runs SET dispatched_at = now(), handed_at = now()
 WHERE request_id = (SELECT request_id FROM runs
                      WHERE scope = %(scope)s AND loomflow_worker_unfinished(status)
                      ORDER BY seq LIMIT 1)
   AND handed_at IS NULL
RETURNING request_id, kind, session_id, user_id, agent, prompt, metadata, not_before,
          CASE WHEN status = 'queued' THEN options END AS options, routing,
          received_at IS NOT NULL AND waiting_for IS DISTINCT FROM 'limit fair_queue'
          AS received;

-- name: mark_result_unstored
-- Its worker could not store the finished request's result in the result
-- backend: the sweeper stores it from here (unless its caller wants no
-- result: ignore_result).
UPDATE runs SET result_stored = false
 WHERE request_id = %(request_id)s AND NOT loomflow_worker_unfinished(status)
   AND NOT ignore_result;

-- name: mark_attempt_lost
-- A worker whose attempt lost its lock connection (a Postgres restart, a
-- network blip) and lived: the attempt ended "lost", not crashed. With no
-- attempt number (lost while it started), this worker's open attempt.
UPDATE run_attempts SET ended_at = clock_timestamp(), outcome = 'lost'
 WHERE request_id = %(request_id)s AND ended_at IS NULL
   AND (attempt = %(attempt)s OR (%(attempt)s::int IS NULL AND worker = %(worker)s));

-- name: revoked_request
-- A request Celery revoked, let expire or killed: its scope, status, pinned epoch and lock
-- key, which decide how end_revoked ends it (at once when it never started, else under its
-- scope's lock).
SELECT scope, status, epoch, lock_key FROM runs WHERE request_id = %(request_id)s;

-- name: flag_cancel
-- A revoked request whose scope's lock an attempt still holds: flagged, so that attempt
-- stops at its next step (its heartbeat sees the flag); the revoke is tried again once the
-- attempt is gone.
UPDATE runs SET cancel_requested = true
 WHERE request_id = %(request_id)s AND loomflow_worker_unfinished(status);

-- name: end_revoked
-- A request Celery revoked, let expire, or killed at its hard time limit,
-- ended in the ledger: the scope's
-- epoch advanced past the one it pinned (when it started), its status and
-- error recorded, its open attempt closed. Run holding its scope's lock, or
-- for a request that never started (it journaled nothing).
WITH r AS (
    SELECT request_id, scope, epoch FROM runs
     WHERE request_id = %(request_id)s AND loomflow_worker_unfinished(status) FOR UPDATE
), advanced AS (
    INSERT INTO journal_steps (session_id, step_name, value, created_at)
    SELECT r.scope, '__run_epoch__', convert_to('LJ1' || (r.epoch + 1)::text, 'UTF8'),
           extract(epoch FROM clock_timestamp())
      FROM r WHERE r.epoch IS NOT NULL
    ON CONFLICT (session_id, step_name) DO UPDATE
       SET value = EXCLUDED.value, created_at = EXCLUDED.created_at
     WHERE coalesce(loomflow_worker_epoch(journal_steps.value), -1)
           < loomflow_worker_epoch(EXCLUDED.value)
), ended AS (
    UPDATE runs u
       SET status = %(status)s, error = %(error)s, error_type = %(error_type)s,
           finished_at = now(), holder_pid = NULL, cancel_requested = true
      FROM r WHERE u.request_id = r.request_id
    RETURNING u.request_id
), closed AS (
    UPDATE run_attempts SET ended_at = clock_timestamp(), outcome = %(status)s
     WHERE request_id = %(request_id)s AND ended_at IS NULL
)
SELECT count(*) FROM ended;

-- name: wait_lock_within
-- How long wait_lock may wait, for the rest of the transaction it runs in
-- (in milliseconds, as Postgres' lock_timeout takes it).
SELECT set_config('lock_timeout', %(timeout_ms)s, true);

-- name: wait_lock
-- A scope's session advisory lock, waited for (up to the transaction's
-- lock_timeout, see wait_lock_within): end_revoked takes the lock of a
-- request whose process Celery is killing this moment (its hard time
-- limit), the instant the process is gone, before the sweeper could take
-- the request for an orphan.
SELECT pg_advisory_lock(%(key)s);

-- name: unlock
-- A scope's session advisory lock released after end_revoked, taken with try_lock on the
-- same connection (the worker's main process).
SELECT pg_advisory_unlock(%(key)s);

-- name: mark_interrupted
-- A worker shutting down (a deploy): its attempts still running end
-- "interrupted", so their next attempt does not count a crash.
UPDATE run_attempts SET outcome = 'interrupted'
 WHERE starts_with(worker, %(node)s) AND ended_at IS NULL AND outcome IS NULL;

-- name: requeue_interrupted
-- A worker stopped the request's attempt (a shutdown) and puts its message
-- back in the broker: the attempt ends "interrupted" (no crash) and the
-- request is queued again, its message in the broker from now on, so the
-- sweeper counts it there, or held by the worker that takes it, and does not
-- publish another (unless another attempt started since).
WITH ended AS (
    UPDATE run_attempts SET ended_at = clock_timestamp(), outcome = 'interrupted'
     WHERE request_id = %(request_id)s AND attempt = %(attempt)s
)
UPDATE runs SET status = 'queued', dispatched_at = now(), holder_pid = NULL
 WHERE request_id = %(request_id)s AND status = 'running' AND attempts = %(attempt)s;

-- name: record_usage
-- An attempt's model-call usage, written with its end (ahead of its finish, in the same
-- round trip, or before its retry or pause): the attempt's own, and the request's totals.
-- Executed tokens add up; each total also takes at least what the attempt replayed plus
-- executed, which holds every call journaled so far: the calls of an attempt killed
-- before it recorded its own count once, through the replay.
-- What the totals grow by is spent from the request's budgets (its fairness
-- key's and its agent's, in cost_budgets) for the current period: in tokens
-- (input, output and cache) or dollars, by each budget's unit. A budget whose
-- period has rolled over starts again from this spend.
WITH attempt AS (
    UPDATE run_attempts SET usage = %(usage)s::jsonb
     WHERE request_id = %(request_id)s AND attempt = %(attempt)s
), grown AS (
    SELECT fairness_key, agent,
           GREATEST(%(input)s::bigint, %(r_input)s::bigint + %(input)s::bigint - input_tokens)
           + GREATEST(%(output)s::bigint, %(r_output)s::bigint + %(output)s::bigint - output_tokens)
           + GREATEST(%(cache_read)s::bigint,
                      %(r_cache_read)s::bigint + %(cache_read)s::bigint - cache_read_tokens)
           + GREATEST(%(cache_write)s::bigint,
                      %(r_cache_write)s::bigint + %(cache_write)s::bigint - cache_write_tokens)
           AS tokens,
           GREATEST(%(cost)s::numeric, %(r_cost)s::numeric + %(cost)s::numeric - cost) AS cost
      FROM runs WHERE request_id = %(request_id)s
), spend AS (
    UPDATE cost_budgets b
       SET spent = loomflow_worker_budget_spent(b, now())
                   + CASE b.unit WHEN 'tokens' THEN g.tokens ELSE g.cost END,
           period_start = loomflow_worker_period_start(b.period, now())
      FROM grown g
     WHERE b.name IN (g.fairness_key, 'agent:' || g.agent) AND (g.tokens > 0 OR g.cost > 0)
)
UPDATE runs SET
    model_calls = GREATEST(model_calls + %(calls)s::int, %(r_calls)s::int + %(calls)s::int),
    input_tokens = GREATEST(input_tokens + %(input)s::bigint, %(r_input)s::bigint + %(input)s::bigint),
    output_tokens = GREATEST(output_tokens + %(output)s::bigint, %(r_output)s::bigint + %(output)s::bigint),
    cache_read_tokens = GREATEST(cache_read_tokens + %(cache_read)s::bigint,
                                 %(r_cache_read)s::bigint + %(cache_read)s::bigint),
    cache_write_tokens = GREATEST(cache_write_tokens + %(cache_write)s::bigint,
                                  %(r_cache_write)s::bigint + %(cache_write)s::bigint),
    cost = GREATEST(cost + %(cost)s::numeric, %(r_cost)s::numeric + %(cost)s::numeric),
    price_unknown = price_unknown OR %(price_unknown)s::boolean,
    replayed_calls = replayed_calls + %(r_calls)s::int,
    replayed_tokens = replayed_tokens + %(r_tokens)s::bigint,
    replayed_cost = replayed_cost + %(r_cost)s::numeric
 WHERE request_id = %(request_id)s;
