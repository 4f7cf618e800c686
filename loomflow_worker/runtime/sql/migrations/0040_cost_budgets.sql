-- Cost budgets (execution.budgets): a fairness key's (tenant's) or an agent's
-- tokens or US dollars per period, for the whole fleet. One row per budget,
-- named as `loomflow-worker limits budget` names it: the fairness key, or
-- agent:NAME. spent counts the period that starts at period_start; a row whose
-- period_start is before the current period's start has spent nothing in it
-- (loomflow_worker_budget_spent), so a period rolls over by the clock alone,
-- with no job to reset it. Periods are UTC calendar days and months.
-- when_over: what an enqueue does while the budget is spent, 'wait' (the
-- request is accepted and waits in the ledger) or 'refuse' (the enqueue
-- raises). source and set_by as for concurrency limits (0036).
CREATE TABLE IF NOT EXISTS cost_budgets (
    name TEXT PRIMARY KEY,
    amount NUMERIC(30, 10) NOT NULL CHECK (amount > 0),
    unit TEXT NOT NULL CHECK (unit IN ('tokens', 'usd')),
    period TEXT NOT NULL CHECK (period IN ('day', 'month')),
    when_over TEXT NOT NULL DEFAULT 'wait' CHECK (when_over IN ('wait', 'refuse')),
    period_start TIMESTAMPTZ NOT NULL DEFAULT '-infinity',
    spent NUMERIC(30, 10) NOT NULL DEFAULT 0,
    source TEXT NOT NULL DEFAULT 'settings',
    set_by TEXT,
    updated_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- The budget a request waits for (parked at its attempt's start, its message
-- acked): published again once that budget has room (its period rolled over,
-- it was raised or removed), by the sweeper's leader or the command.
ALTER TABLE runs ADD COLUMN IF NOT EXISTS waiting_budget TEXT;
CREATE INDEX IF NOT EXISTS runs_waiting_budget ON runs (waiting_budget, priority_rank, enqueued_at)
    WHERE waiting_budget IS NOT NULL;

-- The start of the UTC calendar period (day or month) that `at` falls in.
CREATE OR REPLACE FUNCTION loomflow_worker_period_start(period TEXT, at TIMESTAMPTZ)
RETURNS TIMESTAMPTZ LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT date_trunc(period, at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
$$;

-- What a budget has spent in the period that `at` falls in.
CREATE OR REPLACE FUNCTION loomflow_worker_budget_spent(b cost_budgets, at TIMESTAMPTZ)
RETURNS NUMERIC LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN b.period_start >= loomflow_worker_period_start(b.period, at)
                THEN b.spent ELSE 0 END
$$;

-- A budget in words, as a parked request waits for it and a refused enqueue
-- says it: "tenant acme's daily budget of 1,000,000 tokens (spent 1,000,412);
-- resets 2026-12-08 00:00 UTC or when raised".
CREATE OR REPLACE FUNCTION loomflow_worker_budget_said(b cost_budgets, at TIMESTAMPTZ)
RETURNS TEXT LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT format('%s''s %s budget of %s (spent %s); resets %s UTC or when raised',
                  CASE WHEN starts_with(b.name, 'agent:') THEN 'agent ' || substr(b.name, 7)
                       ELSE 'tenant ' || b.name END,
                  CASE b.period WHEN 'day' THEN 'daily' ELSE 'monthly' END,
                  CASE b.unit WHEN 'tokens'
                       THEN to_char(b.amount, 'FM999,999,999,999,999,990') || ' tokens'
                       ELSE '$' || to_char(b.amount, 'FM999,999,999,990.009999') END,
                  CASE b.unit WHEN 'tokens'
                       THEN to_char(loomflow_worker_budget_spent(b, at),
                                    'FM999,999,999,999,999,990')
                       ELSE '$' || to_char(loomflow_worker_budget_spent(b, at),
                                           'FM999,999,999,990.009999') END,
                  to_char((loomflow_worker_period_start(b.period, at)
                           + ('1 ' || b.period)::interval) AT TIME ZONE 'UTC',
                          'YYYY-MM-DD HH24:MI'))
$$;
