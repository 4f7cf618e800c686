"""Agent runs as Celery tasks, on real workers, Redis and Postgres."""

from __future__ import annotations

import time
from itertools import pairwise

from loomflow_worker.tasks import run_agent

from .celery_harness import Fleet, ledger
from .helpers import calls


def test_a_run_through_a_worker(fleet: Fleet) -> None:
    fleet.start("w1", concurrency=1)
    result = run_agent.delay(calls("a", "b"), "s1", user_id="u1")
    value = result.get(timeout=60)
    assert value["output"] == "done: recorded a, recorded b"
    assert value["request_id"] == result.id
    row = ledger(fleet.dsn, result.id)
    assert row["status"] == "succeeded" and row["attempts"] == 1 and row["epoch"] == 0


def _executions(dsn: str) -> list[tuple[str, int, object, object]]:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT tag, pid, started_at, finished_at FROM loomflow_worker_effects ORDER BY id"
        ).fetchall()
    return [(r[0], r[1], r[2], r[3]) for r in rows]


def _counts(dsn: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for tag, *_ in _executions(dsn):
        found[tag] = found.get(tag, 0) + 1
    return found


def test_forty_requests_on_five_sessions_keep_order_and_never_overlap(fleet: Fleet) -> None:
    fleet.start("w1", concurrency=2, TEST_TOOL_SLEEP="0.02")
    fleet.start("w2", concurrency=2, TEST_TOOL_SLEEP="0.02")
    sent = []
    for i in range(40):
        session = f"s{i % 5}"
        tags = (f"{session}-r{i:02d}-a", f"{session}-r{i:02d}-b")
        sent.append((session, i, tags, run_agent.delay(calls(*tags), session, user_id="u")))
    for _session, _i, tags, result in sent:
        assert result.get(timeout=120)["output"] == f"done: recorded {tags[0]}, recorded {tags[1]}"
    executions = _executions(fleet.dsn)
    assert sorted(e[0] for e in executions) == sorted(t for *_, tags, _ in sent for t in tags)
    for k in range(5):
        mine = [e for e in executions if e[0].startswith(f"s{k}-")]
        mine.sort(key=lambda e: e[2])
        # enqueue order kept: request numbers never go down in execution order
        order = [int(e[0].split("-r")[1][:2]) for e in mine]
        assert order == sorted(order), order
        # no overlap: each execution ends before the next one of the session starts
        for earlier, later in pairwise(mine):
            assert earlier[3] <= later[2], (earlier, later)
    assert {ledger(fleet.dsn, r.id)["status"] for *_, r in sent} == {"succeeded"}


def _wait_for_execution(
    dsn: str, tag: str, timeout: float = 60
) -> tuple[str, int, object, object]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for execution in _executions(dsn):
            if execution[0] == tag and execution[3] is None:
                return execution
        time.sleep(0.02)
    raise AssertionError(f"{tag} never started")


def test_sigkill_of_a_pool_child_mid_tool(fleet: Fleet) -> None:
    import os
    import signal

    fleet.start("w1", concurrency=1, TEST_TOOL_SLEEP="0.5")
    result = run_agent.delay(calls("t1", "t2", "t3"), "s", user_id="u")
    _, pid, _, _ = _wait_for_execution(fleet.dsn, "t2")
    os.kill(pid, signal.SIGKILL)
    assert result.get(timeout=60)["output"] == "done: recorded t1, recorded t2, recorded t3"
    counts = _counts(fleet.dsn)
    assert counts["t1"] == 1 and counts["t3"] == 1
    assert 1 <= counts["t2"] <= 2
    row = ledger(fleet.dsn, result.id)
    assert row["status"] == "succeeded" and row["attempts"] == 2 and row["crashes"] == 1


def test_a_worker_killed_after_the_commit_returns_the_stored_result(
    fleet: Fleet, tmp_path: object
) -> None:
    from pathlib import Path

    marker = Path(str(tmp_path)) / "died"
    fleet.start("w1", concurrency=1, TEST_DIE_AFTER_COMMIT=str(marker))
    result = run_agent.delay(calls("x"), "s")
    value = result.get(timeout=60)
    assert marker.exists()  # the child died once, after its commit
    assert value["output"] == "done: recorded x"
    assert _counts(fleet.dsn) == {"x": 1}
    row = ledger(fleet.dsn, result.id)
    assert row["status"] == "succeeded" and row["attempts"] == 1
    assert "succeeded before the worker was lost" not in fleet.log_text()


def test_duplicates_of_a_running_request_neither_run_beside_it_nor_get_lost(
    fleet: Fleet,
) -> None:
    from loomflow_worker.tasks.ledger import Pending

    env = {"TEST_TOOL_SLEEP": "0.4", "LOOMFLOW_WORKER_VISIBILITY_TIMEOUT": "1"}
    fleet.start("w1", concurrency=2, **env)
    fleet.start("w2", concurrency=2, **env)
    prompt = calls("d1", "d2", "d3")
    result = run_agent.delay(prompt, "s")
    _wait_for_execution(fleet.dsn, "d1")
    duplicate = Pending(result.id, "run", "s", None, "default", prompt, {})
    for _ in range(3):
        run_agent.dispatch(duplicate)
    assert result.get(timeout=60)["output"] == "done: recorded d1, recorded d2, recorded d3"
    time.sleep(1.0)  # let the duplicates land
    for _ in range(2):  # and once more after it finished
        run_agent.dispatch(duplicate)
    time.sleep(1.0)
    assert _counts(fleet.dsn) == {"d1": 1, "d2": 1, "d3": 1}
    executions = sorted(_executions(fleet.dsn), key=lambda e: e[2])
    for earlier, later in pairwise(executions):
        assert earlier[3] <= later[2]
    row = ledger(fleet.dsn, result.id)
    assert row["status"] == "succeeded" and row["attempts"] == 1
