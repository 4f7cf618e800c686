-- Model-call budgets shared by the fleet, one row per model key (a provider
-- key, or a model's name): its limits in requests and tokens per minute
-- (NULL: none), how many seconds' worth of them may go at once after a quiet
-- spell (`burst`: a minute, as providers meter), and the state of its
-- schedule. `next_request` and `next_token` are the schedule's ends: each
-- call moves them on by its share of the minute, and a call may start once
-- they are at most `burst` seconds ahead (a token bucket, as a GCRA); and
-- `paused_until` how long the provider asked the fleet to wait (a 429 or 529
-- with retry-after). Workers write the limits their settings give at start;
-- `loomflow-worker limits` changes them at run time.
CREATE TABLE IF NOT EXISTS model_budgets (
    key TEXT PRIMARY KEY CHECK (octet_length(key) BETWEEN 1 AND 64),
    rpm INTEGER CHECK (rpm > 0),
    tpm INTEGER CHECK (tpm > 0),
    burst DOUBLE PRECISION NOT NULL DEFAULT 60 CHECK (burst >= 0),
    next_request TIMESTAMPTZ NOT NULL DEFAULT '-infinity',
    next_token TIMESTAMPTZ NOT NULL DEFAULT '-infinity',
    paused_until TIMESTAMPTZ NOT NULL DEFAULT '-infinity',
    updated_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- When a call of `tokens` tokens may start under the budget `b`: now, or once
-- the provider's pause is over and each schedule is at most `burst` seconds
-- (less the call's own share) ahead.
CREATE OR REPLACE FUNCTION loomflow_worker_model_slot(b model_budgets, tokens DOUBLE PRECISION)
RETURNS TIMESTAMPTZ LANGUAGE sql STABLE AS $$
    SELECT greatest(now(), b.paused_until,
        CASE WHEN b.rpm IS NOT NULL
             THEN b.next_request - make_interval(secs => greatest(b.burst - 60.0 / b.rpm, 0)) END,
        CASE WHEN b.tpm IS NOT NULL
             THEN b.next_token
                  - make_interval(secs => greatest(b.burst - 60.0 * tokens / b.tpm, 0)) END)
$$;
