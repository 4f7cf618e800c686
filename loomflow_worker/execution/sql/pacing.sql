-- The fleet's model-call budgets (execution.pacing), one row per model key in
-- model_budgets. Each statement is one round trip on a pooled connection.

-- name: set_model_limits
-- A key's limits in requests and tokens per minute (NULL: none) and its
-- burst, as a worker's settings give them at its start or `loomflow-worker
-- limits` sets them; its schedule and pause are kept.
INSERT INTO model_budgets (key, rpm, tpm, burst)
VALUES (%(key)s, %(rpm)s, %(tpm)s, %(burst)s)
ON CONFLICT (key) DO UPDATE
   SET rpm = EXCLUDED.rpm, tpm = EXCLUDED.tpm, burst = EXCLUDED.burst, updated_at = now();

-- name: model_budgets
-- Every key's limits, and for how many more seconds the provider asked it to
-- pause: a process books the calls of these keys only (read every few
-- seconds), and `loomflow-worker limits` lists them.
SELECT key, rpm, tpm, burst,
       extract(epoch FROM greatest(paused_until, now()) - now())::float8 AS paused_for,
       updated_at
  FROM model_budgets ORDER BY key;

-- name: take_model_call
-- One model call's place in its key's schedule, booked for the whole fleet:
-- its slot (loomflow_worker_model_slot, read under the row's lock, so
-- concurrent bookings queue) and each schedule moved on by the call's share
-- of the minute (60/rpm seconds; tokens*60/tpm seconds). Returns how many
-- seconds the call waits for its slot.
WITH b AS (
    SELECT key, loomflow_worker_model_slot(model_budgets, %(tokens)s) AS slot
      FROM model_budgets WHERE key = %(key)s FOR UPDATE
)
UPDATE model_budgets m
   SET next_request = CASE WHEN m.rpm IS NULL THEN m.next_request
           ELSE greatest(m.next_request, b.slot) + make_interval(secs => 60.0 / m.rpm) END,
       next_token = CASE WHEN m.tpm IS NULL THEN m.next_token
           ELSE greatest(m.next_token, b.slot)
                + make_interval(secs => 60.0 * %(tokens)s / m.tpm) END
  FROM b WHERE m.key = b.key
RETURNING greatest(extract(epoch FROM b.slot - now()), 0)::float8 AS wait;

-- name: charge_model_tokens
-- A call's tokens beyond (or short of, when negative) what its booking
-- estimated, charged to its key's token schedule once the provider said.
UPDATE model_budgets SET next_token = next_token + make_interval(secs => 60.0 * %(tokens)s / tpm)
 WHERE key = %(key)s AND tpm IS NOT NULL;

-- name: pause_model_key
-- The provider answered a call of the key with a rate limit (429) or as
-- overloaded (529): every worker holds the key's calls until then.
INSERT INTO model_budgets (key, paused_until)
VALUES (%(key)s, now() + make_interval(secs => %(seconds)s))
ON CONFLICT (key) DO UPDATE
   SET paused_until = greatest(model_budgets.paused_until, EXCLUDED.paused_until);

-- name: set_concurrency_limit
-- A concurrency limit's size as `loomflow-worker limits concurrency` sets it:
-- it holds over any process's settings until the command changes it.
INSERT INTO concurrency_limits (name, max_runs, source, set_by)
VALUES (%(name)s, %(max_runs)s, 'command', %(by)s)
ON CONFLICT (name) DO UPDATE
   SET max_runs = EXCLUDED.max_runs, source = 'command', set_by = EXCLUDED.set_by,
       updated_at = now();

-- name: declare_concurrency_limit
-- A concurrency limit's size as a process's settings declare it: written
-- unless the command set the limit (then kept), changed when other settings
-- set it to another size. Returns the limit as it was (no row: it was not
-- set), who set it, and whether this wrote it.
WITH was AS (
    SELECT max_runs, set_by FROM concurrency_limits WHERE name = %(name)s
), wrote AS (
    INSERT INTO concurrency_limits (name, max_runs, source, set_by)
    VALUES (%(name)s, %(max_runs)s, 'settings', %(by)s)
    ON CONFLICT (name) DO UPDATE
       SET max_runs = EXCLUDED.max_runs, set_by = EXCLUDED.set_by, updated_at = now()
     WHERE concurrency_limits.source = 'settings'
       AND concurrency_limits.max_runs <> EXCLUDED.max_runs
    RETURNING 1
)
SELECT w.max_runs, w.set_by, EXISTS (SELECT FROM wrote)
  FROM (SELECT 1) one LEFT JOIN was w ON true;

-- name: drop_concurrency_limit
-- A concurrency limit removed: its runs take no slot from now on. No row back:
-- there was no such limit.
DELETE FROM concurrency_limits WHERE name = %(name)s RETURNING name;

-- name: concurrency_limits
-- Every concurrency limit, with how many requests wait parked on each of its
-- instances (per_key has one per fairness key).
SELECT c.name, c.max_runs, c.updated_at, c.source, c.set_by,
       (SELECT count(*) FROM runs r
         WHERE r.waiting_slots IS NOT NULL AND r.status = 'queued'
           AND (r.waiting_for = 'limit ' || c.name
                OR starts_with(r.waiting_for, 'limit ' || c.name || ':'))) AS waiting
  FROM concurrency_limits c ORDER BY c.name;

-- name: hold_limits
-- The sizes of the limits an enqueue withholds requests on: per_key when set (a
-- fairness key with that many out), and how many may wait in the broker before the
-- rest wait their fair turn (loomflow_worker_fair_depth: the fleet's free slots
-- unless fair_queue sets it; NULL: fair shares off; see insert_run).
SELECT (SELECT max_runs FROM concurrency_limits WHERE name = 'per_key'),
       loomflow_worker_fair_depth();

-- name: fair_depth
-- How many requests may wait in the broker now before the rest wait their fair turn
-- (NULL: fair shares off).
SELECT loomflow_worker_fair_depth();

-- name: set_fairness_weight
-- A fairness key's weight as `loomflow-worker limits weight` sets it (NULL:
-- removed; the weight its requests state, else 1, applies): it holds over any
-- process's settings until the command changes it.
INSERT INTO fairness_keys (fairness_key, weight, weight_source, weight_set_by)
VALUES (%(fairness_key)s, %(weight)s, 'command', %(by)s)
ON CONFLICT (fairness_key) DO UPDATE
   SET weight = EXCLUDED.weight, weight_source = 'command',
       weight_set_by = EXCLUDED.weight_set_by, updated_at = now();

-- name: declare_fairness_weight
-- A fairness key's weight as a process's settings (FAIRNESS_WEIGHTS) declare
-- it, under the rule of declare_concurrency_limit.
WITH was AS (
    SELECT weight, weight_set_by FROM fairness_keys
     WHERE fairness_key = %(fairness_key)s
), wrote AS (
    INSERT INTO fairness_keys (fairness_key, weight, weight_source, weight_set_by)
    VALUES (%(fairness_key)s, %(weight)s, 'settings', %(by)s)
    ON CONFLICT (fairness_key) DO UPDATE
       SET weight = EXCLUDED.weight, weight_source = 'settings',
           weight_set_by = EXCLUDED.weight_set_by, updated_at = now()
     WHERE fairness_keys.weight_source IS DISTINCT FROM 'command'
       AND fairness_keys.weight IS DISTINCT FROM EXCLUDED.weight
    RETURNING 1
)
SELECT w.weight, w.weight_set_by, EXISTS (SELECT FROM wrote)
  FROM (SELECT 1) one LEFT JOIN was w ON true;

-- name: fairness_key_weights
-- Every fairness key with a weight set or stated, or with requests withheld for their
-- fair turn, and how many are withheld.
SELECT k.fairness_key, f.weight, f.call_weight, coalesce(h.waiting, 0),
       f.weight_source, f.weight_set_by
  FROM (SELECT fairness_key FROM fairness_keys
         WHERE weight IS NOT NULL OR call_weight IS NOT NULL
        UNION
        SELECT DISTINCT fairness_key FROM runs
         WHERE waiting_for = 'limit fair_queue' AND status = 'queued') k
  LEFT JOIN fairness_keys f USING (fairness_key)
  LEFT JOIN (SELECT fairness_key, count(*) AS waiting FROM runs
              WHERE waiting_for = 'limit fair_queue' AND status = 'queued'
              GROUP BY fairness_key) h USING (fairness_key)
 ORDER BY k.fairness_key;
