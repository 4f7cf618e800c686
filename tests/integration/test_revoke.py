"""Celery's revoke, expires and time_limit end a request in the ledger; its session moves on."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from celery.exceptions import TaskRevokedError
from celery.result import AsyncResult

from loomflow_worker.tasks import app, run_agent

from .celery_harness import (
    QUICK_RESULT_CHECK,
    Fleet,
    ledger,
    wait_status,
    wait_sweeps_for,
    wait_swept,
)
from .helpers import calls, tool_counts, wait_for_execution, wait_until

pytestmark = pytest.mark.slow


def _attempts(fleet: Fleet, request_id: str) -> int:
    return int(ledger(fleet.dsn, request_id)["attempts"])  # type: ignore[call-overload]


def _received(fleet: Fleet, request_id: str) -> bool:
    """Whether a worker took the request's message (and parked it)."""
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT received_at IS NOT NULL FROM runs WHERE request_id = %s",
                           (request_id,)).fetchone()
    return row is not None and bool(row[0])


def test_revoking_a_waiting_request_cancels_it_and_its_session_moves_on(fleet: Fleet) -> None:
    fleet.start("w1", concurrency=4, pool="threads", TEST_TOOL_SLEEP="1.5")
    first = run_agent.delay(calls("a1", "a2"), "s")
    wait_status(fleet.dsn, first.id, ("running",), timeout=30)
    waiting = run_agent.delay(calls("b1"), "s")
    # Parked behind the first (its message received and acked): a revoke sent
    # before the worker received it would be Celery's own discard.
    wait_until(lambda: _received(fleet, waiting.id),
               "the second request never parked behind the first")
    app.control.revoke(waiting.id)
    after = run_agent.delay(calls("c1"), "s")
    assert wait_status(fleet.dsn, waiting.id, ("cancelled",), timeout=15) == "cancelled"
    row = ledger(fleet.dsn, waiting.id)
    assert row["error_type"] == "Revoked" and row["attempts"] == 0
    assert first.get(timeout=30)["output"] == "done: recorded a1, recorded a2"
    assert after.get(timeout=30)["output"] == "done: recorded c1"
    log = (fleet.logs / "w1.log").read_text(errors="replace")
    assert "Discarding revoked task" not in log  # never sent again under its id


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_revoke_with_terminate_stops_a_running_request_as_cancelled(
    fleet: Fleet, pool: str
) -> None:
    fleet.start("w1", concurrency=2, pool=pool, TEST_TOOL_SLEEP="1.0")
    running = run_agent.delay(calls("t1", "t2", "t3", "t4"), "s")
    wait_for_execution(fleet.dsn, "t1")  # mid-tool
    revoked_at = time.monotonic()
    app.control.revoke(running.id, terminate=True)
    assert wait_status(fleet.dsn, running.id, ("cancelled",), timeout=10) == "cancelled"
    assert time.monotonic() - revoked_at < 5
    row = ledger(fleet.dsn, running.id)
    assert row["error_type"] == "Revoked" and row["attempts"] == 1 and row["crashes"] == 0
    nxt = run_agent.delay(calls("n1"), "s")
    assert nxt.get(timeout=30)["output"] == "done: recorded n1"
    wait_sweeps_for(fleet)  # the sweeper looked after the session moved on: never resumed
    assert ledger(fleet.dsn, running.id)["status"] == "cancelled"
    assert _attempts(fleet, running.id) == 1


def test_an_expired_request_ends_expired_and_its_session_moves_on(fleet: Fleet) -> None:
    expires = datetime.now(UTC) + timedelta(seconds=1)
    late = run_agent.apply_async((calls("e1"), "s"), expires=expires)
    # No worker yet: the message waits past its expiry (a time to pass, not an event).
    time.sleep(max(0.0, (expires - datetime.now(UTC)).total_seconds()) + 0.1)
    fleet.start("w1", concurrency=4, pool="threads")
    assert wait_status(fleet.dsn, late.id, ("expired",), timeout=20) == "expired"
    row = ledger(fleet.dsn, late.id)
    assert row["error_type"] == "Expired" and row["attempts"] == 0
    try:
        late.get(timeout=10)
        raise AssertionError("an expired request returned a result")
    except TaskRevokedError:
        pass
    assert run_agent.delay(calls("n1"), "s").get(timeout=30)["output"] == "done: recorded n1"


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_per_call_time_limit_ends_the_run_failed_not_resumed(fleet: Fleet, pool: str) -> None:
    fleet.start("w1", concurrency=2, pool=pool, TEST_TOOL_SLEEP="1.0")
    limited = run_agent.apply_async((calls("l1", "l2", "l3", "l4", "l5"), "s"), time_limit=2.5)
    assert wait_status(fleet.dsn, limited.id, ("failed",), timeout=20) == "failed"
    row = ledger(fleet.dsn, limited.id)
    assert row["error_type"] == "TimeLimitExceeded" and row["attempts"] == 1
    assert row["crashes"] == 0
    with pytest.raises(Exception, match="TimeLimitExceeded"):
        limited.get(timeout=10)
    assert run_agent.delay(calls("n1"), "s").get(timeout=30)["output"] == "done: recorded n1"
    wait_sweeps_for(fleet)  # the sweeper looked after the session moved on
    assert ledger(fleet.dsn, limited.id)["status"] == "failed"
    assert _attempts(fleet, limited.id) == 1  # not resumed as a crash


def _ended_past_its_time_limit_once(fleet: Fleet, limited: AsyncResult, tag: str) -> None:
    """``limited`` ended ``failed`` with ``TimeLimitExceeded`` after one attempt,
    its tool started once, its session moved on, and so it stays once the
    sweeper has had its chance to act: never resumed, its result still FAILURE."""
    ended = ("failed", "succeeded", "cancelled", "dead")
    assert wait_status(fleet.dsn, limited.id, ended, timeout=40) == "failed"
    row = ledger(fleet.dsn, limited.id)
    assert row["error_type"] == "TimeLimitExceeded", row
    assert row["attempts"] == 1 and row["crashes"] == 0, row
    with pytest.raises(Exception, match="TimeLimitExceeded"):
        limited.get(timeout=10)
    assert run_agent.delay(calls("n1"), "s").get(timeout=30)["output"] == "done: recorded n1"
    wait_swept(fleet, limited.id)
    row = ledger(fleet.dsn, limited.id)
    assert row["status"] == "failed" and row["attempts"] == 1, row
    assert tool_counts(fleet.dsn) == {tag: 1, "n1": 1}
    assert app.AsyncResult(limited.id).state == "FAILURE"
    assert f"dispatched request {limited.id} again" not in fleet.log_text()


@pytest.mark.slow
@pytest.mark.parametrize("broker", ["redis", "rabbitmq"], indirect=True)
def test_celerys_soft_time_limit_on_prefork_ends_the_run_failed_not_resumed(
    fleet: Fleet, broker: str
) -> None:
    """Celery's own soft limit fires in the pool child before the run's timer
    on the loop: the run still ends as past its time limit."""
    fleet.env.update(QUICK_RESULT_CHECK)
    # The tool outlasts the soft limit and ends before the hard one: only the
    # soft limit can end the run failed (and the session waits for the tool).
    fleet.start("w1", concurrency=2, pool="prefork", TEST_TOOL_SLEEP="3")
    limited = run_agent.apply_async((calls("slow1"), "s"), soft_time_limit=2, time_limit=8)
    _ended_past_its_time_limit_once(fleet, limited, "slow1")


@pytest.mark.slow
@pytest.mark.parametrize("broker", ["redis", "rabbitmq"], indirect=True)
def test_celerys_hard_time_limit_on_prefork_ends_the_run_failed_not_resumed(
    fleet: Fleet, broker: str
) -> None:
    """A run that holds its loop, so that neither its own timer nor the soft
    limit can stop it: Celery kills its pool child at the hard limit, and the
    request ends as past its time limit instead of resuming as a crash."""
    fleet.env.update(QUICK_RESULT_CHECK)
    fleet.start("w1", concurrency=2, pool="prefork")
    limited = run_agent.apply_async((calls("block1"), "s"), soft_time_limit=2, time_limit=4)
    _ended_past_its_time_limit_once(fleet, limited, "block1")
