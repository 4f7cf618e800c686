"""A worker that loses its database connections and lives is not a crash."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import psycopg
import pytest

from loomflow_worker.tasks import run_agent
from tests.chaos.checks import kill_postgres_backends
from tests.integration.celery_harness import Fleet, ledger, wait_status
from tests.integration.helpers import calls, wait_until

pytestmark = pytest.mark.slow


def _end_lock_connections(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = 'loomflow-worker lock'"
        ).fetchall()
    return len(rows)


def _in_a_tool(dsn: str, request_id: str, attempt: int) -> bool:
    """Whether attempt ``attempt`` of ``request_id`` has started a tool call."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT EXISTS (SELECT FROM run_attempts a, loomflow_worker_effects e"
            " WHERE a.request_id = %s AND a.attempt = %s AND e.started_at > a.started_at)",
            (request_id, attempt),
        ).fetchone()
    return bool(row and row[0])


def _outcomes(dsn: str, request_id: str) -> list[str | None]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT outcome FROM run_attempts WHERE request_id = %s ORDER BY attempt",
            (request_id,),
        ).fetchall()
    return [r[0] for r in rows]


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_lost_lock_connections_do_not_count_as_crashes(fleet: Fleet, pool: str) -> None:
    # MAX_CRASHES=1: a single counted crash would end the request dead.
    fleet.start("w1", concurrency=2, pool=pool, TEST_TOOL_SLEEP="0.8",
                LOOMFLOW_WORKER_MAX_CRASHES="1", LOOMFLOW_WORKER_HEARTBEAT_INTERVAL="0.5")
    result = run_agent.delay(calls(*(f"x{i}" for i in range(6))), "s")
    for cut in range(3):
        wait_status(fleet.dsn, result.id, ("running",), timeout=30)
        wait_until(partial(_in_a_tool, fleet.dsn, result.id, cut + 1),
                   f"attempt {cut + 1} never started a tool call")
        assert _end_lock_connections(fleet.dsn) >= 1
    assert result.get(timeout=60)["output"].startswith("done: recorded x0")
    row = ledger(fleet.dsn, result.id)
    assert row["status"] == "succeeded" and row["crashes"] == 0
    outcomes = _outcomes(fleet.dsn, result.id)
    assert outcomes.count("lost") >= 2, outcomes


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_connection_lost_while_a_request_starts_is_no_crash(
    fleet: Fleet, tmp_path: Path, when: str
) -> None:
    # The first start of the request holds its lock connection (before its
    # statement, or after it committed its attempt) until every connection
    # to the database is ended, as a Postgres restart ends them.
    # MAX_CRASHES=1: a start charged as a crash would end the request dead.
    marker = tmp_path / "held"
    fleet.start("w1", concurrency=4, pool="threads", cli=True,
                TEST_HOLD_START=f"{when}:{marker}", LOOMFLOW_WORKER_MAX_CRASHES="1",
                LOOMFLOW_WORKER_HEARTBEAT_INTERVAL="0.5")
    first = run_agent.delay(calls("x1", "x2"), "s")
    behind = run_agent.delay(calls("y1"), "s")
    wait_until(marker.exists, "the first request held in its tool call", 30,
               detail=fleet.log_text)
    _, ended = kill_postgres_backends(fleet.dsn)
    assert ended["loomflow-worker lock"] >= 1, ended
    assert first.get(timeout=60)["output"] == "done: recorded x1, recorded x2"
    assert behind.get(timeout=60)["output"] == "done: recorded y1"
    row = ledger(fleet.dsn, first.id)
    assert row["status"] == "succeeded" and row["crashes"] == 0, (row, fleet.log_text())
    # A start that committed was lost, not crashed; one that did not never counted.
    assert _outcomes(fleet.dsn, first.id) == (
        ["lost", "succeeded"] if when == "after" else ["succeeded"]), fleet.log_text()
    log = (fleet.logs / "w1.log").read_text()
    assert f"request {first.id}: " in log and "retrying in" in log, log


def _attempts(dsn: str, request_id: str) -> list[tuple[int, str, object, object, str | None]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            "SELECT attempt, worker, started_at, ended_at, outcome FROM run_attempts"
            " WHERE request_id = %s ORDER BY attempt",
            (request_id,),
        ).fetchall()


def test_a_duplicate_waits_for_the_attempt_whose_lock_connection_alone_ended(
    fleet: Fleet,
) -> None:
    # G3. w1's lock connection alone ends while its tool runs: Postgres frees
    # the lock at once, but w1 learns of it only at its next heartbeat (up to
    # 8 s later here) and runs its tool until then. A duplicate of the request's
    # message reaches w2 at once and takes the freed lock: its attempt must not
    # start before w1's attempt has stopped and recorded its end.
    from loomflow_worker.execution.pending import Pending

    # w1 hears of its lost connection up to a heartbeat (8 s) later, in a 12 s
    # tool: time enough for w2 to start (seconds on a busy machine) and for the
    # duplicate to reach it.
    env = {"TEST_TOOL_SLEEP": "12", "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "8"}
    fleet.start("w1", concurrency=1, pool="threads", **env)
    prompt = calls("d1", "d2")
    result = run_agent.delay(prompt, "s")
    wait_until(partial(_in_a_tool, fleet.dsn, result.id, 1), "attempt 1 never started a tool")
    # w2's tool calls are short: once its attempt starts, what it must wait
    # for is behind it. It takes a queue of its own, where the duplicate goes:
    # on the fleet's queue, w1 (its pool busy, one message more reserved)
    # could take it and run it only after its own attempt had stopped.
    own = f"{fleet.queue}-w2"
    fleet.start("w2", concurrency=1, pool="threads", args=("-Q", own),
                **{**env, "TEST_TOOL_SLEEP": "0.5"})
    with psycopg.connect(fleet.dsn, autocommit=True) as admin:
        ended = admin.execute(
            "SELECT pg_terminate_backend(holder_pid, 5000) FROM runs WHERE request_id = %s",
            (result.id,),
        ).fetchone()
    assert ended == (True,)
    run_agent.dispatch(Pending(result.id, "run", "s", None, "default", prompt, {},
                               routing={"queue": own}))
    assert result.get(timeout=60)["output"] == "done: recorded d1, recorded d2"
    attempts = _attempts(fleet.dsn, result.id)
    first, second = attempts[0], attempts[1]
    assert first[1].startswith("w1-") and first[4] == "lost", (attempts, fleet.log_text())
    assert second[1].startswith("w2-"), (attempts, fleet.log_text())
    assert first[3] is not None and second[2] >= first[3], (attempts, fleet.log_text())
    assert ledger(fleet.dsn, result.id)["crashes"] == 0
    fleet.wait_logged(f"request {result.id}: its previous attempt may still be running")
