"""The queries that ask ``loomflow_worker_unfinished(status)`` still use the
partial index of unfinished requests (``runs_scope_open``, whose predicate is
the literal list): the planner inlines the function. On a ledger of many
finished requests, a plan without the index would scan them all."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from loomflow_worker.runtime.sql import query

PARAMS: dict[str, Any] = {
    "scope": "scope-7", "request_id": "r-7", "stale": 5, "key": 1, "may_lock": False,
    "holder": "h", "pid": 1, "attempt": 1, "new_epoch": 2, "epoch_value": b"LJ12",
    "status": "succeeded", "result": None, "error": None, "error_type": None,
    "before": 0.0, "cutoff": None, "batch": 1000,
}

HOT = ["scope_busy", "hand_off", "precheck_run", "start_request", "finish_request",
       "prune_steps", "prune_counts"]


@pytest.fixture
def big_ledger(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO journal_steps (session_id, step_name, value, created_at)"
            " SELECT 'scope-' || i, 'k', 'LJ11'::bytea, 0 FROM generate_series(1, 2000) AS i"
        )
        conn.execute(
            "INSERT INTO runs (request_id, scope, session_id, agent, prompt, status,"
            " finished_at)"
            " SELECT 'r-' || i, 'scope-' || (i % 2000), 'scope-' || (i % 2000), 'a', 'p',"
            " CASE WHEN i % 500 = 0 THEN 'queued' ELSE 'succeeded' END,"
            " CASE WHEN i % 500 = 0 THEN NULL ELSE now() END"
            " FROM generate_series(1, 40000) AS i"
        )
        conn.execute("ANALYZE runs")
        conn.execute("ANALYZE journal_steps")
    return dsn


@pytest.mark.parametrize("name", HOT)
def test_a_hot_query_finds_unfinished_requests_through_the_partial_index(
    big_ledger: str, name: str
) -> None:
    with psycopg.connect(big_ledger, autocommit=True) as conn:
        plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + query(name), PARAMS))
    assert "runs_scope_open" in plan, plan
