"""A backlog waiting in the broker is not sent again, however long it waits."""

from __future__ import annotations

import re

import pytest

from loomflow_worker.tasks import run_agent

from .celery_harness import Fleet
from .helpers import calls

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"], indirect=True)
def test_a_backlog_drained_over_many_seconds_is_not_sent_twice(fleet: Fleet, broker: str) -> None:
    # One worker running one request at a time drains 30 requests in about
    # 10 s, far longer than HANDOFF_GRACE and REDISPATCH_AFTER here: each
    # waits its turn in the broker's queue, its message is not lost, and the
    # sweeper must leave it alone.
    fleet.start("w1", concurrency=1, TEST_TOOL_SLEEP="0.2",
                LOOMFLOW_WORKER_SWEEP_INTERVAL="0.5", LOOMFLOW_WORKER_HANDOFF_GRACE="1",
                LOOMFLOW_WORKER_REDISPATCH_AFTER="2")
    results = [run_agent.delay(calls(f"b{i}"), f"s{i}") for i in range(30)]
    for i, result in enumerate(results):
        assert result.get(timeout=120)["output"] == f"done: recorded b{i}"
    log = (fleet.logs / "w1.log").read_text(errors="replace")
    assert "sweeper: dispatched request" not in log
    # Each ran once, and no duplicate reached the worker.
    assert len(re.findall(r"request \S+ succeeded", log)) == 30
    assert "already succeeded" not in log
