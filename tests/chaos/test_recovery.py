"""Recovery from whole-worker deaths, frozen workers and rolling deploys."""

from __future__ import annotations

import os
import signal
import statistics
import time

import psycopg
import pytest

from loomflow_worker.tasks import run_agent
from tests.chaos.checks import RECOVERY
from tests.integration.celery_harness import Fleet, ledger
from tests.integration.helpers import (
    calls,
    steps_journaled_twice,
    tool_counts,
    tool_executions,
    wait_for_execution,
    wait_until,
)

pytestmark = pytest.mark.slow



def _next_start(dsn: str, tag: str, after_pid: int, timeout: float = 30) -> float:
    """When ``tag`` started again, in a process other than ``after_pid``."""
    started = wait_until(lambda: next((e[2] for e in tool_executions(dsn)
                                       if e[0] == tag and e[1] != after_pid), None),
                         f"{tag} ran again", timeout)
    return float(started.timestamp())


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_whole_worker_killed_mid_run_resumes_elsewhere_in_seconds(
    fleet: Fleet, broker: str
) -> None:
    # The Redis visibility timeout stays at its default (hours): recovery
    # comes from the sweeper, which sees the dead worker's lock freed.
    env = {**RECOVERY, "TEST_TOOL_SLEEP": "0.4"}
    # Three workers, so that a trial need not wait for the one the last trial
    # killed to start again (seconds on a busy machine): two others are ready,
    # one to take the request and one to resume it.
    for name in ("w1", "w2", "w3"):
        fleet.start(name, concurrency=1, wait=False, **env)
    starting = ["w1", "w2", "w3"]
    times: list[float] = []
    for trial in range(5):
        for name in starting[:-1]:
            fleet.wait_ready(name)
        starting = starting[-1:]
        tags = [f"k{trial}-{i}" for i in range(3)]
        result = run_agent.delay(calls(*tags), f"s{trial}")
        _, pid, _, _ = wait_for_execution(fleet.dsn, tags[1])
        victim = fleet.worker_of(pid)
        killed_at = time.time()
        fleet.kill(victim)
        times.append(_next_start(fleet.dsn, tags[1], pid) - killed_at)
        # The lost worker comes back while the request finishes elsewhere.
        fleet.start(victim, concurrency=1, wait=False, **env)
        starting.append(victim)
        assert result.get(timeout=60)["output"] == "done: " + ", ".join(
            f"recorded {t}" for t in tags
        )
        counts = tool_counts(fleet.dsn)
        assert counts[tags[0]] == 1 and counts[tags[2]] == 1 and counts[tags[1]] == 2
    assert steps_journaled_twice(fleet.dsn) == []
    p50, worst = statistics.median(times), max(times)
    print(f"\n{broker}: kill -> resumed step over {len(times)} trials: "
          f"p50 {p50:.2f}s, max {worst:.2f}s ({', '.join(f'{t:.2f}' for t in times)})")
    assert p50 < 5 and worst < 10


def _journal_snapshot(dsn: str) -> list[tuple[object, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            "SELECT session_id, step_name, md5(value), created_at FROM journal_steps "
            "UNION ALL SELECT session_id, step_name, md5(chunks), created_at "
            "FROM journal_streams ORDER BY 1, 2"
        ).fetchall()


def test_a_frozen_worker_is_fenced_and_its_request_recovered(fleet: Fleet) -> None:
    env = {**RECOVERY, "TEST_TOOL_SLEEP": "1.0"}
    fleet.start("w1", concurrency=1, **env)
    fleet.start("w2", concurrency=1, **env)
    tags = ["f1", "f2", "f3"]
    result = run_agent.delay(calls(*tags), "s")
    _, pid, _, _ = wait_for_execution(fleet.dsn, "f2")
    frozen_name = fleet.worker_of(pid)
    frozen = fleet.workers[frozen_name]
    os.killpg(frozen.pid, signal.SIGSTOP)
    try:
        frozen_at = time.monotonic()
        value = result.get(timeout=60)
        recovered_in = time.monotonic() - frozen_at
        assert value["output"] == "done: recorded f1, recorded f2, recorded f3"
        assert recovered_in > 3  # not before the lease ran out
        before = _journal_snapshot(fleet.dsn)
        row_before = ledger(fleet.dsn, result.id)
    finally:
        os.killpg(frozen.pid, signal.SIGCONT)
    # Continued, the frozen worker finishes its tool, then finds itself fenced:
    # its attempt ends having written nothing more and finished nothing.
    fleet.wait_tasks_ended(frozen_name, [result.id])
    assert _journal_snapshot(fleet.dsn) == before
    row_after = ledger(fleet.dsn, result.id)
    assert row_after == row_before and row_after["status"] == "succeeded"
    counts = tool_counts(fleet.dsn)
    assert counts["f1"] == 1 and counts["f3"] == 1 and counts["f2"] == 2
    assert "fenced" in fleet.log_text() or "LockLost" in fleet.log_text()
    # The sweeper recorded the fence, for the console's fleet page.
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        fences = conn.execute("SELECT detail FROM sweeper_actions WHERE action = 'fence' "
                              "AND request_id = %s", (result.id,)).fetchall()
    assert fences and "no heartbeat" in fences[0][0], fences
    print(f"\nfrozen worker: request finished {recovered_in:.1f}s after the freeze")


def test_a_rolling_deploy_loses_no_run(fleet: Fleet) -> None:
    # Each run takes about 10 s (5 tools of 2 s), so that both old workers are
    # still running some when they are replaced, however long the new ones take
    # to start on a busy machine.
    env = {
        **RECOVERY,
        "TEST_TOOL_SLEEP": "2.0",
        "LOOMFLOW_WORKER_SOFT_SHUTDOWN_TIMEOUT": "1",
    }
    fleet.start("w1", concurrency=2, cli=True, **env)
    fleet.start("w2", concurrency=2, cli=True, **env)
    requests = []
    for i in range(10):
        tags = [f"d{i}-{j}" for j in range(5)]
        requests.append((tags, run_agent.delay(calls(*tags), f"s{i}")))
    wait_for_execution(fleet.dsn, requests[0][0][1])
    # Replace the fleet one worker at a time, as a Deployment's rolling update
    # does. The new workers' tool calls take half a second: the runs the old
    # ones left behind need not last once the deploy is over.
    started = time.monotonic()
    new = {**env, "TEST_TOOL_SLEEP": "0.5"}
    fleet.start("w3", concurrency=2, cli=True, **new)
    fleet.terminate("w1", timeout=30)
    fleet.start("w4", concurrency=2, cli=True, **new)
    fleet.terminate("w2", timeout=30)
    deploy_took = time.monotonic() - started
    for tags, result in requests:
        assert result.get(timeout=90)["output"] == "done: " + ", ".join(
            f"recorded {t}" for t in tags
        )
    assert steps_journaled_twice(fleet.dsn) == []
    rows = [ledger(fleet.dsn, r.id) for _, r in requests]
    assert {row["status"] for row in rows} == {"succeeded"}
    # Runs stopped by the deploy were interrupted, not crashed: no step toward `dead`.
    assert max(int(str(row["attempts"])) for row in rows) > 1
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        attempts = conn.execute(
            "SELECT request_id, attempt, worker, outcome, started_at, ended_at FROM run_attempts "
            "ORDER BY request_id, attempt"
        ).fetchall()
    assert {row["crashes"] for row in rows} == {0}, attempts
    # A tool whose side effect finished just before its worker stopped, but
    # whose journal entry was not yet written, runs again: at-least-once at
    # the step boundary. What never happens is a journaled step running again.
    interrupted = len(tool_executions(fleet.dsn)) - sum(len(tags) for tags, _ in requests)
    assert interrupted > 0, "the deploy interrupted no run: the test proved nothing"
    assert "Initiating Soft Shutdown" in fleet.log_text()
    print(f"\nrolling deploy: {deploy_took:.1f}s, {interrupted} tool calls interrupted and rerun")
