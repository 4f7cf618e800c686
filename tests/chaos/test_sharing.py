"""Many runs share one process: a late loop or a deep queue slows them down,
never fences them. Only a lock connection that is really lost fences its
runs (tests/chaos/test_many_runs.py shows that one)."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import psycopg
import pytest

from loomflow_worker.tasks import run_agent
from tests.chaos.checks import (
    assert_sound,
    install_journal_audit,
    send,
    verdict,
    wait_terminal,
)
from tests.integration.celery_harness import Fleet
from tests.integration.helpers import calls

pytestmark = pytest.mark.slow

#: Heartbeats every half second: a process that fenced on a late heartbeat
#: answer (two intervals) would fence within a second of the loop stalling.
SHARING = {
    "LOOMFLOW_WORKER_SWEEP_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_LEASE": "10",
    "TEST_TOOL_SLEEP": "1.0",
}


def _attempt_outcomes(dsn: str, sent: list[str]) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT coalesce(outcome, 'open'), count(*) FROM run_attempts "
            "WHERE request_id = ANY(%s) GROUP BY 1",
            (sent,),
        ).fetchall()
    return {str(r[0]): int(r[1]) for r in rows}


def _wait_running(dsn: str, request_ids: list[str], count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM runs WHERE request_id = ANY(%s) AND status = 'running'",
                (request_ids,),
            ).fetchone()
        assert row is not None
        if int(row[0]) >= count:
            return
        assert time.monotonic() < deadline, f"only {row[0]} of {count} running"
        time.sleep(0.05)


def test_a_tool_that_blocks_the_loop_six_seconds_fences_nothing_and_is_named(
    fleet: Fleet,
) -> None:
    install_journal_audit(fleet.dsn)
    fleet.start("w1", concurrency=60, cli=True, pool="threads", TEST_BLOCK_SECONDS="6",
                **SHARING)
    sent = [send(i, f"s{i}", "u", letters="abc") for i in range(40)]
    _wait_running(fleet.dsn, [s.request_id for s in sent], 40)
    blocker = run_agent.delay(calls("block-1", "after-block"), "blocker", user_id="u")
    ids = [s.request_id for s in sent] + [blocker.id]

    found = wait_terminal(fleet.dsn, sent, timeout=120)
    assert blocker.get(timeout=60)["output"] == "done: recorded block-1, recorded after-block"
    v = verdict(fleet.dsn, sent)
    assert_sound(v, v.summary())
    assert set(found.values()) == {"succeeded"}, found
    # One attempt each: nothing was fenced, lost or retried.
    outcomes = _attempt_outcomes(fleet.dsn, ids)
    assert outcomes == {"succeeded": len(ids)}, (outcomes, fleet.log_text())
    log = (fleet.logs / "w1.log").read_text()
    assert "fencing" not in log and "lost the lock" not in log, fleet.log_text()
    # One warning names the request, the step and where the loop was held.
    stalls = [line for line in log.splitlines() if "the event loop was held for" in line]
    assert len(stalls) == 1, stalls
    held = re.search(r"held for ([\d.]+)s by request (\S+), step '([^']+)', at (\S+)", stalls[0])
    assert held is not None, stalls[0]
    assert 5.5 <= float(held.group(1)) <= 9, stalls[0]
    assert held.group(2) == blocker.id and held.group(3).startswith("tool_call_")
    assert "agents_fixture.py" in held.group(4) and "_on_start" in stalls[0]


@contextlib.contextmanager
def cpu_hogs(count: int) -> Iterator[None]:
    """``count`` processes that keep a CPU busy each: a noisy neighbour."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_a_backlog_far_past_capacity_beside_cpu_hogs_fences_nothing_and_finishes(
    fleet: Fleet,
) -> None:
    # The backlog is in the broker before the worker starts: it offers the
    # process all 600 at once, twice its ceiling and far more than two busy
    # CPUs carry.
    sent = [send(i, f"s{i}", "u", letters="ab") for i in range(600)]
    ids = [s.request_id for s in sent]
    with cpu_hogs(2):
        fleet.start("w1", concurrency=300, cli=True, pool="threads",
                    LOOMFLOW_WORKER_ADMISSION_QUEUE="50", **{**SHARING, "TEST_TOOL_SLEEP": "0.5"})
        found = wait_terminal(fleet.dsn, sent, timeout=240)
    assert set(found.values()) == {"succeeded"}, (found, fleet.log_text())
    outcomes = _attempt_outcomes(fleet.dsn, ids)
    assert outcomes == {"succeeded": len(ids)}, (outcomes, fleet.log_text())
    log = (fleet.logs / "w1.log").read_text()
    assert "fencing" not in log and "lost the lock" not in log, fleet.log_text()
    # It stopped taking requests while it caught up, and took them again.
    assert "taking no new requests" in log and "taking requests again" in log, fleet.log_text()
