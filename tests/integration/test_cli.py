"""The ``loomflow-worker`` command against real workers and services: run as a
subprocess, or in this process (``cli_in_process``) where what it prints is
under test and nothing of its process is: a command that reads its settings
from the environment as it runs, not one that may send through the process's
Celery binding (enqueue, cancel, a signal that wakes a request), nor one whose
process is the point (a tail attached before the run it follows, a doctor
printing each check as it goes, the first doctor importing the agents)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from loomflow.runtime import _codec
from psycopg.types.json import Jsonb

from loomflow_worker.events import iter_events
from loomflow_worker.runtime import PostgresRuntime
from loomflow_worker.tasks import run_agent, settings

from .celery_harness import (
    AGENTS,
    REDIS_PORT,
    ROOT,
    Fleet,
    ledger,
    wait_status,
    wait_sweeps_for,
)
from .helpers import (
    calls,
    cell,
    cli,
    cli_in_process,
    connected_to,
    enqueued,
    lines,
    signal_listeners,
    steps_journaled_twice,
    wait_for_execution,
    wait_until,
)

pytestmark = pytest.mark.slow

WITH_WAITER = f"{AGENTS},tests.integration.cli_agents"


def spawn(fleet: Fleet, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "loomflow_worker.cli", *args],
        env=fleet.env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def show_json(fleet: Fleet, request_id: str) -> dict[str, object]:
    done = cli_in_process(fleet, "show", request_id, "--json")
    assert done.returncode == 0, done.stderr
    value: dict[str, object] = json.loads(done.stdout)
    return value


# ---- enqueue, runs, show ---------------------------------------------------------------------


def test_enqueue_wait_runs_and_show_on_a_real_run(fleet: Fleet) -> None:
    fleet.start("w1", concurrency=1)
    done = cli(fleet, "enqueue", calls("a", "b"), "--session", "s1", "--user", "u1",
               "--metadata", '{"ticket": 7}', "--wait", "--timeout", "60")
    assert done.returncode == 0, done.stderr
    first_id, output = lines(done.stdout)
    uuid.UUID(first_id)
    assert output == "done: recorded a, recorded b"
    assert ledger(fleet.dsn, first_id)["status"] == "succeeded"

    done = cli(fleet, "enqueue", calls("c"), "--session", "s1", "--user", "u1", "--wait", "--json")
    assert done.returncode == 0, done.stderr
    second = json.loads(done.stdout)
    assert second["status"] == "succeeded" and second["error"] is None
    assert second["result"]["output"] == "done: recorded c"
    second_id = second["request_id"]

    # Without --wait: the id at once; the run goes on.
    third_id = enqueued(fleet, calls("d"), "s2")
    wait_status(fleet.dsn, third_id, ("succeeded",))

    table = cli_in_process(fleet, "requests", "--session", "s1")
    assert table.returncode == 0, table.stderr
    header, *rows = lines(table.stdout)
    assert header.split() == ["REQUEST", "SESSION", "USER", "AGENT", "VERSION", "STATUS",
                              "ATTEMPTS", "ENQUEUED", "ETA", "FINISHED", "WORKER", "WAITS",
                              "TOKENS", "COST"]
    assert [r.split()[0] for r in rows] == [second_id, first_id]  # newest first
    for row in rows:
        cells = row.split()
        assert cells[1:4] == ["s1", "u1", "default"] and cells[5:7] == ["succeeded", "1"]
        assert re.fullmatch(r"[0-9a-f]{12}", cells[4])  # the version it ran
        # The worker (node:pid); no wait.
        assert ":" in cell(header, row, "WORKER") and cell(header, row, "WAITS") == "-"


    # `runs`, the command's first name, lists them too.
    as_json = [json.loads(line) for line in lines(cli_in_process(fleet, "runs", "--json").stdout)]
    assert [r["request_id"] for r in as_json] == [third_id, second_id, first_id]
    assert {r["status"] for r in as_json} == {"succeeded"}
    assert cli_in_process(fleet, "requests", "--status", "failed", "--status", "dead").stdout == ""
    newer = cli_in_process(fleet, "requests", "--newer-than", "1h", "--limit", "2")
    assert len(lines(newer.stdout)) == 3
    assert cli_in_process(fleet, "requests", "--older-than", "1h").stdout == ""
    assert lines(cli_in_process(fleet, "requests", "--user", "u1", "--json").stdout).__len__() == 2

    shown = cli_in_process(fleet, "show", first_id)
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert "status    succeeded" in text
    assert "output    done: recorded a, recorded b" in text
    assert 'call record {"tag": "a"}' in text and '"ticket": 7' in text
    assert "1 attempt, 0 failures, 0 crashes" in text
    assert "succeeded" in text.split("attempts\n", 1)[1].splitlines()[1]
    version = re.search(r"^version   ([0-9a-f]{12})$", text, re.MULTILINE)
    assert version is not None, text  # pinned to the version its attempt ran, waiting for none
    assert version[1] in text.split("attempts\n", 1)[1].splitlines()[1]
    journal = text.split("journal ", 1)[1]
    assert "ok: recorded a" in journal and "ok: recorded b" in journal
    assert "replayed" not in journal

    detail = show_json(fleet, first_id)
    assert detail["status"] == "succeeded" and detail["epoch"] == 0
    attempts = detail["attempts"]
    assert isinstance(attempts, list) and len(attempts) == 1
    assert attempts[0]["outcome"] == "succeeded"
    assert attempts[0]["agent_version"] == detail["agent_version"] == version[1]
    assert detail["version_wait_since"] is None and detail["upgrades"] == []
    steps = detail["journal"]
    assert isinstance(steps, list) and steps
    assert {(s["executed_in"], tuple(s["replayed_in"])) for s in steps} == {(1, ())}
    names = [s["name"] for s in steps]
    assert "idem:tool_call_1_0" in names and "idem:tool_call_2_0" in names
    assert any(s["stream"] and s["name"] == "model_call_1" for s in steps)
    # The second request ran in the next epoch: its journal, not the first's.
    later = show_json(fleet, second_id)
    assert later["epoch"] == 1
    later_steps = later["journal"]
    assert isinstance(later_steps, list)
    assert [s["summary"] for s in later_steps if s["name"].startswith("idem:tool_call")] == [
        "ok: recorded c"
    ]
    assert all(s["key"].startswith("1/") for s in later_steps)


def test_show_after_a_sigkill_mid_tool_says_which_steps_replayed(fleet: Fleet) -> None:
    # Each tool sleeps 2 s: long enough to be seen running, and killed, on a busy machine.
    fleet.start("w1", concurrency=1, TEST_TOOL_SLEEP="2")
    request_id = enqueued(fleet, calls("t1", "t2", "t3"), "s", "--user", "u")
    _, pid, _, _ = wait_for_execution(fleet.dsn, "t2")
    os.kill(pid, signal.SIGKILL)
    wait_status(fleet.dsn, request_id, ("succeeded",), timeout=60)

    detail = show_json(fleet, request_id)
    attempts = detail["attempts"]
    assert isinstance(attempts, list)
    assert [(a["attempt"], a["outcome"]) for a in attempts] == [(1, "died"), (2, "succeeded")]
    assert attempts[0]["pid"] == pid and attempts[1]["pid"] != pid
    steps = detail["journal"]
    assert isinstance(steps, list)
    by_output = {s["summary"]: s for s in steps if s["name"].startswith("idem:tool_call")}
    assert set(by_output) == {"ok: recorded t1", "ok: recorded t2", "ok: recorded t3"}
    t1, t2, t3 = (by_output[f"ok: recorded {t}"] for t in ("t1", "t2", "t3"))
    assert (t1["executed_in"], t1["replayed_in"]) == (1, [2])
    assert t1["history"] == "executed in attempt 1, replayed in 2"
    # t2 was cut short by the kill: no entry from attempt 1, executed by attempt 2.
    assert (t2["executed_in"], t2["replayed_in"]) == (2, [])
    assert (t3["executed_in"], t3["replayed_in"]) == (2, [])
    # Everything attempt 1 journaled, attempt 2 replayed (the model calls too).
    first = [s for s in steps if s["executed_in"] == 1]
    assert first and all(s["replayed_in"] == [2] and s["rerun_in"] == [] for s in first)

    # The live events say the same: attempt 2 replayed t1 and ran t2 and t3.
    events = list(iter_events(request_id, settings=settings(), idle_timeout=30))
    replayed = {
        e.data["payload"]["result"]["output"]
        for e in events if e.attempt == 2 and e.kind == "tool_result" and e.replayed
    }
    fresh = {
        e.data["payload"]["result"]["output"]
        for e in events if e.attempt == 2 and e.kind == "tool_result" and not e.replayed
    }
    assert replayed == {"recorded t1"} and fresh == {"recorded t2", "recorded t3"}

    text = cli_in_process(fleet, "show", request_id).stdout
    assert "2 attempts, 0 failures, 1 crash" in text
    attempt_rows = text.split("attempts\n", 1)[1].split("\n\n", 1)[0]
    assert "worker died" in attempt_rows and "succeeded" in attempt_rows
    journal = text.split("journal ", 1)[1].splitlines()
    assert any("executed in attempt 1, replayed in 2" in ln and "recorded t1" in ln
               for ln in journal)
    assert any("executed in attempt 2" in ln and "recorded t2" in ln for ln in journal)


# ---- tail ------------------------------------------------------------------------------------


def test_tail_attached_before_during_and_after_prints_the_same_events(fleet: Fleet) -> None:
    request_id = enqueued(fleet, calls("e1", "e2", "e3"), "s")  # no worker yet: it waits
    before = spawn(fleet, "tail", request_id)
    wait_until(lambda: connected_to(before.pid, REDIS_PORT) or before.poll() is not None,
               "tail never reached Redis")
    assert before.poll() is None  # attached, nothing to print yet
    fleet.start("w1", concurrency=1, TEST_TOOL_SLEEP="0.3")
    wait_for_execution(fleet.dsn, "e2")
    during = spawn(fleet, "tail", request_id)
    out_before, err_before = before.communicate(timeout=60)
    out_during, err_during = during.communicate(timeout=60)
    assert before.returncode == 0, err_before
    assert during.returncode == 0, err_during
    after = cli_in_process(fleet, "tail", request_id)
    assert after.returncode == 0, after.stderr
    assert out_before == out_during == after.stdout

    printed = lines(after.stdout)
    kinds = [line.split()[3] if "replay" in line.split() else line.split()[2] for line in printed]
    assert kinds[0] == "started" and kinds[-1] == "end"
    assert printed[-1].split()[-1] == "succeeded"
    assert all(line.split()[1] == "a1" for line in printed)
    tool_calls = [line for line in printed if " tool_call " in line]
    assert [line.split("tool_call", 1)[1].strip() for line in tool_calls] == [
        f'record({{"tag": "{tag}"}})' for tag in ("e1", "e2", "e3")
    ]
    results = [line.split("tool_result", 1)[1].strip() for line in printed
               if " tool_result " in line]
    assert results == ["ok: recorded e1", "ok: recorded e2", "ok: recorded e3"]
    assert any("output 'done: recorded e1, recorded e2, recorded e3'" in line
               for line in printed)

    tailed = cli_in_process(fleet, "tail", request_id, "--json")
    as_json = [json.loads(line) for line in lines(tailed.stdout)]
    assert len(as_json) == len(printed)
    assert as_json[-1]["kind"] == "end" and as_json[-1]["data"]["status"] == "succeeded"
    ids = [tuple(map(int, e["id"].split("-"))) for e in as_json]
    assert ids == sorted(ids)


def test_tail_of_a_resumed_run_marks_the_replayed_events(fleet: Fleet) -> None:
    # Tools of 2 s: the CLI's enqueue may take a second or more to return on a
    # busy machine, and the second tool must still be running when it has.
    fleet.start("w1", concurrency=1, TEST_TOOL_SLEEP="2.0")
    request_id = enqueued(fleet, calls("r1", "r2"), "s")
    _, pid, _, _ = wait_for_execution(fleet.dsn, "r2")
    os.kill(pid, signal.SIGKILL)
    done = cli_in_process(fleet, "tail", request_id)
    assert done.returncode == 0, done.stderr
    printed = lines(done.stdout)
    second = [line for line in printed if line.split()[1] == "a2"]
    replayed = [line for line in second if line.split()[2] == "replay"]
    assert any("tool_result" in line and "ok: recorded r1" in line for line in replayed)
    assert not any("recorded r2" in line for line in replayed)
    assert printed[-1].split()[1:3] == ["a2", "end"]


# ---- cancel, signal --------------------------------------------------------------------------


def test_cancel_prints_the_status_and_tail_exits_nonzero(fleet: Fleet) -> None:
    fleet.start("w1", concurrency=1, TEST_TOOL_SLEEP="1.0")
    running = enqueued(fleet, calls(*(f"c{i}" for i in range(30))), "s")
    queued = enqueued(fleet, calls("never"), "s")
    # Running (its first tool calls may be over already: each CLI call takes a
    # second or more to start on a busy machine), with half a minute of tool
    # calls still to go, so the cancel lands before it could end by itself.
    assert wait_status(fleet.dsn, running, ("running",)) == "running"

    done = cli(fleet, "cancel", queued)
    assert (done.returncode, done.stdout.strip()) == (0, f"{queued}: cancelled")
    done = cli(fleet, "cancel", running)
    assert (done.returncode, done.stdout.strip()) == (0, f"{running}: running")

    tailed = cli_in_process(fleet, "tail", running)
    assert tailed.returncode == 1, tailed.stderr
    assert lines(tailed.stdout)[-1].split()[2:] == ["end", "cancelled:", "cancelled", "while",
                                                    "running"]
    assert cli_in_process(fleet, "tail", queued).returncode == 1
    assert ledger(fleet.dsn, running)["status"] == "cancelled"
    assert ledger(fleet.dsn, queued)["status"] == "cancelled"
    # A finished request: its final status, nothing changed.
    done = cli(fleet, "cancel", running)
    assert (done.returncode, done.stdout.strip()) == (0, f"{running}: cancelled")
    waited = cli(fleet, "enqueue", calls("x"), "--session", "s", "--wait")
    assert waited.returncode == 0 and lines(waited.stdout)[1] == "done: recorded x"


def _gave_its_slot_back(fleet: Fleet, request_id: str) -> bool:
    """Whether the request's first attempt gave its slot back (paused, queued again)."""
    row = ledger(fleet.dsn, request_id)
    return (row["status"], row["attempts"]) == ("queued", 1)


def _approve(fleet: Fleet, waiting: str) -> None:
    """Send the signal the approver waits for: its request resumes and succeeds
    on its second attempt (its first paused), with no failure or crash."""
    assert cli(fleet, "signal", "approvals", "approve", '{"ok": true}').returncode == 0
    wait_status(fleet.dsn, waiting, ("succeeded",), timeout=30)
    row = ledger(fleet.dsn, waiting)
    assert isinstance(row["result"], dict) and row["result"]["output"] == 'done: got {"ok": true}'
    assert (row["attempts"], row["failures"], row["crashes"]) == (2, 0, 0), row
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        outcomes = [r[0] for r in conn.execute(
            "SELECT outcome FROM run_attempts WHERE request_id = %s ORDER BY attempt",
            (waiting,)).fetchall()]
    assert outcomes == ["paused", "succeeded"]


def test_a_run_waiting_long_for_a_signal_gives_its_slot_back(fleet: Fleet) -> None:
    # One slot. The approval run waits for its signal past PARK_AFTER (1 s):
    # it gives the slot back (its request queued again, its message acked), so
    # another request runs meanwhile; the signal brings it back, replaying its
    # journal (its sender publishes it; with a sweep every 0.5 s the sweeper may too,
    # and only one of them does).
    fleet.env["LOOMFLOW_WORKER_AGENTS"] = WITH_WAITER
    fleet.start("w1", concurrency=1, pool="threads", LOOMFLOW_WORKER_PARK_AFTER="1",
                LOOMFLOW_WORKER_SWEEP_INTERVAL="0.5", LOOMFLOW_WORKER_HANDOFF_GRACE="1")
    prompt = 'call wait_signal {"session": "approvals", "name": "approve"}'
    waiting = enqueued(fleet, prompt, "s-approve", "--agent", "approver")
    wait_until(lambda: _gave_its_slot_back(fleet, waiting), "the run never gave its slot back")
    other = enqueued(fleet, calls("x"), "s-other")
    wait_status(fleet.dsn, other, ("succeeded",), timeout=20)
    shown = cli_in_process(fleet, "show", waiting)
    assert "waits     waiting for signal 'approve' of session 'approvals'" in shown.stdout, shown
    _approve(fleet, waiting)


def test_a_signal_publishes_the_request_that_gave_its_slot_back_at_once(fleet: Fleet) -> None:
    # Two runs give their slot back to wait for their signals. The sweeper
    # sweeps every 60 s (its first sweep 60 s after the worker starts): each
    # signal's sender publishes the request it wakes, the CLI's `signal` and
    # PostgresRuntime.signal alike (this process imports the Celery binding),
    # and each resumes within seconds, replaying its journal.
    fleet.env["LOOMFLOW_WORKER_AGENTS"] = WITH_WAITER
    fleet.start("w1", concurrency=1, pool="threads", LOOMFLOW_WORKER_PARK_AFTER="1",
                LOOMFLOW_WORKER_SWEEP_INTERVAL="60", LOOMFLOW_WORKER_HANDOFF_GRACE="1")
    by_cli, by_runtime = (
        enqueued(fleet, f'call wait_signal {{"session": "{box}", "name": "approve"}}',
                 f"s-{box}", "--agent", "approver") for box in ("by-cli", "by-runtime"))
    wait_until(lambda: _gave_its_slot_back(fleet, by_cli) and _gave_its_slot_back(
        fleet, by_runtime), "a run never gave its slot back")

    sent = time.monotonic()
    done = cli(fleet, "signal", "by-cli", "approve", '{"ok": 1}')
    assert done.returncode == 0, done.stderr
    assert f"request {by_cli}, which waited for it, published" in done.stdout, done.stdout
    wait_status(fleet.dsn, by_cli, ("succeeded",), timeout=25)
    assert time.monotonic() - sent < 20, "resumed by the sweeper, not by the signal's sender"

    async def send() -> None:
        runtime = await PostgresRuntime.connect(fleet.dsn)
        try:
            await runtime.signal("by-runtime", "approve", {"ok": 2})
        finally:
            await runtime.aclose()

    sent = time.monotonic()
    asyncio.run(send())
    wait_status(fleet.dsn, by_runtime, ("succeeded",), timeout=25)
    assert time.monotonic() - sent < 20, "resumed by the sweeper, not by the signal's sender"
    for request_id, ok in ((by_cli, 1), (by_runtime, 2)):
        row = ledger(fleet.dsn, request_id)
        assert isinstance(row["result"], dict)
        assert row["result"]["output"] == f'done: got {{"ok": {ok}}}'
        assert (row["attempts"], row["failures"], row["crashes"]) == (2, 0, 0), row
        # Two messages: the enqueue's and the sender's.
        assert fleet.wait_deliveries(request_id, 2) == 2
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM sweeper_actions"
                            " WHERE action = 'redispatch'").fetchone() == (0,)


#: Every timer of the fleet, small: a run that waits ten leases for its approval
#: outlives each of them many times over (an hour, at this scale).
SMALL_TIMERS = {"LOOMFLOW_WORKER_LEASE": "3", "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "0.5",
                "LOOMFLOW_WORKER_REDISPATCH_AFTER": "3", "LOOMFLOW_WORKER_HANDOFF_GRACE": "1",
                "LOOMFLOW_WORKER_SWEEP_INTERVAL": "0.5", "LOOMFLOW_WORKER_PARK_AFTER": "1",
                "LOOMFLOW_WORKER_VISIBILITY_TIMEOUT": "3"}


def test_a_run_waiting_long_for_approval_holds_no_slot_and_resumes_once(fleet: Fleet) -> None:
    # One slot. The approval run waits for its signal ten leases long (30 s),
    # past the lease, the heartbeat, the sweeper's redispatch, the park
    # threshold and the broker's visibility timeout, while other requests take
    # the only slot one after another. Nothing sends it again meanwhile; the
    # signal resumes it, and it succeeds once: its second attempt replays the
    # first's steps, and no crash or lost attempt is charged.
    fleet.env["LOOMFLOW_WORKER_AGENTS"] = WITH_WAITER
    fleet.start("w1", concurrency=1, pool="threads", TEST_TOOL_SLEEP="0.5", **SMALL_TIMERS)
    prompt = 'call wait_signal {"session": "approvals", "name": "approve"}'
    waiting = enqueued(fleet, prompt, "s-approve", "--agent", "approver")
    wait_until(lambda: _gave_its_slot_back(fleet, waiting), "the run never gave its slot back")
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:

        def waited() -> float:
            row = conn.execute("SELECT extract(epoch FROM now() - ended_at)::float8"
                               " FROM run_attempts WHERE request_id = %s", (waiting,)).fetchone()
            assert row is not None
            return float(row[0])

        others = []
        while waited() < 10 * float(SMALL_TIMERS["LOOMFLOW_WORKER_LEASE"]):
            other = run_agent.delay(calls(f"other{len(others)}"), f"s-other{len(others)}")
            assert other.get(timeout=30)["output"] == f"done: recorded other{len(others)}"
            others.append(other.id)
            row = ledger(fleet.dsn, waiting)
            assert (row["status"], row["attempts"]) == ("queued", 1), row
        # Nothing sent it again, or took it for lost, while it waited.
        swept = conn.execute("SELECT action FROM sweeper_actions WHERE request_id = %s",
                             (waiting,)).fetchall()
        assert swept == [], swept
    assert fleet.deliveries(waiting) == (1, 1)
    assert len(others) >= 10, others  # the slot was free for them all along

    _approve(fleet, waiting)
    received = fleet.wait_deliveries(waiting, 2)
    # Its signal's sender published it once. Only the sweeper publishes it
    # again, if its run has not started HANDOFF_GRACE (1 s here) after that,
    # as on a busy machine: a duplicate, which ran nothing (_approve counted
    # 2 attempts).
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:

        def sent_again() -> int:
            return len(conn.execute("SELECT 1 FROM sweeper_actions WHERE request_id = %s"
                                    " AND action = 'redispatch'", (waiting,)).fetchall())

        # The sweeper records what it did once its sweep ends.
        wait_until(lambda: received <= 2 + sent_again(),
                   f"{received} deliveries, {sent_again()} of them sent again by the sweeper",
                   timeout=5)
    journal = cli_in_process(fleet, "show", waiting).stdout.split("journal ", 1)[1].splitlines()
    assert any("executed in attempt 1, replayed in 2" in line for line in journal), journal
    assert steps_journaled_twice(fleet.dsn) == []


def test_signal_wakes_a_run_waiting_for_it(fleet: Fleet) -> None:
    fleet.env["LOOMFLOW_WORKER_AGENTS"] = WITH_WAITER
    fleet.start("w1", concurrency=1)
    prompt = 'call wait_signal {"session": "sig", "name": "go"}'
    request_id = enqueued(fleet, prompt, "s", "--agent", "waiter")
    wait_until(lambda: signal_listeners(fleet.dsn), "the run never waited for its signal")
    done = cli(fleet, "signal", "sig", "go", '{"x": [1, "two"]}')
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("signal 'go' sent to session 'sig' (id ")
    wait_status(fleet.dsn, request_id, ("succeeded",))
    result = ledger(fleet.dsn, request_id)["result"]
    assert isinstance(result, dict)
    assert result["output"] == 'done: got {"x": [1, "two"]}'

    # Sent before anyone waits: a row until taken, its payload in loomflow's codec.
    assert cli(fleet, "signal", "later", "ping").returncode == 0
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT session_id, name, payload FROM signals").fetchall()
    assert [(r[0], r[1], _codec.loads(bytes(r[2]))) for r in rows] == [("later", "ping", None)]
    # A scope keeps its newest SIGNALS_PER_SCOPE undelivered signals.
    for n in (1, 2):
        sent = cli(fleet, "signal", "later", "ping", str(n), LOOMFLOW_WORKER_SIGNALS_PER_SCOPE="2")
        assert sent.returncode == 0, sent.stderr
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT payload FROM signals ORDER BY id").fetchall()
    assert [_codec.loads(bytes(r[0])) for r in rows] == [1, 2]

    bad = cli_in_process(fleet, "signal", "sig", "go", "{not json")
    assert bad.returncode == 2 and "not JSON" in bad.stderr
    bad = cli_in_process(fleet, "signal", "sig", " ")
    assert bad.returncode == 2 and "signal name is empty" in bad.stderr


def test_a_signal_sent_to_a_user_reaches_only_that_users_run(fleet: Fleet) -> None:
    """Signals are scoped like journals: bob's signal on chat-42 stays bob's while
    alice's run on chat-42 waits; alice's wakes it."""
    fleet.env["LOOMFLOW_WORKER_AGENTS"] = WITH_WAITER
    fleet.start("w1", concurrency=1)
    prompt = 'call wait_signal {"session": "chat-42", "name": "go"}'
    request_id = enqueued(fleet, prompt, "chat-42", "--agent", "waiter", "--user", "alice")
    wait_until(lambda: signal_listeners(fleet.dsn), "the run never waited for its signal")
    bobs = cli(fleet, "signal", "chat-42", "go", '{"by": "bob"}', "--user", "bob")
    assert bobs.returncode == 0, bobs.stderr
    assert bobs.stdout.startswith("signal 'go' sent to session 'chat-42', user 'bob' (id ")
    # Bob's is the older signal: a waiter that took any user's would take his
    # first, and its result would say so.
    alices = cli(fleet, "signal", "chat-42", "go", '{"by": "alice"}', "--user", "alice")
    assert alices.returncode == 0, alices.stderr
    wait_status(fleet.dsn, request_id, ("succeeded",))
    result = ledger(fleet.dsn, request_id)["result"]
    assert isinstance(result, dict) and result["output"] == 'done: got {"by": "alice"}'
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT session_id, user_id, payload FROM signals").fetchall()
    assert [(r[0], r[1], _codec.loads(bytes(r[2]))) for r in rows] == [
        ("chat-42", "bob", {"by": "bob"})]
    bad = cli_in_process(fleet, "signal", "chat-42", "go", "--user", "")
    assert bad.returncode == 2 and "user_id" in bad.stderr


# ---- prune and retention ---------------------------------------------------------------------

OLD = 40 * 86400


def _seed_old_and_new(dsn: str) -> dict[str, object]:
    """Rows older than 30 days and recent ones, in every table prune touches."""
    now = time.time()
    old_ts = datetime.now(UTC) - timedelta(seconds=OLD)
    new_ts = datetime.now(UTC) - timedelta(minutes=5)
    blob = _codec.dumps("v")
    with psycopg.connect(dsn, autocommit=True) as conn:
        for i in range(5):
            conn.execute("INSERT INTO journal_steps VALUES ('idle', %s, %s, %s)",
                         (f"old{i}", blob, now - OLD))
        conn.execute("INSERT INTO journal_steps VALUES ('idle', '__run_epoch__', %s, %s)",
                     (_codec.dumps(3), now - OLD))
        conn.execute("INSERT INTO journal_steps VALUES ('idle', 'new', %s, %s)", (blob, now))
        # A scope whose request is still queued keeps even its old journal.
        conn.execute("INSERT INTO journal_steps VALUES ('busy', 'old', %s, %s)",
                     (blob, now - OLD))
        for i in range(3):
            conn.execute("INSERT INTO journal_streams VALUES ('idle', %s, %s, %s)",
                         (f"old{i}", blob, now - OLD))
        conn.execute("INSERT INTO journal_streams VALUES ('idle', 'new', %s, %s)", (blob, now))
        for i, ts in enumerate((now - OLD, now - OLD, now)):
            conn.execute(
                "INSERT INTO checkpoints VALUES ('idle', %s, 1, %s, %s)",
                (f"cp{i}", ts, Jsonb({})),
            )
        # Undelivered signals: old ones go, unless a queued request may take them.
        for name, session_id, ts in (("old0", "idle", old_ts), ("old1", "nobody", old_ts),
                                     ("new", "idle", new_ts), ("awaited", "busy", old_ts)):
            conn.execute("INSERT INTO signals (session_id, name, payload, created_at)"
                         " VALUES (%s, %s, %s, %s)", (session_id, name, blob, ts))
        # Runs outside Celery: an old one that ended and an old one that never recorded
        # its end go; one started before the cutoff that ended after it stays.
        for run_id, started, finished in (("direct-old", old_ts, old_ts),
                                          ("direct-died", old_ts, None),
                                          ("direct-long", old_ts, new_ts),
                                          ("direct-new", new_ts, new_ts)):
            conn.execute("INSERT INTO direct_runs (run_id, scope, session_id, epoch, process, pid,"
                         " started_at, finished_at) VALUES (%s, 'idle', 'idle', 1, 'web', 1,"
                         " %s, %s)", (run_id, started, finished))
        runs = [("old-ok", "succeeded", old_ts), ("old-failed", "failed", old_ts),
                ("old-dead", "dead", old_ts), ("old-cancelled", "cancelled", old_ts),
                ("new-ok", "succeeded", new_ts), ("old-queued", "queued", None)]
        for request_id, status, finished in runs:
            conn.execute(
                "INSERT INTO runs (request_id, scope, session_id, agent, prompt, status, "
                "enqueued_at, finished_at) VALUES (%s, %s, %s, 'default', 'p', %s, %s, %s)",
                (request_id, "busy" if status == "queued" else "idle",
                 "busy" if status == "queued" else "idle", status,
                 old_ts - timedelta(minutes=1) if request_id.startswith("old") else new_ts,
                 finished),
            )
            conn.execute(
                "INSERT INTO run_attempts (request_id, attempt, worker, pid, epoch) "
                "VALUES (%s, 1, 'w', 1, 0)", (request_id,),
            )
    return {"now": now}


def _left(dsn: str) -> dict[str, list[str]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        def names(sql: str) -> list[str]:
            return sorted(str(r[0]) for r in conn.execute(sql))

        return {
            "steps": names("SELECT session_id || ':' || step_name FROM journal_steps"),
            "streams": names("SELECT step_name FROM journal_streams"),
            "checkpoints": names("SELECT checkpoint_id FROM checkpoints"),
            "signals": names("SELECT name FROM signals"),
            "runs": names("SELECT request_id FROM runs"),
            "attempts": names("SELECT request_id FROM run_attempts"),
            "direct": names("SELECT run_id FROM direct_runs"),
        }


KEPT = {
    "steps": ["busy:old", "idle:__run_epoch__", "idle:new"],
    "streams": ["new"],
    "checkpoints": ["cp2"],
    "signals": ["awaited", "new"],
    "runs": ["new-ok", "old-queued"],
    "attempts": ["new-ok", "old-queued"],
    "direct": ["direct-long", "direct-new"],
}


def test_prune_deletes_old_rows_in_batches(fleet: Fleet) -> None:
    _seed_old_and_new(fleet.dsn)
    everything = _left(fleet.dsn)

    declined = cli_in_process(fleet, "prune", "--older-than", "30d", input="n\n")
    assert declined.returncode == 1
    assert ("Delete 5 journal steps, 3 journal streams, 2 checkpoints, 2 signals, "
            "2 runs outside Celery, 4 finished requests "
            "(older than 30d)?") in declined.stdout
    assert _left(fleet.dsn) == everything

    done = cli_in_process(fleet, "prune", "--older-than", "30d", "--batch-size", "2", "--yes")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        "deleted 5 journal steps, 3 journal streams, 2 checkpoints, 2 signals, "
        "2 runs outside Celery, 4 finished requests in "
    )
    assert "pruning" in done.stderr  # the progress bar
    assert _left(fleet.dsn) == KEPT

    again = cli_in_process(fleet, "prune", "--older-than", "1d12h", "--yes")
    assert (again.returncode, again.stdout.strip()) == (0, "nothing older than 1d12h to prune")


def test_the_sweeper_prunes_what_is_older_than_the_retention(fleet: Fleet) -> None:
    _seed_old_and_new(fleet.dsn)
    fleet.start("w1", concurrency=1, LOOMFLOW_WORKER_RETENTION=str(30 * 86400))
    wait_until(lambda: _left(fleet.dsn), "what is older than 30 days pruned", 30,
               until=lambda left: left == KEPT, every=0.2)
    assert "sweeper: pruned what is older than 30d" in fleet.log_text()
    # Runs go on as usual, and their fresh journal stays.
    done = cli(fleet, "enqueue", calls("kept"), "--session", "idle", "--wait")
    assert done.returncode == 0, done.stderr
    wait_sweeps_for(fleet)
    assert "idle:new" in _left(fleet.dsn)["steps"]
    assert len(_left(fleet.dsn)["steps"]) > len(KEPT["steps"])


# ---- doctor ------------------------------------------------------------------------------------


def _checks(output: str) -> dict[str, str]:
    found = {}
    for line in lines(output):
        verdict, rest = line.split(None, 1)
        name = rest.split(":", 1)[0]
        found[name] = f"{verdict} {rest}"
    return found


@pytest.mark.parametrize("scheme", ["redis://127.0.0.1:{port}/0",
                                    "amqp://guest:guest@127.0.0.1:{port}//"])
def test_doctor_shows_each_check_as_it_is_made(fleet: Fleet, scheme: str) -> None:
    # A broker that accepts the connection and never answers holds its check
    # up to the timeout, then fails it: the database's lines are out before.
    silent = socket.create_server(("127.0.0.1", 0))
    port = silent.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "loomflow_worker.cli", "doctor"],
        env={**fleet.env, "LOOMFLOW_WORKER_BROKER_URL": scheme.format(port=port)},
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert process.stdout is not None
        first = process.stdout.readline()
        assert first.startswith("OK   database: "), first
        assert process.poll() is None  # still checking the broker
        rest, _ = process.communicate(timeout=60)
    finally:
        process.kill()
        silent.close()
    assert process.returncode == 1
    assert _checks(first + rest)["broker"].startswith("FAIL broker: "), rest


def test_doctor_passes_on_a_healthy_fleet_and_says_what_to_fix(
    fleet: Fleet, empty_dsn: str
) -> None:
    done = cli(fleet, "doctor")  # a process of its own: the agents imported there
    assert done.returncode == 0, done.stdout + done.stderr
    checks = _checks(done.stdout)
    assert list(checks) == ["database", "schema", "broker", "result backend", "agents",
                            "versions", "visibility timeout", "lease", "soft shutdown"]
    assert checks["versions"] == "OK versions: no worker has recorded its agents yet"
    assert all(c.startswith("OK ") for c in checks.values()), done.stdout
    registered = checks["agents"].split("registered: ", 1)[1].split(", ")
    assert {"default", "flaky", "quick"} <= set(registered)

    bad_broker = cli_in_process(fleet, "doctor", LOOMFLOW_WORKER_BROKER_URL="redis://127.0.0.1:1/0")
    assert bad_broker.returncode == 1
    checks = _checks(bad_broker.stdout)
    assert checks["broker"].startswith("FAIL broker: redis://127.0.0.1:1/0 unreachable: ")
    assert "LOOMFLOW_WORKER_BROKER_URL" in checks["broker"]
    assert [n for n, c in checks.items() if c.startswith("FAIL")] == ["broker"]

    tight = cli_in_process(fleet, "doctor", "--json", LOOMFLOW_WORKER_GRACE_PERIOD="10",
                LOOMFLOW_WORKER_VISIBILITY_TIMEOUT="600")
    assert tight.returncode == 1
    verdicts = {c["check"]: c for c in map(json.loads, lines(tight.stdout))}
    assert not verdicts["soft shutdown"]["ok"] and not verdicts["visibility timeout"]["ok"]
    assert "grace period 10s" in verdicts["soft shutdown"]["detail"]
    assert "LOOMFLOW_WORKER_VISIBILITY_TIMEOUT" in verdicts["visibility timeout"]["hint"]
    assert cli_in_process(fleet, "doctor", "--grace-period", "60",
               LOOMFLOW_WORKER_GRACE_PERIOD="10").returncode == 0

    unmigrated = cli_in_process(fleet, "doctor", LOOMFLOW_WORKER_DATABASE_URL=empty_dsn)
    assert unmigrated.returncode == 1
    assert "run `loomflow-worker migrate`" in _checks(unmigrated.stdout)["schema"]

    no_db = cli_in_process(fleet, "doctor",
                LOOMFLOW_WORKER_DATABASE_URL="postgresql://postgres@127.0.0.1:1/nowhere")
    assert no_db.returncode == 1
    assert _checks(no_db.stdout)["database"].startswith(
        "FAIL database: can't connect to Postgres at 127.0.0.1:1/nowhere")

    no_agents = cli_in_process(fleet, "doctor",
                               LOOMFLOW_WORKER_AGENTS="tests.integration.no_such_module")
    assert no_agents.returncode == 1
    assert "can't import agents module" in _checks(no_agents.stdout)["agents"]


# ---- bad input ----------------------------------------------------------------------------------


def test_bad_input_and_unknown_requests_exit_with_their_codes(
    fleet: Fleet, empty_dsn: str
) -> None:
    for bad in ("3x", "12", "1h30d", "-5m", "1.5h"):
        done = cli_in_process(fleet, "runs", "--older-than", bad)
        assert done.returncode == 2, bad
        assert "is not a duration" in done.stderr and "30d, 12h, 90m, 45s" in done.stderr
    assert cli_in_process(fleet, "runs", "--older-than", "1d12h30m15s").returncode == 0
    assert cli_in_process(fleet, "prune", "--older-than", "", "--yes").returncode == 2

    unknown = str(uuid.uuid4())
    for command in ("show", "tail", "cancel"):
        # cancel, as enqueue and signal, sends through its process's Celery binding.
        done = (cli if command == "cancel" else cli_in_process)(fleet, command, unknown)
        assert done.returncode == 4, (command, done.stderr)
        assert f"no request {unknown!r} in the runs ledger" in done.stderr

    def enqueue(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return cli(fleet, "enqueue", calls("x"), "--session", "s", *args, **env)

    for args, message in (
        (("--metadata", "[1]"), "must be a JSON object"),
        (("--metadata", "nope"), "not JSON"),
        (("--agent", "nosuch"), "unknown agent 'nosuch'"),
        (("--timeout", "5"), "--timeout needs --wait"),
        (("--on-busy", "later"), "'later' is not one of"),
    ):
        done = enqueue(*args)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
    blank = cli(fleet, "enqueue", "  ", "--session", "s")
    assert blank.returncode == 2 and "prompt is empty" in blank.stderr
    assert cli_in_process(fleet, "runs").stdout == ""  # nothing was recorded

    # No worker: the request stays queued.
    first = enqueue()
    assert first.returncode == 0
    busy = enqueue("--on-busy", "reject")
    assert busy.returncode == 5 and "is busy" in busy.stderr
    waited = enqueue("--wait", "--timeout", "1")
    assert waited.returncode == 6 and "still queued after 1s" in waited.stderr
    tailed = cli_in_process(fleet, "tail", first.stdout.strip(), "--idle-timeout", "2")
    assert tailed.returncode == 6 and "no event of request" in tailed.stderr

    down = "postgresql://postgres@127.0.0.1:1/nowhere"
    for args in (("runs",), ("show", unknown), ("prune", "--older-than", "1d", "--yes"),
                 ("signal", "s", "go"), ("enqueue", "p", "--session", "s")):
        run = cli if args[0] in ("signal", "enqueue") else cli_in_process
        done = run(fleet, *args, LOOMFLOW_WORKER_DATABASE_URL=down,
                   LOOMFLOW_WORKER_CONNECT_TIMEOUT="2")
        assert done.returncode == 3, (args, done.stderr)
        assert "can't" in done.stderr and "127.0.0.1:1/nowhere" in done.stderr, done.stderr
    unmigrated = cli_in_process(fleet, "runs", LOOMFLOW_WORKER_DATABASE_URL=empty_dsn)
    assert unmigrated.returncode == 3 and "loomflow-worker migrate" in unmigrated.stderr
    assert "Traceback" not in unmigrated.stderr


def test_a_duration_of_thousands_of_digits_is_one_line_of_error(fleet: Fleet) -> None:
    for bad, said in (("1" * 5000 + "d", "is longer than 365000d"),
                      ("9" * 20 + "s", "is longer than 365000d"),
                      ("\u00b2d", "is not a duration")):
        done = cli_in_process(fleet, "runs", "--older-than", bad)
        assert done.returncode == 2, done.stderr[-300:]
        assert "Traceback" not in done.stderr
        (error,) = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
        assert said in error and len(error) < 400
