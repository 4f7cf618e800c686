-- Model-call budgets shared by the fleet, one row per model key (a provider
-- key, or a model's name): its limits in requests and tokens per minute
-- (NULL: none), and the state of its schedule. `next_request` and
-- `next_token` are when the key's next model call may start as far as each
-- limit goes (each call moves them on by its share of the minute), and
-- `paused_until` how long the provider asked the fleet to wait (a 429 or
-- 529 with retry-after). Workers write the limits their settings give at
-- start; `loomflow-worker limits` changes them at run time.
CREATE TABLE IF NOT EXISTS model_budgets (
    key TEXT PRIMARY KEY CHECK (octet_length(key) BETWEEN 1 AND 64),
    rpm INTEGER CHECK (rpm > 0),
    tpm INTEGER CHECK (tpm > 0),
    next_request TIMESTAMPTZ NOT NULL DEFAULT '-infinity',
    next_token TIMESTAMPTZ NOT NULL DEFAULT '-infinity',
    paused_until TIMESTAMPTZ NOT NULL DEFAULT '-infinity',
    updated_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
