"""A worker frozen past its lease and then continued (SIGSTOP, then SIGCONT, as
a paused VM, a long GC pause or a throttled container does to a process)
while another worker resumes its runs: the continued process must never start
a step whose result the other worker journaled (G1), and what it wrote after
its lease lapsed never lands.

Each trial stops one worker carrying two hundred runs, lets a second worker
resume and finish every one of them, then continues the first and waits until
it has given up each of its attempts. Three ways the stop lands:

- on a busy loop (runs whose model answers at once, two tool calls a turn
  side by side): tasks the loop had scheduled before the stop run the moment
  it continues, before the heartbeat's timer; the second tool call of a pair
  has no statement of its own to send first, so only the lease's check before
  the step stands between the continued process and its side effect;
- while the runs wait on their model (each answer comes due during the stop);
- inside the tool calls."""

from __future__ import annotations

import os
import re
import signal
import time
from datetime import datetime
from pathlib import Path

import psycopg
import pytest

from loomflow_worker.tasks import run_agent
from tests.chaos.checks import (
    Sent,
    executions,
    install_journal_audit,
    running_count,
    verdict,
    wait_terminal,
)
from tests.integration.celery_harness import Fleet
from tests.integration.helpers import wait_until

# Alone, not beside other tests: two hundred runs and their stand-in tools load
# this 2-CPU machine enough to slow every test beside them.
pytestmark = [pytest.mark.slow, pytest.mark.serial]
FROZEN_ENV = {
    "LOOMFLOW_WORKER_SWEEP_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_LEASE": "3",
    "LOOMFLOW_WORKER_MAX_CRASHES": "20",
}


def _send_pairs(index: int, session: str, turns: int) -> Sent:
    """A request of ``turns`` turns of two tool calls each, the two of a turn
    run side by side: the second of a pair starts with no statement of its run
    before it (the first sends the run's unsent journal rows)."""
    tags = tuple(f"{session}-r{index:03d}-{turn}{letter}"
                 for turn in range(turns) for letter in "ab")
    prompt = "\n".join(
        f'call record {{"tag": "{tags[i]}"}} && record {{"tag": "{tags[i + 1]}"}}'
        for i in range(0, len(tags), 2)
    )
    return Sent(index, session, "u", tags, run_agent.delay(prompt, session, user_id="u"))


def _now(dsn: str) -> datetime:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]


def _trial(
    fleet: Fleet, *, runs: int, model: float, tool: float, turns: int,
    stop_after: float,
) -> tuple[list[Sent], str, datetime]:
    """One stop: ``runs`` requests in flight in a worker that is stopped
    ``stop_after`` seconds after they all started, past the lease, while a
    second worker resumes and finishes them; then it is continued. Returns the
    requests, the stopped worker's name and the database's clock just before
    it continued."""
    env = {**FROZEN_ENV, "TEST_MODEL_LATENCY": str(model), "TEST_TOOL_SLEEP": str(tool)}
    frozen_name, spare_name = "frozen", "spare"
    fleet.start(frozen_name, concurrency=runs, pool="threads",
                TEST_ENTRIES_FILE=str(_entries_file(fleet, frozen_name)), **env)
    frozen = fleet.workers[frozen_name]
    sent = [_send_pairs(i, f"s{i}", turns) for i in range(runs)]
    ids = [s.request_id for s in sent]
    wait_until(lambda: running_count(fleet.dsn, ids, "queued"),
               "every request started (seen as: how many not yet)", 90,
               until=lambda queued: queued == 0, every=0.05)
    time.sleep(stop_after)
    # Most still run when the process stops (on a loaded machine the first
    # may have finished before the last started).
    assert running_count(fleet.dsn, ids) >= runs // 2
    os.killpg(frozen.pid, signal.SIGSTOP)
    try:
        # The spare runs what it resumes at once: how long its model and tools
        # take changes nothing the stopped process does.
        fleet.start(spare_name, concurrency=runs, pool="threads",
                    **{**env, "TEST_MODEL_LATENCY": "0.05", "TEST_TOOL_SLEEP": "0"})
        found = wait_terminal(fleet.dsn, sent, timeout=180)
        assert sorted(set(found.values())) == ["succeeded"], found
    finally:
        continued_at = _now(fleet.dsn)
        os.killpg(frozen.pid, signal.SIGCONT)
    _wait_settled(fleet, frozen_name, ids)
    return sent, frozen_name, continued_at


def _entries_file(fleet: Fleet, name: str) -> Path:
    return fleet.logs / f"{name}.entries"


def _entered_after(fleet: Fleet, name: str, after: datetime) -> list[str]:
    """The tool calls worker ``name`` entered after ``after``, even those a
    cancel stopped before they recorded anything."""
    path = _entries_file(fleet, name)
    lines = path.read_text().splitlines() if path.exists() else []
    return [line for line in lines if datetime.fromisoformat(line.split()[2]) > after]


def _wait_settled(fleet: Fleet, name: str, ids: list[str], timeout: float = 120) -> None:
    """Wait until worker ``name`` ended every task of ``ids`` it received, and
    received no other for a second."""
    log = fleet.logs / f"{name}.log"
    settled: tuple[set[str], float] = (set(), time.monotonic())

    def running() -> list[str] | None:
        """Its tasks of ``ids`` not ended yet; None once none was, and none
        came, for a second."""
        nonlocal settled
        text = log.read_text(errors="replace")
        received = {rid for rid in ids if f"[{rid}] received" in text}
        pending = {rid for rid in received if not re.search(
            rf"Task \S+\[{rid}\] (succeeded|raised|retry|ignored|reject)", text)}
        if received != settled[0] or pending:
            settled = (received, time.monotonic())
            return sorted(pending)
        return None if time.monotonic() - settled[1] > 1.0 else []

    wait_until(running, f"worker {name} settled (seen as: its tasks still running)", timeout,
               until=lambda pending: pending is None, every=0.1)


@pytest.mark.parametrize(
    ("runs", "model", "tool", "turns", "stop_after"),
    [
        pytest.param(200, 0.05, 0.0, 4, 0.5, id="stopped-on-a-busy-loop"),
        pytest.param(100, 1.5, 0.0, 3, 0.75, id="stopped-waiting-on-the-model"),
        pytest.param(100, 0.2, 1.5, 3, 0.95, id="stopped-mid-tool"),
    ],
)
def test_a_continued_process_starts_no_step_completed_elsewhere(
    fleet: Fleet, runs: int, model: float, tool: float, turns: int, stop_after: float
) -> None:
    install_journal_audit(fleet.dsn)
    sent, frozen_name, continued_at = _trial(
        fleet, runs=runs, model=model, tool=tool, turns=turns,
        stop_after=stop_after)
    frozen_pid = fleet.workers[frozen_name].pid
    v = verdict(fleet.dsn, sent)
    summary = v.summary()
    assert v.lost == [], summary
    # G1: no execution, in either process, started after its result was journaled.
    assert v.g1_violations == [], summary
    assert v.keys_per_tag == [], summary
    # Stronger: the continued process starts no tool call at all. A tool call
    # in flight at the stop finishes there (and ran again on the spare
    # worker, the at-least-once window of a step in flight); every run then
    # fences before its next step.
    late = [e for e in executions(fleet.dsn)
            if e.pid == frozen_pid and e.started_at > continued_at]
    assert late == [], f"{len(late)} tool calls started in the continued process: {late[:3]}"
    entered = _entered_after(fleet, frozen_name, continued_at)
    assert entered == [], f"{len(entered)} tool calls entered when it continued: {entered[:3]}"
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        # No attempt stays open: the stopped process's ended lost, the
        # spare's with their requests.
        open_attempts = conn.execute(
            "SELECT request_id, attempt, worker FROM run_attempts "
            "WHERE request_id = ANY(%s) AND ended_at IS NULL",
            ([s.request_id for s in sent],),
        ).fetchall()
    assert open_attempts == [], open_attempts[:5]
    log = (fleet.logs / f"{frozen_name}.log").read_text(errors="replace")
    # The continued process says it was stopped, not that one request held its loop.
    assert re.search(r"the whole process was stopped for \d+\.\ds", log), log[-3000:]
    fleet.kill(frozen_name)
    fleet.kill("spare")
