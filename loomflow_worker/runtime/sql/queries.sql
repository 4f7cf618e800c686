-- Every query the runtime runs, under "-- name: <name>" headers.
-- Parameters are psycopg placeholders; nothing is assembled from input.

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

-- name: wait_lock
SELECT pg_advisory_lock(%(key)s);

-- name: unlock
SELECT pg_advisory_unlock(%(key)s);

-- name: unlock_all
SELECT pg_advisory_unlock_all();

-- name: held_advisory_locks
SELECT count(*) FROM pg_locks
 WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted;

-- name: read_epochs
SELECT step_name, value FROM journal_steps
 WHERE session_id = %(scope)s
   AND step_name IN ('__run_epoch__', '__last_run_epoch__');

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
VALUES (%(scope)s, %(key)s, %(value)s, %(created_at)s)
ON CONFLICT (session_id, step_name) DO UPDATE
   SET value = EXCLUDED.value, created_at = EXCLUDED.created_at;

-- name: get_stream
SELECT chunks FROM journal_streams
 WHERE session_id = %(scope)s AND step_name = %(key)s;

-- name: put_stream
INSERT INTO journal_streams (session_id, step_name, chunks, created_at)
VALUES (%(scope)s, %(key)s, %(value)s, %(created_at)s)
ON CONFLICT (session_id, step_name) DO UPDATE
   SET chunks = EXCLUDED.chunks, created_at = EXCLUDED.created_at;

-- name: lock_epoch
SELECT value FROM journal_steps
 WHERE session_id = %(scope)s AND step_name = '__run_epoch__'
   FOR UPDATE;

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
SELECT payload::text FROM checkpoints
 WHERE session_id = %(session_id)s AND checkpoint_id = %(checkpoint_id)s;

-- name: latest_checkpoint
SELECT payload::text FROM checkpoints WHERE session_id = %(session_id)s
 ORDER BY created_at DESC, checkpoint_id DESC LIMIT 1;

-- name: list_checkpoints
SELECT checkpoint_id, turn, created_at FROM checkpoints
 WHERE session_id = %(session_id)s
 ORDER BY created_at DESC, checkpoint_id DESC LIMIT %(limit)s;

-- name: send_signal
WITH sent AS (
    INSERT INTO signals (session_id, name, payload)
    VALUES (%(session_id)s, %(name)s, %(payload)s)
    RETURNING id
)
SELECT pg_notify('loomflow_worker_signals', md5(%(session_id)s)), (SELECT id FROM sent);

-- name: take_signal
DELETE FROM signals
 WHERE id = (SELECT id FROM signals
              WHERE session_id = %(session_id)s AND name = %(name)s
              ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING payload;

-- name: take_signal_into_journal
WITH taken AS (
    DELETE FROM signals
     WHERE id = (SELECT id FROM signals
                  WHERE session_id = %(session_id)s AND name = %(name)s
                  ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)
    RETURNING payload
), journaled AS (
    INSERT INTO journal_steps (session_id, step_name, value, created_at)
    SELECT %(scope)s, %(key)s, payload, %(created_at)s FROM taken
    ON CONFLICT (session_id, step_name) DO NOTHING
)
SELECT payload FROM taken;

-- name: prune_steps
DELETE FROM journal_steps WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM journal_steps
     WHERE (%(before)s::float8 IS NULL OR created_at < %(before)s::float8)
       AND (%(session_id)s::text IS NULL OR session_id = %(session_id)s::text)
       AND (%(session_id)s::text IS NOT NULL
            OR step_name NOT IN ('__run_epoch__', '__last_run_epoch__'))
     LIMIT %(batch)s FOR UPDATE SKIP LOCKED));

-- name: prune_streams
DELETE FROM journal_streams WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM journal_streams
     WHERE (%(before)s::float8 IS NULL OR created_at < %(before)s::float8)
       AND (%(session_id)s::text IS NULL OR session_id = %(session_id)s::text)
     LIMIT %(batch)s FOR UPDATE SKIP LOCKED));

-- name: prune_checkpoints
DELETE FROM checkpoints WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM checkpoints
     WHERE (%(before)s::float8 IS NULL OR created_at < %(before)s::float8)
       AND (%(session_id)s::text IS NULL OR session_id = %(session_id)s::text)
     LIMIT %(batch)s FOR UPDATE SKIP LOCKED));
