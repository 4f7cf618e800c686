"""Many runs share one process: a late loop or a deep queue slows them down,
never fences them. Only a lock connection that is really lost fences its
runs (tests/chaos/test_many_runs.py shows that one)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from loomflow_worker import cancel_run
from loomflow_worker.tasks import app, run_agent
from tests.chaos.checks import (
    SHARING,
    assert_sound,
    install_journal_audit,
    kill_postgres_backends,
    ledger_rows,
    quarantined,
    send,
    verdict,
    wait_in_tool,
    wait_terminal,
)
from tests.integration.celery_harness import Fleet, ledger, wait_status
from tests.integration.helpers import calls, wait_for_execution, wait_until

# Alone (python -m tests runs it after the rest): CPU hogs load the whole
# machine, and its loop stalls are measured against leases of a few seconds.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

#: Heartbeats every half second: a process that fenced on a late heartbeat
#: answer (two intervals) would fence within a second of the loop stalling.


def _attempt_outcomes(dsn: str, sent: list[str]) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT coalesce(outcome, 'open'), count(*) FROM run_attempts "
            "WHERE request_id = ANY(%s) GROUP BY 1",
            (sent,),
        ).fetchall()
    return {str(r[0]): int(r[1]) for r in rows}


def _wait_running(dsn: str, request_ids: list[str], count: int, timeout: float = 60,
                  *, attempt: int | None = None) -> None:
    """Wait until ``count`` of ``request_ids`` run (their ``attempt``-th attempt)."""
    def running() -> int:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM runs WHERE request_id = ANY(%s) AND status = 'running'"
                " AND attempts = coalesce(%s, attempts)",
                (request_ids, attempt),
            ).fetchone()
        assert row is not None
        return int(row[0])

    wait_until(running, f"{count} running (seen as: how many)", timeout,
               until=lambda found: found >= count, every=0.05)


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


def test_requests_taken_while_the_loop_is_held_are_not_taken_for_lost(fleet: Fleet) -> None:
    # While a tool holds the loop, the worker keeps taking messages: their
    # tasks start in the pool's threads and wait for the loop to start their
    # runs. Neither in the broker nor started, they must still count as held
    # by this worker, or the sweeper (in a thread of its own, sweeping every
    # half second) publishes them again.
    fleet.start("w1", concurrency=20, cli=True, pool="threads", TEST_BLOCK_SECONDS="6",
                LOOMFLOW_WORKER_HANDOFF_GRACE="0.5", **SHARING)
    blocker = run_agent.delay(calls("block-1"), "blocker", user_id="u")
    wait_for_execution(fleet.dsn, "block-1")
    sent = [send(i, f"s{i}", "u", letters="a") for i in range(10)]
    ids = [s.request_id for s in sent] + [blocker.id]
    found = wait_terminal(fleet.dsn, sent, timeout=120)
    assert set(found.values()) == {"succeeded"}, found
    assert blocker.get(timeout=60)["output"] == "done: recorded block-1"
    log = (fleet.logs / "w1.log").read_text()
    assert "the event loop was held for" in log, fleet.log_text()
    assert " again (" not in log, fleet.log_text()
    assert {request_id: fleet.deliveries(request_id)[0] for request_id in ids} == dict.fromkeys(
        ids, 1)
    assert _attempt_outcomes(fleet.dsn, ids) == {"succeeded": len(ids)}


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
    # process 500 at once, past its ceiling and far more than two busy CPUs
    # carry.
    sent = [send(i, f"s{i}", "u", letters="ab") for i in range(500)]
    ids = [s.request_id for s in sent]
    with cpu_hogs(2):
        # Low admission limits, so that the process surely stops taking
        # requests at some point (its lock connections drain hundreds of
        # statements a round trip, so their queue alone rarely grows long).
        fleet.start("w1", concurrency=300, cli=True, pool="threads",
                    LOOMFLOW_WORKER_ADMISSION_QUEUE="10", LOOMFLOW_WORKER_ADMISSION_LAG="0.2",
                    **{**SHARING, "TEST_TOOL_SLEEP": "0.5"})
        found = wait_terminal(fleet.dsn, sent, timeout=240)
    assert set(found.values()) == {"succeeded"}, (found, fleet.log_text())
    outcomes = _attempt_outcomes(fleet.dsn, ids)
    assert outcomes == {"succeeded": len(ids)}, (outcomes, fleet.log_text())
    log = (fleet.logs / "w1.log").read_text()
    assert "fencing" not in log and "lost the lock" not in log, fleet.log_text()
    # It stopped taking requests while it caught up, and took them again.
    assert "taking no new requests" in log and "taking requests again" in log, fleet.log_text()


def _keep_workers_up(fleet: Fleet, names: list[str], env: dict[str, str],
                     until: Callable[[], bool], timeout: float) -> int:
    """Restart any of ``names`` that died (as an orchestrator would) until
    ``until()``; returns how many restarts it took."""
    restarts = 0

    def done() -> bool:
        """Whether ``until()``; if not, the dead workers restarted."""
        nonlocal restarts
        if until():
            return True
        for name in names:
            if fleet.workers[name].poll() is not None:
                restarts += 1
                fleet.start(name, concurrency=100, cli=True, pool="threads", wait=False, **env)
        return False

    wait_until(done, "the workers kept up until done", timeout, every=0.2, detail=fleet.log_text)
    return restarts


def test_a_poison_request_is_charged_its_crashes_and_its_neighbours_none(fleet: Fleet) -> None:
    install_journal_audit(fleet.dsn)
    # REDISPATCH_AFTER keeps its default (a minute): a copy the sweeper sent
    # into a process that the poison then killed goes again once its queue
    # has lost it (HANDOFF_GRACE).
    # One worker: every attempt of the poison shares its process with the
    # neighbours' attempts of the same redelivery, and the poison kills only
    # once one of them is in its tool (at most 3 s later), so those die with
    # it twice, whatever order they start in.
    env = {**SHARING, "LOOMFLOW_WORKER_LEASE": "5", "LOOMFLOW_WORKER_MAX_CRASHES": "3",
           "LOOMFLOW_WORKER_HANDOFF_GRACE": "2", "TEST_POISON_COMPANY": "3"}
    fleet.start("w1", concurrency=100, cli=True, pool="threads", **env)
    sent = [send(i, f"s{i}", "u", letters="abc") for i in range(40)]
    _wait_running(fleet.dsn, [s.request_id for s in sent], 40)
    started = time.monotonic()
    # Its tool kills the process it runs in, every time.
    poison = run_agent.delay(calls("poison-1"), "poison", user_id="u")
    everyone = [*sent]

    def ended() -> bool:
        return (wait_terminal(fleet.dsn, everyone, timeout=0) and len(set(
            wait_terminal(fleet.dsn, everyone, timeout=0).values()) - {"succeeded"}) == 0
            and str(ledger(fleet.dsn, poison.id)["status"]) in ("dead", "failed", "succeeded"))

    restarts = _keep_workers_up(fleet, ["w1"], env, ended, timeout=240)
    took = time.monotonic() - started
    row = ledger(fleet.dsn, poison.id)
    assert row["status"] == "dead" and row["crashes"] == 3, (row, fleet.log_text())
    assert "died 3 times" in str(row["error"]), row
    rows = ledger_rows(fleet.dsn, sent)
    assert {r["status"] for r in rows.values()} == {"succeeded"}, rows
    assert sum(int(r["crashes"]) for r in rows.values()) == 0, rows
    v = verdict(fleet.dsn, sent)
    assert_sound(v, v.summary())
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        spans = conn.execute(
            "SELECT extract(epoch FROM max(finished_at) - min(enqueued_at)),"
            " extract(epoch FROM max(finished_at) FILTER (WHERE request_id <> %s)"
            "  - (SELECT enqueued_at FROM runs WHERE request_id = %s)),"
            " count(*) FILTER (WHERE suspicion > 0)"
            " FROM runs", (poison.id, poison.id)).fetchone()
        outcomes = conn.execute(
            "SELECT coalesce(outcome, 'died'), count(*) FROM run_attempts GROUP BY 1").fetchall()
    assert spans is not None
    # Nothing waited REDISPATCH_AFTER: the neighbours lost seconds to the deaths.
    assert float(spans[1]) < 30, (spans, fleet.log_text())
    # The neighbours that died twice with the poison ran their next attempt
    # in quarantine groups (QUARANTINE_GROUP, 8); only the few whose group
    # the poison killed then ran alone. (Logged by the worker since its
    # last restart, after the poison's last shared death.)
    log = "\n".join(path.read_text(errors="replace") for path in fleet.logs.glob("*.log"))
    grouped = set(re.findall(r"request (\S+): running in quarantine with other suspects", log))
    alone = set(re.findall(r"request (\S+): running alone in a process of its own", log))
    assert poison.id in alone and grouped - {poison.id}, (grouped, alone, fleet.log_text())
    assert alone - {poison.id} <= grouped and len(alone - {poison.id}) <= 7, (
        grouped, alone, fleet.log_text())
    # Its end, logged in its process of quarantine, is an ERROR in its worker's log.
    levels = {line.split(": ", 1)[1].split("/", 1)[0] for line in log.splitlines()
              if f"request {poison.id}" in line and f" request {poison.id} dead: " in line}
    assert levels == {"ERROR"}, (levels, fleet.log_text())
    print(f"poison dead after {row['attempts']} attempts; {restarts} worker restarts; "
          f"the 40 neighbours all succeeded, none charged a crash, the last "
          f"{float(spans[1]):.1f}s after the poison was sent; test took {took:.1f}s; "
          f"{len(grouped - {poison.id})} ran in quarantine groups, "
          f"{len(alone - {poison.id})} of them alone then; attempts by outcome {dict(outcomes)}")


def test_a_tool_that_holds_the_loop_past_the_lease_ends_dead_after_max_lost(
    fleet: Fleet,
) -> None:
    # Each attempt holds its process's loop 5 s, past the 3 s lease: the sweeper
    # ends its lock connection every time, so every attempt is lost.
    env = {**SHARING, "LOOMFLOW_WORKER_LEASE": "3", "LOOMFLOW_WORKER_MAX_LOST": "3",
           "LOOMFLOW_WORKER_REDISPATCH_AFTER": "3", "TEST_BLOCK_SECONDS": "5"}
    fleet.start("w1", concurrency=20, cli=True, pool="threads", **env)
    neighbours = [send(i, f"s{i}", "u", letters="ab") for i in range(5)]
    stalling = run_agent.delay(calls("block-forever"), "stalling", user_id="u")
    status = wait_status(fleet.dsn, stalling.id, ("dead", "failed", "succeeded"), timeout=180)
    row = ledger(fleet.dsn, stalling.id)
    assert status == "dead" and row["error_type"] == "AttemptsLost", (row, fleet.log_text())
    assert "lost their lock connection without completing a step" in str(row["error"])
    # Its deaths were stalls, not crashes; its neighbours finished.
    assert row["crashes"] == 0, (row, fleet.log_text())
    found = wait_terminal(fleet.dsn, neighbours, timeout=60)
    assert set(found.values()) == {"succeeded"}, found
    log = (fleet.logs / "w1.log").read_text()
    assert f"by request {stalling.id}" in log, fleet.log_text()


def test_revoke_and_cancel_stop_requests_running_alone_and_their_sessions_move_on(
    fleet: Fleet,
) -> None:
    # Two requests whose tool takes 20 s die twice with their shared process:
    # their third attempts run in quarantine, together in one process.
    env = {**SHARING, "LOOMFLOW_WORKER_LEASE": "3", "LOOMFLOW_WORKER_REDISPATCH_AFTER": "3",
           "TEST_TOOL_SLEEP": "20"}
    suspect_id, neighbour_id = both = list(quarantined(fleet, env))
    _wait_running(fleet.dsn, both, 2, timeout=90, attempt=3)
    log = fleet.logs / "w1.log"
    wait_until(lambda: all(f"request {request_id}: running in quarantine" in log.read_text()
                           for request_id in both),
               "both running in quarantine", 30, every=0.1, detail=fleet.log_text)
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        places = conn.execute(
            "SELECT DISTINCT worker FROM run_attempts WHERE request_id = ANY(%s)"
            " AND attempt = 3", (both,)).fetchall()
    assert len(places) == 1, places  # one process of quarantine

    # A cancel stops one at its next step boundary, in its own process, as it
    # stops a run of the shared process.
    assert cancel_run(neighbour_id) == "running"

    revoked_at = time.monotonic()
    app.control.revoke(suspect_id, terminate=True)
    status = wait_status(fleet.dsn, suspect_id, ("cancelled", "succeeded", "failed", "dead"),
                         timeout=30)
    took = time.monotonic() - revoked_at
    row = ledger(fleet.dsn, suspect_id)
    assert status == "cancelled" and took < 10, (row, took, fleet.log_text())
    assert row["error_type"] == "Revoked" and row["crashes"] == 0, row
    # Its session moves on: the next request runs (no tool call, so at once).
    after = run_agent.delay("hello", "t", user_id="u")
    assert after.get(timeout=30)["request_id"] == after.id
    assert ledger(fleet.dsn, suspect_id)["status"] == "cancelled"
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        outcomes = conn.execute(
            "SELECT attempt, outcome FROM run_attempts WHERE request_id = %s ORDER BY attempt",
            (suspect_id,)).fetchall()
    assert len(outcomes) == 3 and outcomes[-1][1] in ("interrupted", "cancelled"), outcomes

    assert wait_status(fleet.dsn, neighbour_id, ("cancelled", "succeeded"), timeout=60) \
        == "cancelled"
    row = ledger(fleet.dsn, neighbour_id)
    assert row["error"] == "cancelled while running" and row["attempts"] == 3, row
    after = run_agent.delay("hello", "n", user_id="u")
    assert after.get(timeout=30)["request_id"] == after.id


def test_the_suspects_of_a_group_that_died_run_alone_next_without_waiting_for_it(
    fleet: Fleet,
) -> None:
    # Heartbeats every 2 s (the default): a process that died is taken for
    # stopped by the worker that saw it end, so its suspects' next attempts
    # do not wait two heartbeat intervals for its row to go stale.
    env = {**SHARING, "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "2",
           "LOOMFLOW_WORKER_LEASE": "10", "LOOMFLOW_WORKER_REDISPATCH_AFTER": "3",
           "TEST_TOOL_SLEEP": "20"}
    both = list(quarantined(fleet, env))
    wait_in_tool(fleet.dsn, ("alone-1", "neighbour-1"), 3)
    log = fleet.logs / "w1.log"
    places = {int(pid) for pid in re.findall(
        r"running in quarantine with other suspects, in process (\d+)", log.read_text())}
    assert len(places) == 1, (places, fleet.log_text())
    os.kill(places.pop(), signal.SIGKILL)
    _wait_running(fleet.dsn, both, 2, timeout=30, attempt=4)
    text = log.read_text()
    assert "may still be running" not in text, fleet.log_text()
    assert text.count("running alone in a process of its own") >= 2, fleet.log_text()
    for request_id in both:
        assert ledger(fleet.dsn, request_id)["crashes"] == 0


def test_a_member_left_alone_in_its_group_is_not_charged_the_groups_death(
    fleet: Fleet,
) -> None:
    # Two suspects in one process of quarantine: one leaves it (its step
    # completed, handed back), the other's tool call lasts 10 s longer. The
    # process then dies, as it would of what the first left behind (a thread
    # of its tool, memory it holds): the one still there is charged nothing.
    env = {**SHARING, "LOOMFLOW_WORKER_LEASE": "3", "LOOMFLOW_WORKER_REDISPATCH_AFTER": "3",
           "TEST_TOOL_SLEEP": "4", "TEST_LASTING_SECONDS": "10"}
    left_id, stayed_id = both = list(quarantined(fleet, env, ("alone-1", "lasting-1")))
    wait_in_tool(fleet.dsn, ("lasting-1",), 3)
    log = fleet.logs / "w1.log"

    def ended() -> dict[str, str]:
        """The outcome of each third attempt that ended."""
        with psycopg.connect(fleet.dsn, autocommit=True) as conn:
            return dict(conn.execute(
                "SELECT request_id, outcome FROM run_attempts WHERE request_id = ANY(%s)"
                " AND attempt = 3", (both,)).fetchall())

    outcomes = wait_until(ended, f"{left_id} handed back", 30, every=0.05,
                          until=lambda seen: seen.get(left_id) == "handed_back",
                          detail=fleet.log_text)
    assert outcomes.get(stayed_id) is None, outcomes
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        places = conn.execute(
            "SELECT DISTINCT worker, pid FROM run_attempts WHERE request_id = ANY(%s)"
            " AND attempt = 3", (both,)).fetchall()
    assert len(places) == 1, (places, fleet.log_text())  # one process of quarantine
    os.kill(int(places[0][1]), signal.SIGKILL)
    for request_id in both:
        assert wait_status(fleet.dsn, request_id, ("succeeded", "failed", "dead"),
                           timeout=90) == "succeeded", fleet.log_text()
    stayed = ledger(fleet.dsn, stayed_id)
    # Its death there raised its suspicion, and charged nothing: it ran alone
    # next, until it completed a step, then shared again.
    assert stayed["crashes"] == 0, stayed
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        outcomes = [r[0] for r in conn.execute(
            "SELECT outcome FROM run_attempts WHERE request_id = %s ORDER BY attempt",
            (stayed_id,)).fetchall()]
    assert outcomes == ["died", "died", "died", "handed_back", "succeeded"], outcomes
    assert "request " + stayed_id + ": running alone in a process of its own" \
        in log.read_text(), fleet.log_text()
    assert ledger(fleet.dsn, left_id)["crashes"] == 0


def test_a_request_that_finds_no_room_to_run_alone_goes_back_to_the_queue(
    fleet: Fleet,
) -> None:
    # One request alone at a time per worker process: of the two suspects
    # that w1 receives, the second is not held behind the first there.
    env = {**SHARING, "LOOMFLOW_WORKER_LEASE": "3", "LOOMFLOW_WORKER_REDISPATCH_AFTER": "3",
           "TEST_TOOL_SLEEP": "3", "LOOMFLOW_WORKER_ALONE_AT_ONCE": "1",
           "LOOMFLOW_WORKER_QUARANTINE_GROUP": "1"}
    both = list(quarantined(fleet, env))
    wait_until(lambda: "goes back to the queue" in (fleet.logs / "w1.log").read_text(),
               "the second suspect back to the queue", 60, every=0.05, detail=fleet.log_text)
    # A worker with room takes it (or w1, once its own ended).
    fleet.start("w2", concurrency=10, cli=True, pool="threads", **env)
    for request_id in both:
        assert wait_status(fleet.dsn, request_id, ("succeeded", "failed", "dead"),
                           timeout=90) == "succeeded", fleet.log_text()
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        alone = conn.execute(
            "SELECT request_id, split_part(worker, '@', 1), started_at, ended_at"
            " FROM run_attempts WHERE request_id = ANY(%s) AND outcome = 'handed_back'",
            (both,)).fetchall()
        crashes = conn.execute("SELECT sum(crashes) FROM runs WHERE request_id = ANY(%s)",
                               (both,)).fetchone()
    assert sorted(r[0] for r in alone) == sorted(both), alone
    assert crashes is not None and crashes[0] == 0, crashes
    # Never two at once in one worker process.
    (_, node_a, start_a, end_a), (_, node_b, start_b, end_b) = alone
    assert node_a != node_b or end_a <= start_b or end_b <= start_a, alone


def test_a_connection_lost_while_a_request_starts_alone_is_no_crash(
    fleet: Fleet, tmp_path: Path,
) -> None:
    # The first start in a process of its own holds its lock connection after
    # it committed its attempt, until every connection to the database is
    # ended (as a Postgres restart ends them, the pooled ones too).
    # MAX_CRASHES=1: that process dying of it would end its request dead.
    marker = tmp_path / "held"
    env = {**SHARING, "LOOMFLOW_WORKER_LEASE": "3", "LOOMFLOW_WORKER_REDISPATCH_AFTER": "3",
           "TEST_TOOL_SLEEP": "5", "LOOMFLOW_WORKER_MAX_CRASHES": "1",
           "TEST_HOLD_START": f"alone:{marker}"}
    ids = quarantined(fleet, env)
    wait_until(marker.exists, "the first start alone held", 60, detail=fleet.log_text)
    kill_postgres_backends(fleet.dsn)
    for request_id in ids:
        assert wait_status(fleet.dsn, request_id, ("succeeded", "failed", "dead"),
                           timeout=90) == "succeeded", (ledger(fleet.dsn, request_id),
                                                        fleet.log_text())
        assert ledger(fleet.dsn, request_id)["crashes"] == 0
    log = (fleet.logs / "w1.log").read_text()
    # No attempt died in its process (the line a death writes; a request
    # escalated to run alone, its lock lost with the others, says why once).
    assert not re.search(r"request \S+ died in quarantine \(", log), fleet.log_text()
