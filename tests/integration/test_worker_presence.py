"""What the console's fleet page says of a worker process once it is gone:
``stopped`` when it closed cleanly, whatever its pool and however SIGTERM
reached it (a warm shutdown, ``loomflow-worker worker``'s soft shutdown, a
second SIGTERM during it, an idle stop), ``stale`` when it vanished."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from loomflow_worker.console import create_app
from loomflow_worker.tasks import run_agent, settings

from .celery_harness import Fleet, wait_status
from .helpers import calls, fleet_page, wait_until

pytestmark = pytest.mark.slow

#: Heartbeats every half second: a vanished process is stale after one second.
BEATS = {"LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "0.5"}


@pytest.fixture
def client(fleet: Fleet) -> Iterator[TestClient]:
    with TestClient(create_app(settings()), client=("127.0.0.1", 40000),
                    base_url="http://localhost:8040") as local:
        yield local


def _processes(fleet: Fleet, client: TestClient, name: str) -> dict[str, str]:
    """The state the fleet page shows for each process of worker ``name``."""
    node = f"{name}-{fleet.queue}@{os.uname().nodename}:"
    return {worker: state for worker, (state, _) in fleet_page(client).items()
            if worker.startswith(node)}


def _wait_shown(fleet: Fleet, client: TestClient, name: str, state: str,
                timeout: float = 10) -> dict[str, str]:
    """Wait until the fleet page shows every process of worker ``name`` as
    ``state``; what it shows."""
    return wait_until(lambda: _processes(fleet, client, name),
                      f"{name}'s processes shown as {state}", timeout, every=0.1,
                      until=lambda shown: shown and set(shown.values()) == {state})


def _serving(fleet: Fleet, client: TestClient, name: str, pool: str) -> None:
    """Wait until every process of worker ``name`` that runs requests is live
    on the fleet page (a prefork worker: its child; threads: itself)."""
    _wait_shown(fleet, client, name, "live")
    assert len(_processes(fleet, client, name)) == 1, (pool, _processes(fleet, client, name))


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_an_idle_worker_stopped_by_sigterm_shows_stopped(
    fleet: Fleet, client: TestClient, pool: str
) -> None:
    fleet.start("w1", concurrency=1, cli=True, pool=pool, **BEATS)
    assert run_agent.delay(calls("a"), "s1").get(timeout=60)["output"] == "done: recorded a"
    _serving(fleet, client, "w1", pool)
    fleet.terminate("w1", timeout=30)
    assert "no run in flight and no message held" in (fleet.logs / "w1.log").read_text()
    # Long past two beats: stopped is what it says, not stale.
    time.sleep(1.5)
    _wait_shown(fleet, client, "w1", "stopped", timeout=1)


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_worker_whose_soft_shutdown_stops_a_run_shows_stopped(
    fleet: Fleet, client: TestClient, pool: str
) -> None:
    fleet.start("w1", concurrency=1, cli=True, pool=pool, TEST_TOOL_SLEEP="60",
                LOOMFLOW_WORKER_SOFT_SHUTDOWN_TIMEOUT="2", **BEATS)
    result = run_agent.delay(calls("slow"), "s1")
    wait_status(fleet.dsn, result.id, ("running",))
    _serving(fleet, client, "w1", pool)
    fleet.terminate("w1", timeout=60)
    assert "Initiating Soft Shutdown" in (fleet.logs / "w1.log").read_text()
    time.sleep(1.5)
    _wait_shown(fleet, client, "w1", "stopped", timeout=1)


def test_a_second_sigterm_during_the_soft_shutdown_still_stops_cleanly(
    fleet: Fleet, client: TestClient
) -> None:
    proc = fleet.start("w1", concurrency=1, cli=True, pool="threads", TEST_TOOL_SLEEP="60",
                       LOOMFLOW_WORKER_SOFT_SHUTDOWN_TIMEOUT="3", **BEATS)
    result = run_agent.delay(calls("slow"), "s1")
    wait_status(fleet.dsn, result.id, ("running",))
    _serving(fleet, client, "w1", "threads")
    proc.send_signal(signal.SIGTERM)
    fleet.wait_logged("Initiating Soft Shutdown")
    # An impatient operator (or a second signal from the orchestrator).
    proc.send_signal(signal.SIGTERM)
    _, out = fleet.wait_exit("w1", timeout=60)
    assert "Waiting gracefully for cold shutdown to complete" in out, out[-3000:]
    time.sleep(1.5)
    _wait_shown(fleet, client, "w1", "stopped", timeout=1)
    assert wait_status(fleet.dsn, result.id, ("queued",)) == "queued"


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_warm_shutdown_after_its_run_shows_stopped(
    fleet: Fleet, client: TestClient, pool: str
) -> None:
    """Plain ``celery worker``: SIGTERM waits for the run in flight."""
    fleet.start("w1", concurrency=1, pool=pool, TEST_TOOL_SLEEP="1", **BEATS)
    result = run_agent.delay(calls("warm"), "s1")
    wait_status(fleet.dsn, result.id, ("running",))
    _serving(fleet, client, "w1", pool)
    fleet.terminate("w1", timeout=60)
    assert result.get(timeout=10)["output"] == "done: recorded warm"
    time.sleep(1.5)
    _wait_shown(fleet, client, "w1", "stopped", timeout=1)


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_worker_killed_shows_stale(fleet: Fleet, client: TestClient, pool: str) -> None:
    fleet.start("w1", concurrency=1, cli=True, pool=pool, **BEATS)
    _serving(fleet, client, "w1", pool)
    fleet.kill("w1")
    _wait_shown(fleet, client, "w1", "stale", timeout=10)
