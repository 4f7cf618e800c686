-- Signals (runtime.signals; admin.operator_signals sends them too): values sent to a session's runs,
-- a row each in signals until a waiting run takes it. Waiters listen on the
-- loomflow_worker_signals channel, woken by the md5 of their session's id (a payload of
-- fixed size, whatever the id). Every take reads signals_mailbox (session_id, name, id) in
-- id order.

-- name: listen_signals
-- The signal listener's connection subscribes to the channel send_signal notifies (a
-- channel is an identifier: it cannot be a parameter).
LISTEN loomflow_worker_signals;

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
-- A signal taken as take_signal takes it, and its payload journaled under the run's key, in
-- one statement on the run's lock connection: the signal is consumed exactly when it is
-- recorded (an entry already journaled under the key stays).
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
