-- Cost budgets (execution.budgets), one row per budget in cost_budgets (0040). A
-- budget's spend is added by record_usage (ledger.sql), in the statement that
-- already records an attempt's usage: no statement per model call.

-- name: set_cost_budget
-- A budget as `loomflow-worker limits budget` sets it: it holds over any
-- process's settings until the command changes it. What it spent this period
-- is kept in its unit; a budget set in another unit (tokens, dollars) starts
-- this period from 0, as a spend in tokens says nothing of one in dollars.
-- Returns the budget as it was (NULLs: it was not set), what it had spent in
-- its period, and what it has spent in its new period and when that ends.
WITH was AS (
    SELECT b.amount, b.unit, b.period, b.when_over, loomflow_worker_budget_spent(b, now()) AS spent
      FROM cost_budgets b WHERE b.name = %(name)s
), set AS (
    INSERT INTO cost_budgets (name, amount, unit, period, when_over, source, set_by)
    VALUES (%(name)s, %(amount)s, %(unit)s, %(period)s, %(when_over)s, 'command', %(by)s)
    ON CONFLICT (name) DO UPDATE
       SET amount = EXCLUDED.amount, unit = EXCLUDED.unit, period = EXCLUDED.period,
           when_over = EXCLUDED.when_over, source = 'command', set_by = EXCLUDED.set_by,
           spent = CASE WHEN cost_budgets.unit = EXCLUDED.unit THEN cost_budgets.spent ELSE 0 END,
           updated_at = now()
    RETURNING loomflow_worker_budget_spent(cost_budgets, now()) AS spent,
              loomflow_worker_period_start(period, now()) + ('1 ' || period)::interval
              AS resets_at
)
SELECT w.amount AS was_amount, w.unit AS was_unit, w.period AS was_period,
       w.when_over AS was_over, w.spent AS was_spent, s.spent, s.resets_at
  FROM set s LEFT JOIN was w ON true;

-- name: declare_cost_budget
-- A budget as a process's settings declare it (BUDGETS), as for a concurrency
-- limit (declare_concurrency_limit): written unless the command set it, changed
-- when other settings set it otherwise. Returns its amount as it was (no row:
-- it was not set), who set it, whether this wrote it, and its unit and period
-- as they were.
WITH was AS (
    SELECT amount, set_by, unit, period FROM cost_budgets WHERE name = %(name)s
), wrote AS (
    INSERT INTO cost_budgets (name, amount, unit, period, when_over, source, set_by)
    VALUES (%(name)s, %(amount)s, %(unit)s, %(period)s, %(when_over)s, 'settings', %(by)s)
    ON CONFLICT (name) DO UPDATE
       SET amount = EXCLUDED.amount, unit = EXCLUDED.unit, period = EXCLUDED.period,
           when_over = EXCLUDED.when_over, set_by = EXCLUDED.set_by,
           spent = CASE WHEN cost_budgets.unit = EXCLUDED.unit THEN cost_budgets.spent
                        ELSE 0 END,
           updated_at = now()
     WHERE cost_budgets.source = 'settings'
       AND (cost_budgets.amount, cost_budgets.unit, cost_budgets.period, cost_budgets.when_over)
           IS DISTINCT FROM (EXCLUDED.amount, EXCLUDED.unit, EXCLUDED.period, EXCLUDED.when_over)
    RETURNING 1
)
SELECT w.amount, w.set_by, EXISTS (SELECT FROM wrote), w.unit, w.period
  FROM (SELECT 1) one LEFT JOIN was w ON true;

-- name: drop_cost_budget
-- A budget removed: its key's or agent's requests run unbounded from now on
-- (those waiting for it are published by the caller). No row back: there was none.
DELETE FROM cost_budgets WHERE name = %(name)s RETURNING name;

-- name: cost_budgets
-- Every budget, with what it spent in the current period, when that period
-- ends, and how many requests wait for it (runs_waiting_budget): `limits` and
-- the console's fleet page.
SELECT b.name, b.amount, b.unit, b.period, b.when_over AS over,
       loomflow_worker_budget_spent(b, now()) AS spent,
       loomflow_worker_period_start(b.period, now()) + ('1 ' || b.period)::interval AS resets_at,
       b.updated_at, b.source, b.set_by,
       (SELECT count(*) FROM runs r
         WHERE r.waiting_budget = b.name AND NOT loomflow_worker_finished(r.status)) AS waiting
  FROM cost_budgets b ORDER BY b.name;

-- name: budget_names
-- The names of the budgets and what an enqueue does when one is spent: a
-- process reads them every few seconds, and looks at a request's budgets only
-- when it has some.
SELECT name, when_over FROM cost_budgets;

-- name: park_on_budget
-- At an attempt's start: when one of the budgets `names` (the request's
-- fairness key's and its agent's) is spent for the current period, the request
-- parks on it, as park_on_limit parks it on a full limit, saying why
-- (waiting_for) and on which budget (waiting_budget): the sweeper's leader or
-- the command publishes it again once the budget has room. Returns the budget
-- and its words; no row: none is spent (or the request has finished), it runs.
WITH spent AS (
    SELECT b.name, loomflow_worker_budget_said(b, now()) AS said
      FROM cost_budgets b
     WHERE b.name = ANY(%(names)s::text[])
       AND loomflow_worker_budget_spent(b, now()) >= b.amount
     ORDER BY b.name LIMIT 1
)
UPDATE runs r SET received_at = now(), waiting_budget = s.name, waiting_for = 'for ' || s.said,
       options = CASE WHEN r.status = 'queued' THEN coalesce(%(options)s::jsonb, r.options)
                      ELSE r.options END
  FROM spent s
 WHERE r.request_id = %(request_id)s AND loomflow_worker_unfinished(r.status)
RETURNING s.name, s.said;

-- name: budget_refusal
-- At an enqueue: the first of the budgets `names` (the request's fairness
-- key's and its agent's) that refuses requests while spent and is spent, in
-- words; no row: none, the request is accepted.
SELECT b.name, loomflow_worker_budget_said(b, now()) AS said
  FROM cost_budgets b
 WHERE b.name = ANY(%(names)s::text[]) AND b.when_over = 'refuse'
   AND loomflow_worker_budget_spent(b, now()) >= b.amount
 ORDER BY b.name LIMIT 1;

-- name: wake_budget_waiters
-- The requests parked on a budget that has room now (its period rolled over,
-- it was raised, or removed), at most `limit`, by priority then age, among
-- the budgets `names` (NULL: every budget): stamped dispatched and waiting no
-- more, for the caller to publish. Those another caller took are skipped.
WITH next AS (
    SELECT r.request_id FROM runs r
     WHERE r.waiting_budget IS NOT NULL AND NOT loomflow_worker_finished(r.status)
       AND (%(names)s::text[] IS NULL OR r.waiting_budget = ANY(%(names)s::text[]))
       AND NOT EXISTS (SELECT 1 FROM cost_budgets b
                        WHERE b.name = r.waiting_budget
                          AND loomflow_worker_budget_spent(b, now()) >= b.amount)
     ORDER BY r.priority_rank, r.enqueued_at LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
)
UPDATE runs r SET dispatched_at = now(), waiting_budget = NULL, waiting_for = NULL
  FROM next WHERE r.request_id = next.request_id
RETURNING r.request_id, r.kind, r.session_id, r.user_id, r.agent, r.prompt, r.metadata,
          r.not_before, CASE WHEN r.status = 'queued' THEN r.options END AS options,
          r.routing;
