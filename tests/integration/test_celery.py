"""Agent runs as Celery tasks, on real workers, Redis and Postgres."""

from __future__ import annotations

import json
import re
from itertools import pairwise

import pytest

from loomflow_worker.tasks import run_agent

from .celery_harness import Fleet, ledger
from .helpers import (
    calls,
    steps_journaled_twice,
    tool_counts,
    tool_executions,
    wait_for_execution,
)


@pytest.mark.slow
def test_a_run_through_a_worker(fleet: Fleet) -> None:
    fleet.start("w1", concurrency=1)
    result = run_agent.delay(calls("a", "b"), "s1", user_id="u1")
    value = result.get(timeout=60)
    assert value["output"] == "done: recorded a, recorded b"
    assert value["request_id"] == result.id
    row = ledger(fleet.dsn, result.id)
    assert row["status"] == "succeeded" and row["attempts"] == 1 and row["epoch"] == 0


@pytest.mark.slow
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
    executions = tool_executions(fleet.dsn)
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


@pytest.mark.slow
def test_a_handoff_publishes_only_a_request_whose_message_was_parked(fleet: Fleet) -> None:
    # No sweeper: a request the handoff failed to reach would never run, so
    # every result arriving proves none was lost. A request whose message is
    # still on its way when its turn comes is not published again: no
    # request is delivered after it finished.
    for name in ("w1", "w2"):
        fleet.start(name, concurrency=2, TEST_TOOL_SLEEP="0.01", LOOMFLOW_WORKER_SWEEPER="false")
    sent = [
        run_agent.delay(calls(f"h{i}"), f"s{i % 6}", user_id="u") for i in range(60)
    ]
    for i, result in enumerate(sent):
        assert result.get(timeout=60)["output"] == f"done: recorded h{i}"
    logs = [p.read_text(errors="replace") for p in fleet.logs.glob("*.log")]
    received = sum(len(re.findall(r"run_agent\[[^]]+\] received", text)) for text in logs)
    parked = sum(text.count(" parked") for text in logs)
    # A request retried (its attempt failed and goes again) was published once more too.
    retried = sum(len(re.findall(r"run_agent\[[^]]+\] retry: ", text)) for text in logs)
    duplicates = sum(text.count(" already succeeded") for text in logs)
    assert duplicates == 0, fleet.log_text()
    # Each message parked was published once more, and that copy ran it.
    assert received == len(sent) + parked + retried, (received, parked, retried,
                                                      fleet.log_text())
    assert {ledger(fleet.dsn, r.id)["status"] for r in sent} == {"succeeded"}


@pytest.mark.slow
def test_sigkill_of_a_pool_child_mid_tool(fleet: Fleet) -> None:
    import os
    import signal

    fleet.start("w1", concurrency=1, TEST_TOOL_SLEEP="0.5")
    result = run_agent.delay(calls("t1", "t2", "t3"), "s", user_id="u")
    _, pid, _, _ = wait_for_execution(fleet.dsn, "t2")
    os.kill(pid, signal.SIGKILL)
    assert result.get(timeout=60)["output"] == "done: recorded t1, recorded t2, recorded t3"
    counts = tool_counts(fleet.dsn)
    assert counts["t1"] == 1 and counts["t3"] == 1
    assert 1 <= counts["t2"] <= 2
    row = ledger(fleet.dsn, result.id)
    assert row["status"] == "succeeded" and row["attempts"] == 2 and row["crashes"] == 1
    assert steps_journaled_twice(fleet.dsn) == []


@pytest.mark.slow
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
    assert tool_counts(fleet.dsn) == {"x": 1}
    row = ledger(fleet.dsn, result.id)
    assert row["status"] == "succeeded" and row["attempts"] == 1
    assert "succeeded before the worker was lost" not in fleet.log_text()


@pytest.mark.slow
def test_duplicates_of_a_running_request_neither_run_beside_it_nor_get_lost(
    fleet: Fleet,
) -> None:
    from loomflow_worker.execution.pending import Pending

    env = {"TEST_TOOL_SLEEP": "0.4", "LOOMFLOW_WORKER_VISIBILITY_TIMEOUT": "1"}
    fleet.start("w1", concurrency=2, **env)
    fleet.start("w2", concurrency=2, **env)
    prompt = calls("d1", "d2", "d3")
    result = run_agent.delay(prompt, "s")
    wait_for_execution(fleet.dsn, "d1")
    duplicate = Pending(result.id, "run", "s", None, "default", prompt, {})
    for _ in range(3):
        run_agent.dispatch(duplicate)
    assert result.get(timeout=60)["output"] == "done: recorded d1, recorded d2, recorded d3"
    delivered = fleet.wait_deliveries(result.id, 4)  # the duplicates landed and ended
    for _ in range(2):  # and once more after it finished
        run_agent.dispatch(duplicate)
    fleet.wait_deliveries(result.id, delivered + 2)
    assert tool_counts(fleet.dsn) == {"d1": 1, "d2": 1, "d3": 1}
    executions = sorted(tool_executions(fleet.dsn), key=lambda e: e[2])
    for earlier, later in pairwise(executions):
        assert earlier[3] <= later[2]
    row = ledger(fleet.dsn, result.id)
    assert row["status"] == "succeeded" and row["attempts"] == 1


@pytest.mark.slow
def test_a_crashed_request_resumes_before_a_newer_one_in_its_own_namespace(
    fleet: Fleet,
) -> None:
    import os
    import signal

    fleet.start("w1", concurrency=2, TEST_TOOL_SLEEP="0.4")
    crashed = run_agent.delay(calls("old1", "old2"), "s")
    _, pid, _, _ = wait_for_execution(fleet.dsn, "old2")
    newer = run_agent.delay(calls("new1"), "s")
    fleet.wait_logged(f"request {newer.id} parked")  # it arrives while the old one runs
    os.kill(pid, signal.SIGKILL)
    assert crashed.get(timeout=60)["output"] == "done: recorded old1, recorded old2"
    assert newer.get(timeout=60)["output"] == "done: recorded new1"
    counts = tool_counts(fleet.dsn)
    assert counts["old1"] == 1 and counts["new1"] == 1 and counts["old2"] <= 2
    executions = sorted(tool_executions(fleet.dsn), key=lambda e: e[2])
    assert executions[-1][0] == "new1"  # the newer request ran after the resumed one
    old, new = ledger(fleet.dsn, crashed.id), ledger(fleet.dsn, newer.id)
    assert (old["epoch"], old["crashes"], old["attempts"]) == (0, 1, 2)
    assert new["epoch"] == 1


@pytest.mark.slow
def test_a_request_that_kills_its_worker_every_time_ends_dead(fleet: Fleet) -> None:
    from loomflow_worker.tasks import RunDead

    fleet.start("w1", concurrency=1)
    poison = run_agent.delay(calls("poison"), "s")
    after = run_agent.delay(calls("after"), "s")
    with pytest.raises(RunDead, match="died 3 times"):
        poison.get(timeout=90)
    assert after.get(timeout=60)["output"] == "done: recorded after"
    row = ledger(fleet.dsn, poison.id)
    assert row["status"] == "dead" and row["crashes"] == 3 and row["error_type"] == "WorkerDied"
    assert tool_counts(fleet.dsn) == {"poison": 3, "after": 1}
    assert ledger(fleet.dsn, after.id)["epoch"] == 1


@pytest.mark.slow
def test_an_error_retries_with_backoff_replaying_the_journal(fleet: Fleet) -> None:
    fleet.start("w1", concurrency=1, TEST_FLAKY_FAILURES="1")
    result = run_agent.delay("flaky\n" + calls("once"), "s", agent="flaky")
    assert result.get(timeout=60)["output"] == "done: recorded once"
    row = ledger(fleet.dsn, result.id)
    assert row["status"] == "succeeded" and row["failures"] == 1 and row["attempts"] == 2
    assert row["crashes"] == 0
    assert tool_counts(fleet.dsn) == {"once": 1}
    # The retry message itself brought the second attempt, after its backoff:
    # the sweeper sends a queued request again only after the handoff grace (5 s).
    assert _retry_gaps(fleet.dsn, result.id)[0] < 4


def _retry_gaps(dsn: str, request_id: str) -> list[float]:
    """Seconds from the end of each attempt to the start of the next."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT started_at, ended_at FROM run_attempts WHERE request_id = %s "
            "ORDER BY attempt",
            (request_id,),
        ).fetchall()
    assert len(rows) > 1, rows
    return [(later[0] - earlier[1]).total_seconds() for earlier, later in pairwise(rows)]


@pytest.mark.slow
def test_past_the_retry_limit_a_request_fails_and_the_session_moves_on(fleet: Fleet) -> None:
    from loomflow_worker.tasks import RunFailed

    fleet.start("w1", concurrency=1, TEST_FLAKY_FAILURES="100", LOOMFLOW_WORKER_MAX_RETRIES="2")
    failing = run_agent.delay("flaky\n" + calls("never"), "s", agent="flaky")
    after = run_agent.delay(calls("next"), "s", agent="flaky")
    with pytest.raises(RunFailed, match="model overloaded"):
        failing.get(timeout=60)
    assert after.get(timeout=60)["output"] == "done: recorded next"
    row = ledger(fleet.dsn, failing.id)
    assert row["status"] == "failed" and row["attempts"] == 3 and row["failures"] == 2
    assert "model overloaded" in str(row["error"])
    assert max(_retry_gaps(fleet.dsn, failing.id)) < 4
    # The request's own line says why, at ERROR; Celery's says it ended so, at
    # INFO, with no traceback.
    log = (fleet.logs / "w1.log").read_text(errors="replace")
    assert any("ERROR/" in line and f"request {failing.id} failed after 3 attempts: "
               "RuntimeError: model overloaded" in line for line in log.splitlines()), log[-3000:]
    assert f"run_agent[{failing.id}] raised expected: RunFailed(" in log, log[-3000:]
    assert "raised unexpected" not in log, log[-3000:]


def _queue_length(fleet: Fleet) -> int:
    import redis

    from .celery_harness import REDIS_URL

    client = redis.Redis.from_url(REDIS_URL)
    try:
        return int(client.llen(f"{fleet.prefix}{fleet.queue}"))
    finally:
        client.close()


def _ledger_size(dsn: str) -> int:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM runs").fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("hi", "s"), {"agent": "nope"}, "unknown agent 'nope'"),
        (("", "s"), {}, "prompt is empty"),
        (("x" * 200_001, "s"), {}, "200001 characters"),
        (("hi", ""), {}, "session_id is empty"),
        (("hi", "a\nb"), {}, "control character"),
        (("hi", "s"), {"user_id": "u\x00"}, "user_id has a control character"),
        (("hi", "s"), {"metadata": {"when": object()}}, "metadata isn't JSON"),
        (("hi", "s"), {"metadata": ["a"]}, "must be a JSON object"),
        (("hi", "s"), {"surprise": 1}, "unexpected keyword argument 'surprise'"),
    ],
)
def test_bad_input_at_delay_is_refused_with_nothing_written_or_sent(
    fleet: Fleet, args: tuple[object, ...], kwargs: dict[str, object], message: str
) -> None:
    from loomflow_worker.runtime import InvalidInput

    with pytest.raises(InvalidInput, match=message):
        run_agent.delay(*args, **kwargs)
    assert _ledger_size(fleet.dsn) == 0
    assert _queue_length(fleet) == 0


@pytest.mark.slow
def test_bad_input_sent_by_task_name_fails_without_retry(fleet: Fleet) -> None:
    from loomflow_worker.tasks import RunFailed, app

    fleet.start("w1", concurrency=1)
    raw = app.send_task("loomflow_worker.run_agent", args=["", "s"])
    with pytest.raises(RunFailed, match="prompt is empty"):
        raw.get(timeout=60)
    unknown = app.send_task(
        "loomflow_worker.run_agent", args=["hi", "s"], kwargs={"agent": "nope"}
    )
    with pytest.raises(RunFailed, match="unknown agent"):
        unknown.get(timeout=60)
    for result in (raw, unknown):
        row = ledger(fleet.dsn, result.id)
        assert row["status"] == "failed" and row["attempts"] == 0
    assert tool_counts(fleet.dsn) == {}


@pytest.mark.slow
def test_a_message_sent_by_name_gets_its_ledger_row_on_receipt(fleet: Fleet) -> None:
    from loomflow_worker.tasks import app

    fleet.start("w1", concurrency=1)
    result = app.send_task(
        "loomflow_worker.run_agent", args=[calls("by-name"), "s"], kwargs={"user_id": "u"}
    )
    assert result.get(timeout=60)["output"] == "done: recorded by-name"
    assert ledger(fleet.dsn, result.id)["status"] == "succeeded"


@pytest.mark.slow
def test_resume_agent_continues_the_last_run(fleet: Fleet) -> None:
    from loomflow_worker.tasks import resume_agent

    fleet.start("w1", concurrency=1)
    first = run_agent.delay(calls("r1", "r2"), "s")
    assert first.get(timeout=60)["output"] == "done: recorded r1, recorded r2"
    resumed = resume_agent.delay(calls("r1", "r2"), "s")
    assert resumed.get(timeout=60)["output"] == "done: recorded r1, recorded r2"
    assert tool_counts(fleet.dsn) == {"r1": 1, "r2": 1}  # every tool call replayed
    assert ledger(fleet.dsn, resumed.id)["epoch"] == 0
    fresh = run_agent.delay(calls("r1"), "s")
    assert fresh.get(timeout=60)["output"] == "done: recorded r1"
    assert tool_counts(fleet.dsn) == {"r1": 2, "r2": 1}


@pytest.mark.slow
def test_a_visibility_timeout_shorter_than_the_run_starts_no_second_copy(fleet: Fleet) -> None:
    # Redis hands the unacked message out again while the run is still going:
    # the copy parks, nothing runs twice, one result.
    env = {
        "TEST_TOOL_SLEEP": "1.5",
        "LOOMFLOW_WORKER_VISIBILITY_TIMEOUT": "1",
        "LOOMFLOW_WORKER_BROKER_TRANSPORT_OPTIONS": json.dumps(
            {"unacked_restore_interval": 1, "unacked_restore_throttle": 1}
        ),
    }
    fleet.start("w1", concurrency=2, **env)
    fleet.start("w2", concurrency=2, **env)
    result = run_agent.delay(calls("v1", "v2", "v3"), "s")
    assert result.get(timeout=90)["output"] == "done: recorded v1, recorded v2, recorded v3"
    fleet.wait_deliveries(result.id, 2)  # the broker redelivered, and the copy ended
    assert tool_counts(fleet.dsn) == {"v1": 1, "v2": 1, "v3": 1}
    executions = sorted(tool_executions(fleet.dsn), key=lambda e: e[2])
    for earlier, later in pairwise(executions):
        assert earlier[3] <= later[2]
    row = ledger(fleet.dsn, result.id)
    assert row["status"] == "succeeded" and row["attempts"] == 1
