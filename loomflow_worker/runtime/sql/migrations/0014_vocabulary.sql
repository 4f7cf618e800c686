-- A request's statuses, named once: every query asks these functions rather
-- than spelling the lists out. The planner inlines them (one SQL expression,
-- IMMUTABLE, and not STRICT, which would stop it), so a query that calls one
-- still matches the partial index runs_scope_open, whose predicate keeps the
-- literal list it was created with (tests/integration/test_sql_plans.py).
CREATE OR REPLACE FUNCTION loomflow_worker_unfinished(status TEXT) RETURNS BOOLEAN
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT status IN ('queued', 'running')
$$;

CREATE OR REPLACE FUNCTION loomflow_worker_finished(status TEXT) RETURNS BOOLEAN
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT status IN ('succeeded', 'failed', 'cancelled', 'dead', 'expired')
$$;
