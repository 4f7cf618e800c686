"""Celery's canvas over busy sessions: a request that parks and is handed over
later keeps what its message carried (chain, callbacks, errbacks, chord and
group membership, headers, priority, time limits)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from celery import chain, chord, group
from celery.result import AsyncResult

from loomflow_worker.tasks import run_agent

from .celery_harness import Fleet, wait_status
from .helpers import calls, tool_counts, wait_until

pytestmark = pytest.mark.slow


def _runs(dsn: str) -> dict[str, dict[str, Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(
            "SELECT request_id, prompt, status, attempts, received_at, options, error_type "
            "FROM runs"
        )
        names = [d.name for d in cur.description or ()]
        return {row[0]: dict(zip(names, row, strict=True)) for row in cur.fetchall()}



def _busy(fleet: Fleet, session: str = "s") -> AsyncResult:
    """A request holding ``session`` for a couple of seconds, running."""
    busy = run_agent.delay(calls("busy1", "busy2"), session)
    wait_status(fleet.dsn, busy.id, ("running",), timeout=30)
    return busy


def _each_once(fleet: Fleet, *requests: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Every request of the test (by its tool calls' tags) ran once: one ledger
    row each, one attempt, one execution of each tool call."""
    runs = _runs(fleet.dsn)
    assert sorted(r["prompt"] for r in runs.values()) == sorted(calls(*t) for t in requests)
    assert all(r["attempts"] == 1 for r in runs.values()), runs
    assert tool_counts(fleet.dsn) == {tag: 1 for tags in requests for tag in tags}
    return runs


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"], indirect=True)
def test_a_chain_whose_head_waits_for_its_busy_session_runs_to_its_end(
    fleet: Fleet, broker: str
) -> None:
    fleet.start("w1", concurrency=4, pool="threads", TEST_TOOL_SLEEP="0.5")
    busy = _busy(fleet)
    flow = chain(run_agent.si(calls("A"), "s"), run_agent.si(calls("B"), "s")).apply_async()
    assert flow.get(timeout=30)["output"] == "done: recorded B"
    head = flow.parent
    assert head is not None and head.get(timeout=5)["output"] == "done: recorded A"
    assert busy.get(timeout=5)["output"] == "done: recorded busy1, recorded busy2"
    runs = _each_once(fleet, ("busy1", "busy2"), ("A",), ("B",))
    assert runs[head.id]["received_at"] is not None  # it did park, and was handed over
    assert all(r["status"] == "succeeded" for r in runs.values())


def test_a_chord_of_three_on_one_session_runs_its_callback(fleet: Fleet) -> None:
    fleet.start("w1", concurrency=4, pool="threads", TEST_TOOL_SLEEP="0.3")
    header = [run_agent.si(calls(f"c{i}"), "s") for i in range(3)]
    result = chord(header)(run_agent.si(calls("callback"), "s"))
    assert result.get(timeout=40)["output"] == "done: recorded callback"
    runs = _each_once(fleet, ("c0",), ("c1",), ("c2",), ("callback",))
    assert all(r["status"] == "succeeded" for r in runs.values())
    parked = [r for r in runs.values() if r["received_at"] is not None]
    assert parked and all("chord" in r["options"] for r in parked)


def test_a_group_on_a_busy_session_completes(fleet: Fleet) -> None:
    fleet.start("w1", concurrency=4, pool="threads", TEST_TOOL_SLEEP="0.3")
    _busy(fleet)
    members = group(run_agent.si(calls(f"g{i}"), "s") for i in range(3)).apply_async()
    outputs = [value["output"] for value in members.get(timeout=40)]
    assert outputs == [f"done: recorded g{i}" for i in range(3)]
    runs = _each_once(fleet, ("busy1", "busy2"), ("g0",), ("g1",), ("g2",))
    for member in members.results:
        row = runs[member.id]
        # Parked (the ledger recorded its group), handed over, and run.
        assert row["received_at"] is not None
        assert row["options"]["group_id"] == members.id


def test_a_parked_request_keeps_its_time_limit_headers_priority_and_errback(
    fleet: Fleet,
) -> None:
    fleet.start("w1", concurrency=4, pool="threads", TEST_TOOL_SLEEP="0.6")
    _busy(fleet)
    limited = run_agent.apply_async(
        (calls("l1", "l2", "l3", "l4", "l5", "l6"), "s"),
        time_limit=2.0, headers={"tenant": "t-1"}, priority=3,
        link_error=run_agent.si(calls("errback"), "s-errors"),
    )
    # Handed over after the busy request, it still has its time limit (today's
    # 2 s, not the agent's hour) and fails; its errback runs.
    assert wait_status(fleet.dsn, limited.id, ("failed", "succeeded"), timeout=30) == "failed"
    with pytest.raises(Exception, match="TimeLimitExceeded"):
        limited.get(timeout=10)
    runs = _runs(fleet.dsn)
    row = runs[limited.id]
    assert row["error_type"] == "TimeLimitExceeded" and row["attempts"] == 1
    assert row["received_at"] is not None
    # What the ledger recorded of its message when it parked (the time limit
    # and the errback above show the message published at its turn had them).
    options = row["options"]
    assert options["headers"]["tenant"] == "t-1"
    assert options["priority"] == 3 and options["time_limit"] == 2.0
    assert options["link_error"][0]["args"][1] == "s-errors"
    # Celery sends the errback once the failure is stored: the caller may see
    # the failure a moment before the errback's request is recorded.
    errbacks = wait_until(lambda: [r for r in _runs(fleet.dsn).values()
                                   if r["prompt"] == calls("errback")],
                          "the errback enqueued", 20, every=0.1)
    assert len(errbacks) == 1
    wait_status(fleet.dsn, errbacks[0]["request_id"], ("succeeded",), timeout=20)
