"""SIGTERM to a worker started by ``loomflow-worker worker`` (Celery's soft
shutdown): an idle worker stops at once; a worker with a run in flight, or a
message it holds, gives them the soft shutdown's time first, as before."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime, timedelta

import pytest

from loomflow_worker.tasks import app, run_agent

from .celery_harness import Fleet, ledger, wait_status
from .helpers import calls, wait_until

pytestmark = pytest.mark.slow

#: Far longer than these tests wait for a worker to stop: one that sat the
#: soft shutdown out while idle fails them.
LONG_SOFT_SHUTDOWN = "120"
#: How long an idle worker may take to stop (closing its sweeper, its
#: connections and its pool children), far below LONG_SOFT_SHUTDOWN.
IDLE_STOPS_WITHIN = 15.0
IDLE = "no run in flight and no message held"


def _log(fleet: Fleet, name: str) -> str:
    return (fleet.logs / f"{name}.log").read_text(errors="replace")


def _wait_idle(fleet: Fleet, name: str, timeout: float = 30) -> None:
    """Wait until worker ``name`` reports no task active, reserved or
    scheduled: it is done with every request it took (a caller gets a result
    as soon as it is stored, a moment before its worker is done with it)."""
    node = f"{name}-{fleet.queue}@{os.uname().nodename}"
    inspect = app.control.inspect(destination=[node], timeout=2)
    wait_until(lambda: [inspect.active(), inspect.reserved(), inspect.scheduled()],
               f"worker {name} idle (seen as: its active, reserved and scheduled tasks)",
               timeout, every=0.1,
               until=lambda found: all(answer is not None and answer.get(node) == []
                                       for answer in found))


def _wait_scheduled(fleet: Fleet, name: str, request_id: str, timeout: float = 60) -> None:
    """Wait until worker ``name`` reports ``request_id`` among the messages it
    holds for their eta (it logs the message received a moment before)."""
    node = f"{name}-{fleet.queue}@{os.uname().nodename}"
    inspect = app.control.inspect(destination=[node], timeout=2)
    wait_until(lambda: (inspect.scheduled() or {}).get(node) or [],
               f"worker {name} holds {request_id} for its eta", timeout, every=0.1,
               until=lambda scheduled: any(entry.get("request", {}).get("id") == request_id
                                           for entry in scheduled))


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_an_idle_worker_stops_at_once_on_sigterm(fleet: Fleet, pool: str) -> None:
    fleet.start("w1", concurrency=2, cli=True, pool=pool,
                LOOMFLOW_WORKER_SOFT_SHUTDOWN_TIMEOUT=LONG_SOFT_SHUTDOWN)
    # A request it ran and finished leaves it idle.
    assert run_agent.delay(calls("before"), "s1").get(timeout=60)["output"] == (
        "done: recorded before")
    _wait_idle(fleet, "w1")
    started = time.monotonic()
    fleet.terminate("w1", timeout=IDLE_STOPS_WITHIN)
    took = time.monotonic() - started
    log = _log(fleet, "w1")
    assert IDLE in log, log[-3000:]
    assert "Initiating Soft Shutdown" not in log
    print(f"\nidle {pool} worker stopped {took:.1f}s after SIGTERM")


def test_a_worker_with_a_run_in_flight_gives_it_the_soft_shutdown(fleet: Fleet) -> None:
    fleet.start("w1", concurrency=2, cli=True, pool="threads", TEST_TOOL_SLEEP="60",
                LOOMFLOW_WORKER_SOFT_SHUTDOWN_TIMEOUT="2")
    result = run_agent.delay(calls("slow"), "s1")
    wait_status(fleet.dsn, result.id, ("running",))
    started = time.monotonic()
    fleet.terminate("w1", timeout=60)
    took = time.monotonic() - started
    log = _log(fleet, "w1")
    assert "Initiating Soft Shutdown" in log and IDLE not in log, log[-3000:]
    assert took >= 2.0
    # Interrupted and requeued, not crashed: another worker finishes it.
    fleet.start("w2", concurrency=2, pool="threads")
    assert result.get(timeout=60)["output"] == "done: recorded slow"
    assert ledger(fleet.dsn, result.id)["crashes"] == 0


def test_a_worker_holding_a_message_for_its_eta_gives_it_the_soft_shutdown(
    fleet: Fleet,
) -> None:
    fleet.start("w1", concurrency=2, cli=True, pool="threads",
                LOOMFLOW_WORKER_SOFT_SHUTDOWN_TIMEOUT="2")
    result = run_agent.apply_async((calls("later"), "s1"),
                                   eta=datetime.now(UTC) + timedelta(seconds=600))
    _wait_scheduled(fleet, "w1", result.id)
    fleet.terminate("w1", timeout=60)
    log = _log(fleet, "w1")
    assert "Initiating Soft Shutdown" in log and IDLE not in log, log[-3000:]
    assert ledger(fleet.dsn, result.id)["status"] == "queued"
