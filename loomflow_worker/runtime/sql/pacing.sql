-- The fleet's model-call budgets (execution.pacing), one row per model key in
-- model_budgets. Each statement is one round trip on a pooled connection.

-- name: set_model_limits
-- A key's limits in requests and tokens per minute (NULL: none), as a
-- worker's settings give them at its start or `loomflow-worker limits` sets
-- them; its schedule and pause are kept.
INSERT INTO model_budgets (key, rpm, tpm) VALUES (%(key)s, %(rpm)s, %(tpm)s)
ON CONFLICT (key) DO UPDATE SET rpm = EXCLUDED.rpm, tpm = EXCLUDED.tpm, updated_at = now();

-- name: model_budgets
-- Every key's limits, and for how many more seconds the provider asked it to
-- pause: a process reserves the calls of these keys only (read every few
-- seconds), and `loomflow-worker limits` lists them.
SELECT key, rpm, tpm,
       extract(epoch FROM greatest(paused_until, now()) - now())::float8 AS paused_for,
       updated_at
  FROM model_budgets ORDER BY key;

-- name: take_model_call
-- One model call's place in its key's schedule, booked for the whole fleet:
-- it starts once the calls booked before it have had their share of the
-- minute (60/rpm seconds each; tokens*60/tpm seconds of the token budget)
-- and the provider's pause is over. Every SET reads the row as it was, so
-- the slot is the later of the two schedules, the pause and now; the row
-- lock makes concurrent bookings queue. Returns how long the call waits.
UPDATE model_budgets
   SET next_request = CASE WHEN rpm IS NULL THEN next_request
           ELSE greatest(next_request, next_token, paused_until, now())
                + make_interval(secs => 60.0 / rpm) END,
       next_token = CASE WHEN tpm IS NULL THEN next_token
           ELSE greatest(next_request, next_token, paused_until, now())
                + make_interval(secs => 60.0 * %(tokens)s / tpm) END
 WHERE key = %(key)s
RETURNING greatest(extract(epoch FROM
           CASE WHEN rpm IS NOT NULL THEN next_request - make_interval(secs => 60.0 / rpm)
                WHEN tpm IS NOT NULL THEN next_token - make_interval(secs => 60.0 * %(tokens)s / tpm)
                ELSE greatest(paused_until, now()) END - now()), 0)::float8 AS wait;

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
