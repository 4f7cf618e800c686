"""Cancel, busy-session policies and time limits, on real workers."""

from __future__ import annotations

import time

import pytest

from loomflow_worker import cancel_request
from loomflow_worker.runtime import SessionBusy
from loomflow_worker.tasks import RunCancelled, RunFailed, run_agent

from .celery_harness import Fleet, ledger, wait_status
from .helpers import calls, tool_counts, wait_for_execution

FAST = {"LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "0.2", "LOOMFLOW_WORKER_LEASE": "5"}


@pytest.mark.slow
def test_cancel_a_queued_request_it_never_starts(fleet: Fleet) -> None:
    fleet.start("w1", concurrency=1, TEST_TOOL_SLEEP="0.5", **FAST)
    first = run_agent.delay(calls("first1", "first2"), "s")
    queued = run_agent.delay(calls("never"), "s")
    after = run_agent.delay(calls("after"), "s")
    wait_for_execution(fleet.dsn, "first1")
    assert cancel_request(queued.id) == "cancelled"
    with pytest.raises(RunCancelled):
        queued.get(timeout=30)
    assert first.get(timeout=30)["output"] == "done: recorded first1, recorded first2"
    assert after.get(timeout=30)["output"] == "done: recorded after"
    assert "never" not in tool_counts(fleet.dsn)
    row = ledger(fleet.dsn, queued.id)
    assert row["status"] == "cancelled" and row["attempts"] == 0
    assert ledger(fleet.dsn, after.id)["epoch"] == 1


@pytest.mark.slow
def test_cancel_a_running_request_it_stops_at_the_next_step(fleet: Fleet) -> None:
    fleet.start("w1", concurrency=1, TEST_TOOL_SLEEP="0.6", **FAST)
    running = run_agent.delay(calls("c1", "c2", "c3", "c4"), "s")
    after = run_agent.delay(calls("next"), "s")
    wait_for_execution(fleet.dsn, "c1")
    assert cancel_request(running.id) == "running"
    with pytest.raises(RunCancelled, match="cancelled while running"):
        running.get(timeout=30)
    assert after.get(timeout=30)["output"] == "done: recorded next"
    counts = tool_counts(fleet.dsn)
    assert counts.get("c1") == 1 and "c4" not in counts  # stopped between steps
    row = ledger(fleet.dsn, running.id)
    assert row["status"] == "cancelled" and row["epoch"] == 0
    assert ledger(fleet.dsn, after.id)["epoch"] == 1  # the epoch advanced past it
    assert cancel_request(running.id) == "cancelled"  # cancelling again changes nothing


def test_cancel_of_an_unknown_request_is_a_clear_error(fleet: Fleet) -> None:
    from loomflow_worker import InvalidInput, RequestNotFound

    # The one not-found error: what `show` exits 4 with and the console answers 404 with.
    with pytest.raises(RequestNotFound, match="no request 'nope' in the runs ledger") as info:
        cancel_request("nope")
    assert isinstance(info.value, InvalidInput)


@pytest.mark.slow
def test_on_busy_reject_refuses_while_the_session_has_work(fleet: Fleet) -> None:
    fleet.start("w1", concurrency=1, TEST_TOOL_SLEEP="0.5", **FAST)
    first = run_agent.delay(calls("r1"), "s")
    with pytest.raises(SessionBusy, match="on_busy=\"reject\""):
        run_agent.delay(calls("rejected"), "s", on_busy="reject")
    assert first.get(timeout=30)["output"] == "done: recorded r1"
    wait_status(fleet.dsn, first.id, ("succeeded",))
    later = run_agent.apply_async((calls("r2"), "s"), on_busy="reject")
    assert later.get(timeout=30)["output"] == "done: recorded r2"
    assert "rejected" not in tool_counts(fleet.dsn)


@pytest.mark.slow
def test_on_busy_interrupt_cancels_the_running_request_then_runs(fleet: Fleet) -> None:
    fleet.start("w1", concurrency=1, TEST_TOOL_SLEEP="0.6", **FAST)
    running = run_agent.delay(calls("i1", "i2", "i3", "i4"), "s")
    queued = run_agent.delay(calls("skipped"), "s")
    wait_for_execution(fleet.dsn, "i1")
    urgent = run_agent.delay(calls("urgent"), "s", on_busy="interrupt")
    assert urgent.get(timeout=30)["output"] == "done: recorded urgent"
    with pytest.raises(RunCancelled):
        running.get(timeout=30)
    with pytest.raises(RunCancelled):
        queued.get(timeout=30)
    counts = tool_counts(fleet.dsn)
    assert "i4" not in counts and "skipped" not in counts
    assert ledger(fleet.dsn, urgent.id)["epoch"] == 1


def test_a_bad_on_busy_is_refused(fleet: Fleet) -> None:
    from loomflow_worker.runtime import InvalidInput

    with pytest.raises(InvalidInput, match="on_busy must be one of"):
        run_agent.delay(calls("x"), "s", on_busy="sometimes")


@pytest.mark.slow
def test_a_run_past_its_time_limit_fails_and_the_session_moves_on(fleet: Fleet) -> None:
    fleet.start("w1", concurrency=1, TEST_TOOL_SLEEP="0.7", **FAST)
    slow = run_agent.delay(calls("t1", "t2", "t3"), "s", agent="quick")
    after = run_agent.delay(calls("later"), "s")
    started = time.monotonic()
    with pytest.raises(RunFailed, match="1s time limit"):
        slow.get(timeout=30)
    assert time.monotonic() - started < 10
    assert after.get(timeout=30)["output"] == "done: recorded later"
    row = ledger(fleet.dsn, slow.id)
    assert row["status"] == "failed" and row["error_type"] == "TimeLimitExceeded"
    assert row["attempts"] == 1  # a timeout is not retried
    assert "t3" not in tool_counts(fleet.dsn)
