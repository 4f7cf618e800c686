"""A worker that loses its database connections and lives is not a crash."""

from __future__ import annotations

from functools import partial

import psycopg
import pytest

from loomflow_worker.tasks import run_agent
from tests.integration.celery_harness import Fleet, ledger, wait_status
from tests.integration.helpers import calls, wait_until

pytestmark = pytest.mark.slow


def _end_lock_connections(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = 'loomflow-worker lock'"
        ).fetchall()
    return len(rows)


def _in_a_tool(dsn: str, request_id: str, attempt: int) -> bool:
    """Whether attempt ``attempt`` of ``request_id`` has started a tool call."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT EXISTS (SELECT FROM run_attempts a, loomflow_worker_effects e"
            " WHERE a.request_id = %s AND a.attempt = %s AND e.started_at > a.started_at)",
            (request_id, attempt),
        ).fetchone()
    return bool(row and row[0])


def _outcomes(dsn: str, request_id: str) -> list[str | None]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT outcome FROM run_attempts WHERE request_id = %s ORDER BY attempt",
            (request_id,),
        ).fetchall()
    return [r[0] for r in rows]


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_lost_lock_connections_do_not_count_as_crashes(fleet: Fleet, pool: str) -> None:
    # MAX_CRASHES=1: a single counted crash would end the request dead.
    fleet.start("w1", concurrency=2, pool=pool, TEST_TOOL_SLEEP="0.8",
                LOOMFLOW_WORKER_MAX_CRASHES="1", LOOMFLOW_WORKER_HEARTBEAT_INTERVAL="0.5")
    result = run_agent.delay(calls(*(f"x{i}" for i in range(6))), "s")
    for cut in range(3):
        wait_status(fleet.dsn, result.id, ("running",), timeout=30)
        wait_until(partial(_in_a_tool, fleet.dsn, result.id, cut + 1),
                   f"attempt {cut + 1} never started a tool call")
        assert _end_lock_connections(fleet.dsn) >= 1
    assert result.get(timeout=60)["output"].startswith("done: recorded x0")
    row = ledger(fleet.dsn, result.id)
    assert row["status"] == "succeeded" and row["crashes"] == 0
    outcomes = _outcomes(fleet.dsn, result.id)
    assert outcomes.count("lost") >= 2, outcomes
