-- Every query the runtime runs, under "-- name: <name>" headers.
-- Parameters are psycopg placeholders; nothing is assembled from input.
-- Journal entries are stamped with the database's clock, the one that also
-- stamps attempts: which attempt wrote a step never depends on a worker's clock.

-- name: schema_versions
SELECT version FROM loomflow_worker_schema ORDER BY version;

-- name: create_schema_table
CREATE TABLE IF NOT EXISTS loomflow_worker_schema (
    version    INTEGER PRIMARY KEY,
    name       TEXT NOT NULL,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- name: record_version
INSERT INTO loomflow_worker_schema (version, name) VALUES (%(version)s, %(name)s);

-- name: migration_lock
SELECT pg_advisory_xact_lock(%(key)s);

-- name: try_lock
SELECT pg_try_advisory_lock(%(key)s);

-- name: unlock
SELECT pg_advisory_unlock(%(key)s);

-- name: read_epochs
SELECT step_name, value FROM journal_steps
 WHERE session_id = %(scope)s
   AND step_name IN ('__run_epoch__', '__last_run_epoch__');

-- name: open_run
WITH marks AS (
    SELECT max(loomflow_worker_epoch(value)) FILTER (WHERE step_name = '__run_epoch__') AS current,
           max(loomflow_worker_epoch(value)) FILTER (WHERE step_name = '__last_run_epoch__') AS last
      FROM journal_steps
     WHERE session_id = %(scope)s AND step_name IN ('__run_epoch__', '__last_run_epoch__')
), chosen AS (
    SELECT coalesce(current, 0) AS current, last,
           coalesce(%(pinned)s::integer,
                    CASE WHEN %(resume)s AND last IS NOT NULL THEN last END,
                    coalesce(current, 0)) AS epoch
      FROM marks
)
SELECT c.current, c.last, c.epoch, n.stream, n.step_name, n.value
  FROM chosen c
  LEFT JOIN LATERAL (
      SELECT false AS stream, j.step_name, j.value FROM journal_steps j
       WHERE c.epoch > 0 AND j.session_id = %(scope)s
         AND j.step_name COLLATE "C" >= c.epoch::text || '/'
         AND j.step_name COLLATE "C" < c.epoch::text || '0'
      UNION ALL
      SELECT false, j.step_name, j.value FROM journal_steps j
       WHERE c.epoch = 0 AND j.session_id = %(scope)s
         AND j.step_name !~ '^([0-9]+|[0-9a-f]{16})/'
      UNION ALL
      SELECT true, j.step_name, j.chunks FROM journal_streams j
       WHERE c.epoch > 0 AND j.session_id = %(scope)s
         AND j.step_name COLLATE "C" >= c.epoch::text || '/'
         AND j.step_name COLLATE "C" < c.epoch::text || '0'
      UNION ALL
      SELECT true, j.step_name, j.chunks FROM journal_streams j
       WHERE c.epoch = 0 AND j.session_id = %(scope)s
         AND j.step_name !~ '^([0-9]+|[0-9a-f]{16})/'
  ) n ON true;

-- name: advance_epoch
WITH stored AS (
    SELECT loomflow_worker_epoch(value) AS epoch FROM journal_steps
     WHERE session_id = %(scope)s AND step_name = '__run_epoch__'
), written AS (
    -- Only a smaller stored epoch is written over: an upsert that finds the
    -- epoch there already would lock its row, and make a run that replayed
    -- everything pay for a commit it has nothing to write in.
    INSERT INTO journal_steps (session_id, step_name, value, created_at)
    SELECT %(scope)s, '__run_epoch__', %(value)s, extract(epoch FROM clock_timestamp())
     WHERE coalesce((SELECT epoch FROM stored), -1) < %(new)s
    ON CONFLICT (session_id, step_name) DO UPDATE
       SET value = EXCLUDED.value, created_at = EXCLUDED.created_at
     WHERE coalesce(loomflow_worker_epoch(journal_steps.value), -1) < %(new)s
    RETURNING %(new)s::integer AS epoch
)
SELECT coalesce((SELECT epoch FROM written), (SELECT epoch FROM stored), 0);

-- name: load_namespace
SELECT false AS stream, step_name, value FROM journal_steps
 WHERE session_id = %(scope)s
   AND step_name COLLATE "C" >= %(lo)s AND step_name COLLATE "C" < %(hi)s
UNION ALL
SELECT true, step_name, chunks FROM journal_streams
 WHERE session_id = %(scope)s
   AND step_name COLLATE "C" >= %(lo)s AND step_name COLLATE "C" < %(hi)s;

-- name: load_root_namespace
SELECT false AS stream, step_name, value FROM journal_steps
 WHERE session_id = %(scope)s AND step_name !~ '^([0-9]+|[0-9a-f]{16})/'
UNION ALL
SELECT true, step_name, chunks FROM journal_streams
 WHERE session_id = %(scope)s AND step_name !~ '^([0-9]+|[0-9a-f]{16})/';

-- name: get_step
SELECT value, created_at FROM journal_steps
 WHERE session_id = %(scope)s AND step_name = %(key)s;

-- name: put_step
INSERT INTO journal_steps (session_id, step_name, value, created_at)
VALUES (%(scope)s, %(key)s, %(value)s, extract(epoch FROM clock_timestamp()))
ON CONFLICT (session_id, step_name) DO UPDATE
   SET value = EXCLUDED.value, created_at = EXCLUDED.created_at;

-- name: get_stream
SELECT chunks FROM journal_streams
 WHERE session_id = %(scope)s AND step_name = %(key)s;

-- name: put_stream
INSERT INTO journal_streams (session_id, step_name, chunks, created_at)
VALUES (%(scope)s, %(key)s, %(value)s, extract(epoch FROM clock_timestamp()))
ON CONFLICT (session_id, step_name) DO UPDATE
   SET chunks = EXCLUDED.chunks, created_at = EXCLUDED.created_at;

-- name: put_checkpoint
INSERT INTO checkpoints (session_id, checkpoint_id, turn, created_at, payload)
VALUES (%(session_id)s, %(checkpoint_id)s, %(turn)s, %(created_at)s, %(payload)s)
ON CONFLICT (checkpoint_id) DO UPDATE
   SET turn = EXCLUDED.turn, created_at = EXCLUDED.created_at, payload = EXCLUDED.payload;

-- name: trim_checkpoints
DELETE FROM checkpoints
 WHERE session_id = %(session_id)s
   AND checkpoint_id NOT IN (
       SELECT checkpoint_id FROM checkpoints WHERE session_id = %(session_id)s
        ORDER BY created_at DESC, checkpoint_id DESC LIMIT %(keep)s);

-- name: get_checkpoint
SELECT payload::text AS payload FROM checkpoints
 WHERE session_id = %(session_id)s AND checkpoint_id = %(checkpoint_id)s;

-- name: latest_checkpoint
SELECT payload::text AS payload FROM checkpoints WHERE session_id = %(session_id)s
 ORDER BY created_at DESC, checkpoint_id DESC LIMIT 1;

-- name: list_checkpoints
SELECT checkpoint_id, turn, created_at FROM checkpoints
 WHERE session_id = %(session_id)s
 ORDER BY created_at DESC, checkpoint_id DESC LIMIT %(limit)s;

-- name: send_signal
-- Store a signal and wake its session's waiters. Past "keep" undelivered
-- signals of its scope (0: no bound) the oldest go; "dropped" says how many.
WITH sent AS (
    INSERT INTO signals (session_id, user_id, name, payload)
    VALUES (%(session_id)s, %(user_id)s, %(name)s, %(payload)s)
    RETURNING id
), dropped AS (
    DELETE FROM signals WHERE id = ANY(ARRAY(
        SELECT id FROM signals
         WHERE %(keep)s::int > 0
           AND scope = loomflow_worker_scope(%(session_id)s, %(user_id)s)
         ORDER BY id DESC OFFSET greatest(%(keep)s::int - 1, 0)
           FOR UPDATE SKIP LOCKED))
    RETURNING id
)
SELECT pg_notify('loomflow_worker_signals', md5(%(session_id)s)), (SELECT id FROM sent) AS id,
       (SELECT count(*) FROM dropped) AS dropped;

-- name: take_signal
-- A waiter of (session, user) takes the oldest signal sent to that user or to
-- no user; a waiter with no user, only those sent to no user.
DELETE FROM signals
 WHERE id = (SELECT id FROM signals
              WHERE session_id = %(session_id)s AND name = %(name)s
                AND (user_id IS NULL OR user_id = %(user_id)s)
              ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING payload;

-- name: take_signal_into_journal
WITH taken AS (
    DELETE FROM signals
     WHERE id = (SELECT id FROM signals
                  WHERE session_id = %(session_id)s AND name = %(name)s
                    AND (user_id IS NULL OR user_id = %(user_id)s)
                  ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)
    RETURNING payload
), journaled AS (
    INSERT INTO journal_steps (session_id, step_name, value, created_at)
    SELECT %(scope)s, %(key)s, payload, extract(epoch FROM clock_timestamp()) FROM taken
    ON CONFLICT (session_id, step_name) DO NOTHING
)
SELECT payload FROM taken;

-- ---- pruning (runtime.prune, `loomflow-worker prune`, the sweeper's retention) ------------
-- One set of rules. What matches every filter given goes: journal entries,
-- streams and checkpoints written before "before" (epoch seconds), and
-- undelivered signals sent before "cutoff", of the
-- scope "scope"; then requests finished before "cutoff" (the same moment;
-- their attempts cascade), of that scope. The scopes of unfinished requests keep their
-- journal (a run parked on a signal for longer than the cutoff still needs it
-- to resume), and unless one scope is named, every scope keeps its epoch
-- bookkeeping (a later run must not reuse an old epoch). NULL: no filter.
-- Each batch skips the rows a running step has locked.

-- name: prune_cutoff
-- The moment ``age`` seconds ago on the database's clock: every age the ledger
-- and journal hold is measured on it, whatever the caller's clock says.
SELECT now() - make_interval(secs => %(age)s::float8) AS cutoff;

-- name: prune_steps
DELETE FROM journal_steps WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM journal_steps j
     WHERE (%(before)s::float8 IS NULL OR j.created_at < %(before)s::float8)
       AND (%(scope)s::text IS NULL OR j.session_id = %(scope)s::text)
       AND (%(scope)s::text IS NOT NULL
            OR j.step_name NOT IN ('__run_epoch__', '__last_run_epoch__'))
       AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.scope = j.session_id
                          AND loomflow_worker_unfinished(r.status))
     LIMIT %(batch)s FOR UPDATE SKIP LOCKED));

-- name: prune_streams
DELETE FROM journal_streams WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM journal_streams j
     WHERE (%(before)s::float8 IS NULL OR j.created_at < %(before)s::float8)
       AND (%(scope)s::text IS NULL OR j.session_id = %(scope)s::text)
       AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.scope = j.session_id
                          AND loomflow_worker_unfinished(r.status))
     LIMIT %(batch)s FOR UPDATE SKIP LOCKED));

-- name: prune_checkpoints
DELETE FROM checkpoints WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM checkpoints c
     WHERE (%(before)s::float8 IS NULL OR c.created_at < %(before)s::float8)
       AND (%(scope)s::text IS NULL OR c.session_id = %(scope)s::text)
       AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.scope = c.session_id
                          AND loomflow_worker_unfinished(r.status))
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

-- name: prune_runs
-- enqueued_at bounds the scan of runs_status: a request finished before the
-- cutoff was enqueued before it.
DELETE FROM runs WHERE request_id = ANY(ARRAY(
    SELECT request_id FROM runs
     WHERE loomflow_worker_finished(status)
       AND (%(cutoff)s::timestamptz IS NULL
            OR (enqueued_at < %(cutoff)s::timestamptz AND finished_at < %(cutoff)s::timestamptz))
       AND (%(scope)s::text IS NULL OR scope = %(scope)s::text)
     LIMIT %(batch)s FOR UPDATE SKIP LOCKED));

-- name: prune_counts
-- What the prune_* queries would delete now (a progress bar's length).
SELECT (SELECT count(*) FROM journal_steps j
         WHERE (%(before)s::float8 IS NULL OR j.created_at < %(before)s::float8)
           AND (%(scope)s::text IS NULL OR j.session_id = %(scope)s::text)
           AND (%(scope)s::text IS NOT NULL
                OR j.step_name NOT IN ('__run_epoch__', '__last_run_epoch__'))
           AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.scope = j.session_id
                              AND loomflow_worker_unfinished(r.status))) AS journal_steps,
       (SELECT count(*) FROM journal_streams j
         WHERE (%(before)s::float8 IS NULL OR j.created_at < %(before)s::float8)
           AND (%(scope)s::text IS NULL OR j.session_id = %(scope)s::text)
           AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.scope = j.session_id
                              AND loomflow_worker_unfinished(r.status))) AS journal_streams,
       (SELECT count(*) FROM checkpoints c
         WHERE (%(before)s::float8 IS NULL OR c.created_at < %(before)s::float8)
           AND (%(scope)s::text IS NULL OR c.session_id = %(scope)s::text)
           AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.scope = c.session_id
                              AND loomflow_worker_unfinished(r.status))) AS checkpoints,
       (SELECT count(*) FROM signals s
         WHERE (%(cutoff)s::timestamptz IS NULL OR s.created_at < %(cutoff)s::timestamptz)
           AND (%(scope)s::text IS NULL OR s.scope = %(scope)s::text)
           AND NOT loomflow_worker_signal_awaited(s.scope, s.session_id, s.user_id))
       AS signals,
       (SELECT count(*) FROM runs
         WHERE loomflow_worker_finished(status)
           AND (%(cutoff)s::timestamptz IS NULL
                OR (enqueued_at < %(cutoff)s::timestamptz
                    AND finished_at < %(cutoff)s::timestamptz))
           AND (%(scope)s::text IS NULL OR scope = %(scope)s::text)) AS runs;

-- ---- the run ledger --------------------------------------------------------------------

-- name: insert_run
-- A countdown is measured on the database's clock, an eta is a moment.
INSERT INTO runs (request_id, scope, session_id, user_id, agent, kind, prompt, metadata,
                  lock_key, not_before, ignore_result, routing)
VALUES (%(request_id)s, %(scope)s, %(session_id)s, %(user_id)s, %(agent)s, %(kind)s,
        %(prompt)s, %(metadata)s, %(lock_key)s,
        CASE WHEN %(countdown)s::float8 IS NOT NULL
             THEN now() + make_interval(secs => %(countdown)s::float8)
             ELSE %(eta)s::timestamptz END,
        %(ignore_result)s, %(routing)s::jsonb)
ON CONFLICT (request_id) DO NOTHING
RETURNING not_before;

-- name: recorded_request
-- What a request was enqueued with: a second enqueue under its id must match.
SELECT kind, session_id, user_id, agent, prompt, metadata FROM runs
 WHERE request_id = %(request_id)s;

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

-- name: end_attempt
UPDATE run_attempts SET ended_at = clock_timestamp(), outcome = %(outcome)s
 WHERE request_id = %(request_id)s AND attempt = %(attempt)s;

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

-- name: retry_run
UPDATE runs
   SET status = 'queued', failures = failures + 1, error = %(error)s, error_type = %(error_type)s,
       dispatched_at = now() + make_interval(secs => %(countdown)s),
       not_before = now() + make_interval(secs => %(countdown)s), holder_pid = NULL
 WHERE request_id = %(request_id)s AND status = 'running';

-- name: hand_off
-- Hand the scope to its oldest unfinished request (as finish_request does)
-- unless it was handed already.
UPDATE runs SET dispatched_at = now(), handed_at = now()
 WHERE request_id = (SELECT request_id FROM runs
                      WHERE scope = %(scope)s AND loomflow_worker_unfinished(status)
                      ORDER BY seq LIMIT 1)
   AND handed_at IS NULL
RETURNING request_id, kind, session_id, user_id, agent, prompt, metadata, not_before,
          CASE WHEN status = 'queued' THEN options END AS options, routing,
          received_at IS NOT NULL AS received;

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

-- name: mark_dispatched
UPDATE runs SET dispatched_at = now() WHERE request_id = %(request_id)s;

-- name: get_run
SELECT request_id, seq, scope, session_id, user_id, agent, kind, prompt, metadata, status,
       epoch, attempts AS attempts_count, failures, crashes, holder, result, error, error_type,
       enqueued_at, started_at, finished_at, not_before
  FROM runs WHERE request_id = %(request_id)s;

-- name: precheck_run
-- The request, which of the message's arguments differ from its row (the
-- message runs only what the ledger accepted; its prompt, which may be long,
-- is compared by its SHA-256), the oldest unfinished request of its scope
-- before it, and, in the same statement, the scope's lock when the request is
-- unfinished, its message is its own and nothing is before it (NULL: not
-- tried). A request in a `shared` process (many runs at once) must run alone
-- instead when it died in a shared process twice in a row, or lost its lock
-- connection twice in a row, without completing a step (counting its last
-- attempt, which its start counts): it takes no lock here and says so
-- (`quarantine`).
SELECT r.status, r.result, r.error, r.epoch AS pinned, m.differ,
       o.request_id, o.kind, o.session_id, o.user_id, o.agent, o.prompt, o.metadata,
       o.not_before, o.options, o.routing, o.stale, q.quarantine,
       CASE WHEN loomflow_worker_unfinished(r.status) AND o.request_id IS NULL
                 AND cardinality(m.differ) = 0 AND NOT q.quarantine
            THEN CASE WHEN %(may_lock)s THEN pg_try_advisory_lock(%(key)s) ELSE false END
       END AS locked
  FROM runs r
  CROSS JOIN LATERAL (
      -- Its last attempt is looked at only for a running request in a shared
      -- process (a first delivery, nearly every one, skips it).
      SELECT CASE WHEN %(shared)s AND r.status = 'running' THEN coalesce((
                 SELECT r.suspicion + p.shared::int >= 2
                        OR r.lost_streak + (p.outcome = 'lost')::int >= 2
                   FROM loomflow_worker_last_attempt(r.request_id, r.attempts) p), false)
             ELSE false END AS quarantine) q
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

-- name: heartbeat
-- Every running request of one lock connection, stamped in one statement;
-- those asked to stop come back.
UPDATE runs SET heartbeat_at = now()
 WHERE request_id = ANY(%(request_ids)s::text[]) AND status = 'running'
RETURNING request_id, cancel_requested;

-- name: worker_seen
-- A worker process's own row, stamped once per heartbeat interval: how many
-- runs it carries now, of how many slots, and how loaded it is (a restarted
-- pid starts a new row); the results it stored since its last stamp need no
-- check by the sweeper.
WITH stored AS (
    DELETE FROM results_to_check WHERE request_id = ANY(%(stored)s::text[])
)
INSERT INTO workers AS w (worker, hostname, pid, slots, heartbeat_interval, runs, loop_lag,
                          lock_queue, admitting)
VALUES (%(worker)s, %(hostname)s, %(pid)s, %(slots)s, %(interval)s, %(runs)s, %(loop_lag)s,
        %(lock_queue)s, %(admitting)s)
ON CONFLICT (worker) DO UPDATE
   SET runs = EXCLUDED.runs, slots = EXCLUDED.slots,
       heartbeat_interval = EXCLUDED.heartbeat_interval, seen_at = now(),
       loop_lag = EXCLUDED.loop_lag, lock_queue = EXCLUDED.lock_queue,
       admitting = EXCLUDED.admitting,
       started_at = CASE WHEN w.stopped_at IS NULL THEN w.started_at ELSE now() END,
       stopped_at = NULL;

-- name: worker_stopped
-- A worker process that closes cleanly (and the results it stored since its
-- last stamp, as worker_seen).
WITH stored AS (
    DELETE FROM results_to_check WHERE request_id = ANY(%(stored)s::text[])
)
UPDATE workers SET stopped_at = now(), seen_at = now(), runs = 0 WHERE worker = %(worker)s;

-- ---- the sweeper ---------------------------------------------------------------------------

-- name: leader_lock
SELECT pg_try_advisory_lock(%(key)s);

-- name: leader_claim
INSERT INTO sweeper_leader (id, holder, backend_pid) VALUES (1, %(holder)s, pg_backend_pid())
ON CONFLICT (id) DO UPDATE
   SET holder = EXCLUDED.holder, backend_pid = EXCLUDED.backend_pid, heartbeat_at = now();

-- name: leader_stale
SELECT backend_pid FROM sweeper_leader
 WHERE id = 1 AND heartbeat_at < now() - make_interval(secs => %(lease)s);

-- name: terminate_backend
SELECT pg_terminate_backend(%(pid)s);

-- name: frozen_holders
-- Running requests whose heartbeat is older than the lease while their
-- scope's lock is still held, by the backend that holds it.
SELECT r.request_id, l.pid
  FROM runs r
  JOIN pg_locks l
    ON l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND l.classid = ((r.lock_key >> 32) & 4294967295)::oid
   AND l.objid = (r.lock_key & 4294967295)::oid
 WHERE r.status = 'running' AND r.lock_key IS NOT NULL
   AND r.heartbeat_at < now() - make_interval(secs => %(lease)s)
   AND l.pid = r.holder_pid;

-- name: orphans
-- The oldest unfinished request of each scope whose lock nobody holds:
-- running, with a heartbeat older than dead_after (its worker died; a
-- worker that merely lost its lock stops its own run within a heartbeat),
-- or queued with a message that is gone. A running one is dispatched again at
-- once, then again only when an attempt started since died too, or after
-- `after` seconds.
-- A queued request's message is in the broker when nobody received it or it
-- was published again since (a handoff), and no live worker says it holds it
-- unstarted (held_at within held_within: a rate limit, a prefetch). Each
-- queue is counted apart (its name from the request's routing, the default
-- queue when it has none): of a queue's requests, the broker holds `waiting`
-- messages (the arrays `queues` and `waiting` pair them), so only its oldest
-- (count - waiting) can be gone, since a broker hands out the oldest first,
-- and only after queued_after seconds (a message on its way to a worker is
-- counted nowhere for a moment). A request whose publish failed
-- (dispatched_at -infinity) is gone. With its queue's count unknown (NULL, or
-- not asked: the broker did not answer), a message counts as gone after
-- `after` seconds. A queued request received and parked, not published since,
-- is in no broker: it goes after queued_after.
-- A request that may not start yet (not_before: a countdown or eta) has its
-- message held by a worker until then, counted in no queue: it is in no
-- count, and gone no sooner than queued_after past its not_before (unless its
-- publish failed: then it is published at once, with its eta).
WITH in_broker AS (
    SELECT request_id, dispatched_at, coalesce(routing->>'queue', %(default_queue)s) AS queue,
           row_number() OVER (PARTITION BY coalesce(routing->>'queue', %(default_queue)s)
                              ORDER BY dispatched_at, seq) AS age
      FROM runs
     WHERE status = 'queued' AND (received_at IS NULL OR dispatched_at > received_at)
       AND (not_before IS NULL OR not_before <= now())
       AND NOT coalesce(held_at > dispatched_at
                        AND held_at > now() - make_interval(secs => %(held_within)s), false)
), counted AS (
    SELECT c.queue, c.waiting
      FROM unnest(%(queues)s::text[], %(waiting)s::bigint[]) AS c(queue, waiting)
), budget AS (
    SELECT b.queue, count(*) - min(c.waiting) AS lost
      FROM in_broker b LEFT JOIN counted c USING (queue)
     GROUP BY b.queue
), heads AS (
    SELECT DISTINCT ON (scope) request_id, kind, session_id, user_id, agent, prompt, metadata,
           not_before, CASE WHEN status = 'queued' THEN options END AS options, routing, status,
           dispatched_at, swept_at, started_at, heartbeat_at, lock_key,
           coalesce(held_at > dispatched_at
                    AND held_at > now() - make_interval(secs => %(held_within)s), false) AS held
      FROM runs
     WHERE loomflow_worker_unfinished(status)
     ORDER BY scope, seq
)
SELECT h.request_id, h.kind, h.session_id, h.user_id, h.agent, h.prompt, h.metadata,
       h.not_before, h.options, h.routing, h.status
  FROM heads h
  LEFT JOIN in_broker b USING (request_id)
  LEFT JOIN budget g ON g.queue = b.queue
 WHERE h.lock_key IS NOT NULL
   AND CASE WHEN h.status = 'running' THEN
            h.heartbeat_at < now() - make_interval(secs => %(dead_after)s)
            AND (h.swept_at IS NULL OR h.swept_at < h.started_at
                 OR h.swept_at < now() - make_interval(secs => %(after)s))
       ELSE
            NOT h.held
            AND h.dispatched_at < now() - make_interval(secs => %(queued_after)s)
            AND (h.dispatched_at = '-infinity'
                 OR coalesce(h.not_before, '-infinity')
                    < now() - make_interval(secs => %(queued_after)s))
            AND (h.swept_at IS NULL
                 OR h.swept_at < now() - make_interval(secs => %(queued_after)s))
            AND (b.request_id IS NULL OR b.dispatched_at = '-infinity'
                 OR b.age <= g.lost
                 OR (g.lost IS NULL
                     AND greatest(h.dispatched_at, h.not_before)
                         < now() - make_interval(secs => %(after)s)))
       END
   AND NOT EXISTS (
       SELECT 1 FROM pg_locks l
        WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND l.classid = ((h.lock_key >> 32) & 4294967295)::oid
          AND l.objid = (h.lock_key & 4294967295)::oid)
 LIMIT %(limit)s;

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
       SELECT 1 FROM pg_locks l
        WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND l.classid = ((r.lock_key >> 32) & 4294967295)::oid
          AND l.objid = (r.lock_key & 4294967295)::oid);

-- name: queued_queues
-- The queues the queued requests' messages wait in (the default queue for a
-- request with no routing), with how many requests are queued in each,
-- parked or not: the sweeper counts each queue's messages, and the leader
-- reports these counts as the fleet's backlog.
SELECT coalesce(routing->>'queue', %(default_queue)s) AS queue, count(*) AS queued
  FROM runs
 WHERE status = 'queued'
 GROUP BY 1;

-- name: mark_held
-- A worker holds these requests' messages, received but not started (a rate
-- limit, a prefetch): stamped, so the sweeper does not take them for lost
-- while the worker keeps saying so.
UPDATE runs SET held_at = now()
 WHERE request_id = ANY(%(request_ids)s::text[]) AND status = 'queued'
RETURNING request_id;

-- name: known_requests
-- Which of these requests the ledger has (any status).
SELECT request_id FROM runs WHERE request_id = ANY(%(request_ids)s::text[]);

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

-- name: forget_workers
-- Worker processes not seen for `after` seconds (an autoscaled fleet's
-- long-gone ones).
DELETE FROM workers WHERE seen_at < now() - make_interval(secs => %(after)s);

-- name: mark_undispatched
-- The broker refused a request's message: it is the first the sweeper
-- publishes once the broker is back.
UPDATE runs SET dispatched_at = '-infinity'
 WHERE request_id = %(request_id)s AND status = 'queued' AND received_at IS NULL;

-- name: mark_swept
-- The sweeper publishes these requests again (one statement for its batch),
-- or one is handed to a process of its own: dispatched now.
UPDATE runs SET swept_at = now(), dispatched_at = greatest(dispatched_at, now())
 WHERE request_id = ANY(%(request_ids)s::text[]);

-- name: mark_unswept
-- The broker refused the sweeper's batch (which of its messages went is
-- unknown): each goes again on the next sweep the broker answers, a queued
-- one first among its queue's, as if never published.
UPDATE runs SET swept_at = NULL,
       dispatched_at = CASE WHEN status = 'queued' THEN '-infinity' ELSE dispatched_at END
 WHERE request_id = ANY(%(request_ids)s::text[]);

-- ---- cancel and busy sessions -------------------------------------------------------------

-- name: enqueue_lock
SELECT pg_advisory_xact_lock(%(key)s);

-- name: scope_busy
SELECT request_id, status FROM runs
 WHERE scope = %(scope)s AND loomflow_worker_unfinished(status)
 ORDER BY seq LIMIT 1;

-- name: cancel_requests
-- Cancel one request (request_id), or every unfinished request of a scope
-- older than a given one (scope and by). A queued request that never started
-- is cancelled on the spot (it has no epoch and journaled nothing); any other
-- unfinished one is flagged and stops at its next step boundary, or when it
-- is next picked up.
UPDATE runs
   SET cancel_requested = true,
       status = CASE WHEN status = 'queued' AND epoch IS NULL THEN 'cancelled' ELSE status END,
       error = CASE WHEN status = 'queued' AND epoch IS NULL THEN %(reason)s ELSE error END,
       error_type = CASE WHEN status = 'queued' AND epoch IS NULL THEN 'Cancelled'
                         ELSE error_type END,
       finished_at = CASE WHEN status = 'queued' AND epoch IS NULL THEN now()
                          ELSE finished_at END
 WHERE (%(request_id)s::text IS NOT NULL AND request_id = %(request_id)s::text)
    OR (%(by)s::text IS NOT NULL AND scope = %(scope)s::text
        AND loomflow_worker_unfinished(status) AND request_id <> %(by)s::text
        AND seq < (SELECT seq FROM runs WHERE request_id = %(by)s::text))
RETURNING status, request_id, kind, session_id, user_id, agent, prompt, metadata,
          CASE WHEN status = 'queued' THEN not_before END AS not_before, options, routing;

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
       finished_at = CASE WHEN epoch IS NULL THEN now() ELSE finished_at END
 WHERE status = 'queued'
   AND (%(session_id)s::text IS NULL OR session_id = %(session_id)s::text)
   AND (%(user_id)s::text IS NULL OR user_id = %(user_id)s::text)
RETURNING status, request_id, kind, session_id, user_id, agent, prompt, metadata,
          CASE WHEN status = 'queued' THEN not_before END AS not_before, options, routing;

-- ---- operating the fleet (loomflow_worker.admin, the CLI) ---------------------------------

-- name: admin_list_runs
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
SELECT status, result, error, error_type FROM runs WHERE request_id = %(request_id)s;

-- name: admin_run_attempts
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

-- name: admin_server_version
SELECT current_setting('server_version');

-- name: admin_schema_present
SELECT to_regclass('loomflow_worker_schema') IS NOT NULL;

-- ---- one statement to start a request, one to finish it ------------------------------

-- name: start_request
-- Under the scope lock: read the request, look for an older unfinished one,
-- and (when there is none and the request is not finished) count the
-- attempt, pin the epoch on the first attempt and mark it running, in one
-- statement. A previous attempt that ended "interrupted" (its worker shut
-- down for a deploy) or "lost" (its worker lost its database connection and
-- lived) does not count as a crash, and neither does one that died with
-- other runs of its process (shared): that raises the request's suspicion
-- instead. A lost one lengthens its streak of lost attempts.
WITH r AS (
    SELECT request_id, seq, scope, status, epoch, kind, attempts, cancel_requested,
           result, error, error_type, heartbeat_at, enqueued_at
      FROM runs WHERE request_id = %(request_id)s FOR UPDATE
), prev AS (
    -- The previous attempt, if the request was running: how it ended, and
    -- whether other runs of its process died with it.
    SELECT p.outcome, p.shared
      FROM r, loomflow_worker_last_attempt(r.request_id, r.attempts) p
     WHERE r.status = 'running'
), older AS (
    SELECT o.request_id, o.kind, o.session_id, o.user_id, o.agent, o.prompt, o.metadata,
           o.not_before, CASE WHEN o.status = 'queued' THEN o.options END AS options, o.routing,
           greatest(o.dispatched_at, o.not_before) < now() - make_interval(secs => %(stale)s)
           AS stale
      FROM runs o JOIN r ON o.scope = r.scope
     WHERE loomflow_worker_unfinished(o.status) AND o.seq < r.seq
     ORDER BY o.seq LIMIT 1
), marks AS (
    SELECT max(loomflow_worker_epoch(value)) FILTER (WHERE step_name = '__run_epoch__') AS current,
           max(loomflow_worker_epoch(value)) FILTER (WHERE step_name = '__last_run_epoch__') AS last
      FROM journal_steps
     WHERE session_id = %(scope)s AND step_name IN ('__run_epoch__', '__last_run_epoch__')
), started AS (
    UPDATE runs u
       SET status = 'running',
           epoch = coalesce(u.epoch, CASE WHEN r.kind = 'resume' AND m.last IS NOT NULL
                                          THEN m.last ELSE coalesce(m.current, 0) END),
           attempts = u.attempts + 1,
           crashes = u.crashes + (r.status = 'running'
               AND coalesce(p.outcome IS NULL AND NOT p.shared, true))::int,
           suspicion = u.suspicion + coalesce(p.shared, false)::int,
           lost_streak = u.lost_streak + coalesce(p.outcome = 'lost', false)::int,
           holder = %(holder)s,
           holder_pid = pg_backend_pid(),
           started_at = now(),
           heartbeat_at = now()
      FROM r CROSS JOIN marks m LEFT JOIN prev p ON true
     WHERE u.request_id = r.request_id AND loomflow_worker_unfinished(r.status)
       AND NOT EXISTS (SELECT 1 FROM older)
    RETURNING u.epoch, u.attempts, u.crashes, u.failures, u.suspicion, u.lost_streak
), attempt_row AS (
    INSERT INTO run_attempts (request_id, attempt, worker, pid, epoch)
    SELECT %(request_id)s, attempts, %(holder)s, %(pid)s, epoch FROM started
    ON CONFLICT (request_id, attempt) DO NOTHING
)
SELECT r.status, r.seq, r.result, r.error, r.error_type, r.cancel_requested,
       s.epoch, s.attempts, s.crashes, s.failures, s.suspicion, s.lost_streak,
       CASE WHEN r.status = 'running'
            THEN extract(epoch FROM now() - r.heartbeat_at)::float8 END AS since_heartbeat,
       (SELECT extract(epoch FROM now() - p.finished_at)::float8
          FROM runs p
         WHERE p.scope = r.scope AND p.seq < r.seq AND p.finished_at > r.enqueued_at
         ORDER BY p.seq DESC LIMIT 1) AS since_handoff,
       o.request_id, o.kind, o.session_id, o.user_id, o.agent, o.prompt, o.metadata,
       o.not_before, o.options, o.routing, o.stale
  FROM r
  LEFT JOIN started s ON true
  LEFT JOIN older o ON true;

-- name: finish_request
-- The request's end in one statement: the scope's epoch advanced past the
-- pinned one (forward only), the status, result and error recorded, the
-- attempt closed, and the next unfinished request of the scope chosen.
WITH advanced AS (
    INSERT INTO journal_steps (session_id, step_name, value, created_at)
    VALUES (%(scope)s, '__run_epoch__', %(epoch_value)s, extract(epoch FROM clock_timestamp()))
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
    -- already took its message and parked it (see park_request).
    UPDATE runs SET dispatched_at = now(), handed_at = now()
     WHERE request_id = (SELECT request_id FROM chosen)
    RETURNING request_id, received_at IS NOT NULL AS received
)
SELECT c.*, h.received FROM chosen c JOIN handed h USING (request_id);

-- name: mark_interrupted
-- A worker shutting down (a deploy): its attempts still running end
-- "interrupted", so their next attempt does not count a crash.
UPDATE run_attempts SET outcome = 'interrupted'
 WHERE starts_with(worker, %(node)s) AND ended_at IS NULL AND outcome IS NULL;

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

-- name: mark_result_checked
-- Checked, and those past looking back to (or whose request was pruned).
DELETE FROM results_to_check
 WHERE request_id = ANY(%(request_ids)s)
    OR finished_at < now() - make_interval(secs => %(within)s);

-- name: mark_result_unstored
-- Its worker could not store the finished request's result in the result
-- backend: the sweeper stores it from here (unless its caller wants no
-- result: ignore_result).
UPDATE runs SET result_stored = false
 WHERE request_id = %(request_id)s AND NOT loomflow_worker_unfinished(status)
   AND NOT ignore_result;

-- name: unstored_results
SELECT request_id FROM runs WHERE NOT result_stored ORDER BY finished_at LIMIT %(limit)s;

-- name: mark_result_stored
UPDATE runs SET result_stored = true
 WHERE request_id = ANY(%(request_ids)s);

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

-- ---- lock connections shared by many runs -----------------------------------------------

-- name: put_journal_batch
-- The journal writes of every run on one lock connection that arrived while
-- its previous statement was in flight, in one statement (each key once).
WITH steps AS (
    INSERT INTO journal_steps (session_id, step_name, value, created_at)
    SELECT s, k, v, extract(epoch FROM clock_timestamp())
      FROM unnest(%(step_scopes)s::text[], %(step_keys)s::text[], %(step_values)s::bytea[])
           AS t(s, k, v)
    ON CONFLICT (session_id, step_name) DO UPDATE
       SET value = EXCLUDED.value, created_at = EXCLUDED.created_at
), streams AS (
    INSERT INTO journal_streams (session_id, step_name, chunks, created_at)
    SELECT s, k, v, extract(epoch FROM clock_timestamp())
      FROM unnest(%(stream_scopes)s::text[], %(stream_keys)s::text[],
                  %(stream_values)s::bytea[]) AS t(s, k, v)
    ON CONFLICT (session_id, step_name) DO UPDATE
       SET chunks = EXCLUDED.chunks, created_at = EXCLUDED.created_at
)
SELECT 1;

-- name: unlock_if_held
-- Release one scope's lock if this backend holds it (after a failed open).
SELECT pg_advisory_unlock(%(key)s) FROM pg_locks l
 WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
   AND l.pid = pg_backend_pid()
   AND l.classid = ((%(key)s::bigint >> 32) & 4294967295)::oid
   AND l.objid = (%(key)s::bigint & 4294967295)::oid;

-- name: unlock_scope
-- Release one scope's lock and say whether this backend still holds it
-- (it must not: the lock was taken once).
WITH released AS (SELECT pg_advisory_unlock(%(key)s) AS ok)
SELECT r.ok AS released, EXISTS (
    SELECT 1 FROM pg_locks l
     WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
       AND l.pid = pg_backend_pid()
       AND l.classid = ((%(key)s::bigint >> 32) & 4294967295)::oid
       AND l.objid = (%(key)s::bigint & 4294967295)::oid) AS still_held
  FROM released r;

-- ---- revoked and expired requests --------------------------------------------------------

-- name: revoked_request
SELECT scope, status, epoch, lock_key FROM runs WHERE request_id = %(request_id)s;

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

-- name: flag_cancel
UPDATE runs SET cancel_requested = true
 WHERE request_id = %(request_id)s AND loomflow_worker_unfinished(status);

-- name: unfinished_among
SELECT request_id FROM runs
 WHERE request_id = ANY(%(request_ids)s::text[]) AND loomflow_worker_unfinished(status);

-- name: mark_attempt_lost
-- A worker whose attempt lost its lock connection (a Postgres restart, a
-- network blip) and lived: the attempt ended "lost", not crashed. With no
-- attempt number (lost while it started), this holder's open attempt.
UPDATE run_attempts SET ended_at = clock_timestamp(), outcome = 'lost'
 WHERE request_id = %(request_id)s AND ended_at IS NULL
   AND (attempt = %(attempt)s OR (%(attempt)s::int IS NULL AND worker = %(holder)s));

-- name: mark_frozen_lost
-- Attempts whose process stopped heartbeating while it held their locks (frozen,
-- or its loop held past the lease): the sweeper ended its lock connection, so
-- they end "lost", not crashed, before their next attempt starts.
UPDATE run_attempts a SET ended_at = clock_timestamp(), outcome = 'lost'
  FROM runs r
 WHERE r.request_id = ANY(%(request_ids)s) AND a.request_id = r.request_id
   AND a.attempt = r.attempts AND a.ended_at IS NULL;

-- name: clear_suspicion
-- An attempt of a suspected request completed a step: its record is clean again.
UPDATE runs SET suspicion = 0, lost_streak = 0 WHERE request_id = %(request_id)s;

-- ---- connection checks --------------------------------------------------------------------

-- name: session_probe_mark
-- A session-level setting: it lasts as long as the session, not the transaction.
SELECT pg_backend_pid(), set_config('loomflow_worker.session_probe', %(token)s, false);

-- name: session_probe_read
SELECT pg_backend_pid(), current_setting('loomflow_worker.session_probe', true);

-- ---- the run console (loomflow_worker.console) ----------------------------------------------
-- console: read only, on connections that plan each statement with its values (so a
-- filter given as NULL costs nothing and each one given uses its index, 0010_console.sql).
-- A prompt leaves the database cut to prompt_chars, except on a run's own page when asked.

-- name: console_requests
-- console: the requests list, newest first; keyset paging on seq (before: the last
-- seq of the page shown).
SELECT request_id, seq, session_id, user_id, agent, kind, status, attempts, crashes,
       left(prompt, %(prompt_chars)s) AS prompt, length(prompt) AS prompt_length,
       enqueued_at, started_at, finished_at, holder
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
       r.enqueued_at, r.started_at, r.finished_at, r.holder, r.cancel_requested,
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

-- name: console_run
-- console: one request; its prompt whole only when asked for.
SELECT request_id, seq, scope, session_id, user_id, agent, kind,
       CASE WHEN %(full_prompt)s THEN prompt ELSE left(prompt, %(prompt_chars)s) END AS prompt,
       length(prompt) AS prompt_length, metadata, status, epoch, attempts, failures, crashes,
       holder, cancel_requested, result, error, error_type, enqueued_at, started_at,
       heartbeat_at, finished_at, now() AS now
  FROM runs WHERE request_id = %(request_id)s;

-- name: console_attempts
-- console: a request's attempts, each with the start of the one after it (where
-- the lane of an attempt whose worker died ends).
SELECT attempt, worker, pid, epoch, started_at, ended_at, outcome,
       lead(started_at) OVER (ORDER BY attempt) AS next_started_at
  FROM run_attempts WHERE request_id = %(request_id)s
 ORDER BY attempt;

-- name: console_journal
-- console: a run's journal entries (its epoch's "<epoch>/" keys, or at epoch 0 the
-- keys in no namespace), oldest first, at most `limit`; the stream entries' chunks too.
SELECT stream, step_name, created_at, value FROM (
    SELECT false AS stream, step_name, created_at, value FROM journal_steps
     WHERE session_id = %(scope)s
       AND step_name NOT IN ('__run_epoch__', '__last_run_epoch__')
    UNION ALL
    SELECT true, step_name, created_at, chunks FROM journal_streams
     WHERE session_id = %(scope)s
) entries
 WHERE CASE WHEN %(epoch)s::integer > 0
            THEN step_name COLLATE "C" >= %(lo)s AND step_name COLLATE "C" < %(hi)s
            ELSE step_name !~ '^([0-9]+|[0-9a-f]{16})/' END
 ORDER BY created_at, step_name
 LIMIT %(limit)s;

-- name: console_in_flight
-- console: running requests by the worker process that holds them (node:pid).
SELECT holder, count(*) AS running, min(started_at) AS oldest_start,
       max(heartbeat_at) AS last_heartbeat, min(heartbeat_at) AS stalest_heartbeat
  FROM runs WHERE status = 'running'
 GROUP BY holder ORDER BY holder;

-- name: console_recent_workers
-- console: worker processes that started attempts within `window` seconds, and how
-- those attempts ended (NULL outcome with a later attempt: the worker died).
SELECT a.worker, count(*) AS attempts, max(a.started_at) AS last_start,
       count(*) FILTER (WHERE a.outcome IS NULL AND a.ended_at IS NULL
                          AND EXISTS (SELECT 1 FROM run_attempts n
                                       WHERE n.request_id = a.request_id
                                         AND n.attempt > a.attempt)) AS died,
       count(*) FILTER (WHERE a.outcome IN ('interrupted', 'lost')) AS interrupted
  FROM run_attempts a
 WHERE a.started_at > now() - make_interval(secs => %(window)s)
 GROUP BY a.worker ORDER BY max(a.started_at) DESC;

-- name: console_connections
-- console: the fleet's Postgres connections by role (lock, sweeper, pool...) and
-- client address: each worker process keeps one sweeper connection.
SELECT application_name, client_addr::text AS client_addr, count(*) AS connections,
       min(backend_start) AS oldest
  FROM pg_stat_activity
 WHERE datname = current_database() AND starts_with(application_name, 'loomflow-worker')
 GROUP BY application_name, client_addr ORDER BY application_name, client_addr;

-- name: console_leader
-- console: the sweeper's leader and whether its connection is still there.
SELECT holder, backend_pid, heartbeat_at, now() - heartbeat_at AS age,
       EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = l.backend_pid) AS connected
  FROM sweeper_leader l WHERE id = 1;

-- name: console_swept
-- console: the requests the sweeper dispatched again, latest first.
SELECT request_id, session_id, user_id, status, attempts, swept_at
  FROM runs WHERE swept_at IS NOT NULL
 ORDER BY swept_at DESC LIMIT %(limit)s;

-- name: console_queue
-- console: the ledger's queue (the queue of record): queued requests ready to
-- run, those waiting out a retry's backoff, and running ones.
SELECT count(*) FILTER (WHERE status = 'queued' AND dispatched_at <= now()) AS ready,
       count(*) FILTER (WHERE status = 'queued' AND dispatched_at > now()) AS backing_off,
       count(*) FILTER (WHERE status = 'running') AS running,
       min(enqueued_at) FILTER (WHERE status = 'queued') AS oldest_queued
  FROM runs WHERE loomflow_worker_unfinished(status);

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

-- name: console_sweeper_actions
-- console: the sweeper's latest actions, latest first.
SELECT id, at, worker, action, request_id, detail
  FROM sweeper_actions
 ORDER BY id DESC LIMIT %(limit)s;

-- ---- the demo's own database (`loomflow-worker demo` on a server it did not start) ---------

-- name: create_database
-- A database for one demo; its name is an identifier psycopg composes in.
CREATE DATABASE {}

-- name: drop_database
-- The demo's database at its end, whoever is still connected.
DROP DATABASE IF EXISTS {} WITH (FORCE)
