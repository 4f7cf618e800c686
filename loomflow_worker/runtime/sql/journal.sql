-- The journal of runs (runtime.store, runtime.lockconn, runtime.fastpath): steps (one value
-- per key) in journal_steps, streams (chunks per key) in journal_streams, both keyed
-- (session_id, step_name), session_id holding the run's scope; and loomflow's checkpoints.
--
-- A run's entries are keyed "<epoch>/..." (a nested run's "<16 hex>/..."); a run at epoch 0
-- journals in no namespace. The scope's epoch bookkeeping is kept under __run_epoch__ and
-- __last_run_epoch__. A namespace is read by a range scan of journal_steps_namespace and
-- journal_streams_namespace, whose COLLATE "C" makes "<ns>/" to "<ns>0" the prefix's range
-- under any database collation.
--
-- Entries are stamped with the database's clock, the one that also stamps attempts: which
-- attempt wrote a step never depends on a worker's clock. The statements runtime.fastpath
-- prepares (try_lock, open_run, put_step, put_stream, advance_epoch, unlock_scope) have
-- their placeholders numbered there, in binary format.

-- name: lock_keepalives
-- Sent as a lock connection opens: the server side of the client's TCP keepalive (idle,
-- interval and count in seconds, the user timeout in milliseconds, as text), so the locks
-- of a partitioned worker are freed in seconds rather than after the kernel's two hours.
SELECT set_config('tcp_keepalives_idle', %(idle)s, false),
       set_config('tcp_keepalives_interval', %(interval)s, false),
       set_config('tcp_keepalives_count', %(count)s, false),
       set_config('tcp_user_timeout', %(user_timeout)s, false);

-- name: session_probe_mark
-- A session-level setting: it lasts as long as the session, not the transaction.
SELECT pg_backend_pid(), set_config('loomflow_worker.session_probe', %(token)s, false);

-- name: session_probe_read
-- This backend's pid and its probe setting (NULL when unset): a second connection must
-- differ in both, and the marking one must still show both in a later transaction, or the
-- connections are not one server session each (a transaction-mode pooler).
SELECT pg_backend_pid(), current_setting('loomflow_worker.session_probe', true);

-- name: try_lock
-- A scope's session advisory lock, tried without waiting (true: taken); it outlives
-- transactions and is held until unlock_scope or the connection ends. Sent by fastpath with
-- open_run in one pipeline; execution.ledger.end_revoked takes a revoked request's lock with
-- it too.
SELECT pg_try_advisory_lock(%(key)s);

-- name: open_run
-- A run's open in one statement: the scope's current and last-run epochs, the epoch chosen
-- (pinned, else the last run's when resuming, else the current one) and every step and
-- stream of that epoch's namespace, a row each (one row with a NULL step_name: an empty
-- namespace); range scans of the namespace indexes, or the scope's keys in no namespace at
-- epoch 0.
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

-- name: unlock_if_held
-- Release one scope's lock if this backend holds it (after a failed open).
SELECT pg_advisory_unlock(%(key)s) FROM pg_locks l
 WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
   AND l.pid = pg_backend_pid()
   AND l.classid = ((%(key)s::bigint >> 32) & 4294967295)::oid
   AND l.objid = (%(key)s::bigint & 4294967295)::oid;

-- name: load_namespace
-- The steps and streams of one namespace of a scope (keys from lo to hi, its "<ns>/"
-- prefix), loaded whole on the first lookup in a namespace the run's open did not load (a
-- nested run's): one range scan of each table's namespace index.
SELECT false AS stream, step_name, value FROM journal_steps
 WHERE session_id = %(scope)s
   AND step_name COLLATE "C" >= %(lo)s AND step_name COLLATE "C" < %(hi)s
UNION ALL
SELECT true, step_name, chunks FROM journal_streams
 WHERE session_id = %(scope)s
   AND step_name COLLATE "C" >= %(lo)s AND step_name COLLATE "C" < %(hi)s;

-- name: load_root_namespace
-- The steps and streams of a scope in no namespace (no "<epoch>/" or "<16 hex>/" prefix),
-- where a run at epoch 0 journals, loaded whole on the first lookup there that the open did
-- not load: the scope's rows by primary key, filtered by the pattern.
SELECT false AS stream, step_name, value FROM journal_steps
 WHERE session_id = %(scope)s AND step_name !~ '^([0-9]+|[0-9a-f]{16})/'
UNION ALL
SELECT true, step_name, chunks FROM journal_streams
 WHERE session_id = %(scope)s AND step_name !~ '^([0-9]+|[0-9a-f]{16})/';

-- name: put_step
-- One step's value written (the last write of a key wins), stamped on the database's clock:
-- prepared by fastpath for a run's writes, plain for the JournalStore protocol's put_step.
-- A run of a worker's attempt writes with the attempt (request, attempt: its fencing token)
-- and its write lands only while that attempt is open in the ledger; past that it is
-- refused (loomflow_worker_holds raises LW001, migration 0034). A run with no attempt
-- passes NULLs.
INSERT INTO journal_steps (session_id, step_name, value, created_at)
SELECT %(scope)s, %(key)s, %(value)s, extract(epoch FROM clock_timestamp())
 WHERE loomflow_worker_holds(%(request)s, %(attempt)s)
ON CONFLICT (session_id, step_name) DO UPDATE
   SET value = EXCLUDED.value, created_at = EXCLUDED.created_at;

-- name: put_stream
-- One stream's chunks written, as put_step (with its fencing token): prepared by fastpath for
-- a run's writes, plain for the JournalStore protocol's put_stream.
INSERT INTO journal_streams (session_id, step_name, chunks, created_at)
SELECT %(scope)s, %(key)s, %(value)s, extract(epoch FROM clock_timestamp())
 WHERE loomflow_worker_holds(%(request)s, %(attempt)s)
ON CONFLICT (session_id, step_name) DO UPDATE
   SET chunks = EXCLUDED.chunks, created_at = EXCLUDED.created_at;

-- name: put_journal_batch
-- The journal writes of every run on one lock connection that arrived while
-- its previous statement was in flight, in one statement (each key once), each
-- row with its run's fencing token (as put_step): one refused fails them all,
-- and the lock connection sends each run's writes again on their own.
WITH steps AS (
    INSERT INTO journal_steps (session_id, step_name, value, created_at)
    SELECT s, k, v, extract(epoch FROM clock_timestamp())
      FROM unnest(%(step_scopes)s::text[], %(step_keys)s::text[], %(step_values)s::bytea[],
                  %(step_requests)s::text[], %(step_attempts)s::int[]) AS t(s, k, v, r, a)
     WHERE loomflow_worker_holds(r, a)
    ON CONFLICT (session_id, step_name) DO UPDATE
       SET value = EXCLUDED.value, created_at = EXCLUDED.created_at
), streams AS (
    INSERT INTO journal_streams (session_id, step_name, chunks, created_at)
    SELECT s, k, v, extract(epoch FROM clock_timestamp())
      FROM unnest(%(stream_scopes)s::text[], %(stream_keys)s::text[],
                  %(stream_values)s::bytea[], %(stream_requests)s::text[],
                  %(stream_attempts)s::int[]) AS t(s, k, v, r, a)
     WHERE loomflow_worker_holds(r, a)
    ON CONFLICT (session_id, step_name) DO UPDATE
       SET chunks = EXCLUDED.chunks, created_at = EXCLUDED.created_at
)
SELECT 1;

-- name: read_epochs
-- The scope's epoch bookkeeping (__run_epoch__, __last_run_epoch__, encoded values; two
-- primary-key lookups): what a finish that journaled nothing reads instead of advancing the
-- epoch.
SELECT step_name, value FROM journal_steps
 WHERE session_id = %(scope)s
   AND step_name IN ('__run_epoch__', '__last_run_epoch__');

-- name: advance_epoch
-- The scope's epoch advanced to new (the run's epoch + 1), forward only, and the epoch
-- stored after it returned: concurrent finishes never step it back or lose an advance.
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

-- name: unlock_scope
-- Release one scope's lock, and say whether this backend held it. A process
-- takes a scope's lock once on its connection (its own runs of a scope take
-- turns before the lock, store.PostgresJournalStore._held), so released it is
-- free. No look at pg_locks to make sure: the view copies every lock of the
-- server under all its lock partitions, a fleet's thousands of locks at each
-- run's end (1.3 ms against 0.18 ms for the unlock alone, 2,000 locks held).
SELECT pg_advisory_unlock(%(key)s) AS released;

-- name: get_step
-- One step's value and when it was written, for the JournalStore protocol outside a run's
-- in-memory journal: a primary-key lookup.
SELECT value, created_at FROM journal_steps
 WHERE session_id = %(scope)s AND step_name = %(key)s;

-- name: get_stream
-- One stream's chunks, for the JournalStore protocol outside a run's in-memory journal: a
-- primary-key lookup.
SELECT chunks FROM journal_streams
 WHERE session_id = %(scope)s AND step_name = %(key)s;

-- name: put_checkpoint
-- A loomflow checkpoint stored under its id (a second put of the id replaces it);
-- trim_checkpoints follows in the same transaction.
INSERT INTO checkpoints (session_id, checkpoint_id, turn, created_at, payload)
VALUES (%(session_id)s, %(checkpoint_id)s, %(turn)s, %(created_at)s, %(payload)s)
ON CONFLICT (checkpoint_id) DO UPDATE
   SET turn = EXCLUDED.turn, created_at = EXCLUDED.created_at, payload = EXCLUDED.payload;

-- name: trim_checkpoints
-- A session's newest `keep` checkpoints (max_checkpoints) kept and the rest deleted, after
-- each put: checkpoints_session_created orders them.
DELETE FROM checkpoints
 WHERE session_id = %(session_id)s
   AND checkpoint_id NOT IN (
       SELECT checkpoint_id FROM checkpoints WHERE session_id = %(session_id)s
        ORDER BY created_at DESC, checkpoint_id DESC LIMIT %(keep)s);

-- name: get_checkpoint
-- One checkpoint's payload as JSON text (for Checkpoint.model_validate_json), by its id,
-- which must be of the session.
SELECT payload::text AS payload FROM checkpoints
 WHERE session_id = %(session_id)s AND checkpoint_id = %(checkpoint_id)s;

-- name: latest_checkpoint
-- A session's newest checkpoint's payload as JSON text (the id breaks a tie of times), read
-- from checkpoints_session_created.
SELECT payload::text AS payload FROM checkpoints WHERE session_id = %(session_id)s
 ORDER BY created_at DESC, checkpoint_id DESC LIMIT 1;

-- name: list_checkpoints
-- A session's newest checkpoints, at most `limit`, without their payloads (id, turn, time):
-- what a listing shows.
SELECT checkpoint_id, turn, created_at FROM checkpoints
 WHERE session_id = %(session_id)s
 ORDER BY created_at DESC, checkpoint_id DESC LIMIT %(limit)s;

-- name: take_slot
-- One free slot of a concurrency limit for a run, on its lock connection: the
-- keys are tried in order and the scan stops at the first lock it gets (no
-- ORDER BY, which would try them all), so the run holds at most one.
SELECT k FROM unnest(%(keys)s::bigint[]) AS k WHERE pg_try_advisory_lock(k) LIMIT 1;

-- name: unlock_slots
-- A run's concurrency limit slots released with its scope, on the same connection.
SELECT pg_advisory_unlock(k) FROM unnest(%(keys)s::bigint[]) AS k;

-- name: direct_run_opened
-- An outermost run opened without a worker's lease (a web process's own
-- agent.run): recorded for `requests --direct` and the console.
INSERT INTO direct_runs (run_id, scope, session_id, user_id, epoch, process, pid)
VALUES (%(run_id)s, %(scope)s, %(session_id)s, %(user_id)s, %(epoch)s, %(process)s, %(pid)s)
ON CONFLICT (run_id) DO NOTHING;

-- name: direct_run_ended
-- That run ended: cleanly, or raising (its error's first line).
UPDATE direct_runs SET finished_at = clock_timestamp(), outcome = %(outcome)s, error = %(error)s
 WHERE run_id = %(run_id)s;

-- name: no_jit
-- What the worker's pool and the sweeper's connection say first: no JIT compilation.
-- Their statements run in milliseconds, thousands of times; with a backlog the estimated
-- cost of one that reads every unfinished request (the sweeper's orphans) passes
-- jit_above_cost, and Postgres spent seconds of CPU compiling it at each sweep.
SET jit = off;
