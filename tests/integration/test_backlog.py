"""A backlog waiting in the broker is not sent again."""

from __future__ import annotations

from loomflow_worker.tasks import run_agent

from .celery_harness import Fleet
from .helpers import calls


def test_a_backlog_drained_over_many_seconds_is_not_sent_twice(fleet: Fleet) -> None:
    # One worker running one request at a time drains 30 requests over more than
    # HANDOFF_GRACE (5 s): each waits its turn in the broker's queue, so its
    # message is not lost and the sweeper must leave it alone.
    fleet.start("w1", concurrency=1, TEST_TOOL_SLEEP="0.2", LOOMFLOW_WORKER_SWEEP_INTERVAL="0.5")
    results = [run_agent.delay(calls(f"b{i}"), f"s{i}") for i in range(30)]
    for i, result in enumerate(results):
        assert result.get(timeout=120)["output"] == f"done: recorded b{i}"
    log = (fleet.logs / "w1.log").read_text(errors="replace")
    assert "sweeper: dispatched request" not in log
