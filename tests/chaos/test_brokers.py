"""The same run on each broker."""

from __future__ import annotations

import pytest

from loomflow_worker.tasks import run_agent
from tests.integration.celery_harness import Fleet, ledger
from tests.integration.helpers import calls

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_run_on_each_broker(fleet: Fleet, broker: str) -> None:
    fleet.start("w1", concurrency=1)
    result = run_agent.delay(calls("a"), "s")
    assert result.get(timeout=60)["output"] == "done: recorded a"
    assert ledger(fleet.dsn, result.id)["status"] == "succeeded"
