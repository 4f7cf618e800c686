"""Messages on the wire are untrusted: published raw to a real worker's queue,
a body of the wrong shape, arguments that differ from the ledger's, an id
Postgres can't index. Real Postgres, Redis and workers."""

from __future__ import annotations

import secrets
import uuid
from typing import Any

import psycopg
import pytest
import redis
from psycopg.rows import dict_row

from loomflow_worker.runtime import InvalidInput
from loomflow_worker.tasks import RunFailed, app, run_agent

from .celery_harness import REDIS_URL, Fleet, ledger
from .helpers import calls, scrape, tool_counts, wait_until
from .services import free_port

pytestmark = pytest.mark.slow

RUN_AGENT = "loomflow_worker.run_agent"


def publish_raw(fleet: Fleet, body: Any, task_id: Any, **headers: Any) -> None:
    """Publish ``body`` as a ``run_agent`` message of protocol 2 (with
    ``headers``), as anyone with access to the broker can, past every check
    ``apply_async`` makes."""
    with app.producer_or_acquire() as producer:
        producer.publish(
            body, routing_key=fleet.queue, serializer="json",
            headers={"lang": "py", "task": RUN_AGENT, "id": task_id, **headers},
        )


def _broker_holds(fleet: Fleet) -> int:
    """Messages the broker still holds for the fleet: waiting in its queue,
    or delivered and not acked yet."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        waiting = sum(int(client.llen(key))
                      for key in client.scan_iter(match=f"{fleet.prefix}{fleet.queue}*"))
        return waiting + int(client.hlen(f"{fleet.prefix}unacked"))
    finally:
        client.close()


def _wait_broker_empty(fleet: Fleet, timeout: float = 30) -> None:
    wait_until(lambda: _broker_holds(fleet), "the broker empty (seen as: messages it holds)",
               timeout, until=lambda held: held == 0, every=0.05)


GOOD_BODY: list[Any] = [["p", "s"], {}, None]
# Each a message Celery's consumer can't take apart (in its main process): the
# body, headers besides the task's name and id, and what the worker says of it.
BAD_MESSAGES: list[tuple[Any, dict[str, Any], str]] = [
    ("a string", {}, "its body is a str, not [args, kwargs, embed]"),
    ([1], {}, "its body is a list of 1, not [args, kwargs, embed]"),
    ([[], {}], {}, "its body is a list of 2, not [args, kwargs, embed]"),
    (None, {}, "its body is null, not [args, kwargs, embed]"),
    ({}, {}, "its body is a dict, not [args, kwargs, embed]"),
    (["p", {}, None], {}, "its args are a str, not a list"),
    ([[], [], None], {}, "its kwargs are a list of 0, not an object with string keys"),
    ([[], {}, "x"], {}, "its embed is a str, not an object"),
    ([[], {}, {"callbacks": "x"}], {}, "its embed's callbacks is a str, not a list of sig"),
    ([[], {}, {"chord": 5}], {}, "its embed's chord is 5, not a signature"),
    (GOOD_BODY, {"timelimit": "abc"}, "its timelimit header is a str, not [soft, hard]"),
    (GOOD_BODY, {"timelimit": [1]}, "its timelimit header is a list of 1, not [soft, hard]"),
    (GOOD_BODY, {"retries": "x"}, "its retries header is a str, not a count"),
    # Protocol 1's body (an object) under protocol 2's headers: Celery reads both.
    ({"args": "p", "kwargs": {}}, {}, "its args are a str, not a list"),
    ({"args": [], "kwargs": {}, "timelimit": "abc"}, {}, "its timelimit header is a str"),
]


@pytest.mark.parametrize("cli", [True, False], ids=["loomflow-worker", "celery-prefork"])
def test_a_message_of_the_wrong_shape_is_dropped_and_the_worker_lives(
    fleet: Fleet, cli: bool
) -> None:
    port = free_port()
    worker = fleet.start("w1", concurrency=1, cli=cli, pool="prefork",
                         LOOMFLOW_WORKER_METRICS_PORT=str(port))
    bad_ids = [str(uuid.uuid4()) for _ in BAD_MESSAGES]
    for (body, headers, _), task_id in zip(BAD_MESSAGES, bad_ids, strict=True):
        publish_raw(fleet, body, task_id, **headers)
    # A well-shaped body with an id the ledger can't hold (or none at all).
    publish_raw(fleet, GOOD_BODY, "x" * 100_000)
    publish_raw(fleet, GOOD_BODY, None)

    valid = run_agent.delay(calls("after"), "s1")
    assert valid.get(timeout=60)["output"] == "done: recorded after"
    assert worker.poll() is None, fleet.log_text()
    _wait_broker_empty(fleet)
    assert tool_counts(fleet.dsn) == {"after": 1}
    log = (fleet.logs / "w1.log").read_text()
    for (_, _, problem), task_id in zip(BAD_MESSAGES, bad_ids, strict=True):
        assert f"message {task_id} refused and dropped: {problem}" in log
    assert "its id is 100000 characters long" in log
    assert "its id must be a string, not NoneType" in log
    assert "Unrecoverable error" not in log
    refused = scrape(port)['loomflow_worker_messages_refused_total{reason="malformed"}']
    assert refused == len(BAD_MESSAGES) + 2
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        found = conn.execute("SELECT count(*) FROM runs").fetchone()
    assert found == (1,)  # the valid request's row only


def _row(dsn: str, request_id: str) -> dict[str, Any]:
    """Every column of the request's ledger row but ``held_at``: the worker
    holding the request's own message (a countdown) stamps that one every
    sweep, whatever else arrives."""
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        found = conn.execute("SELECT * FROM runs WHERE request_id = %s", (request_id,)).fetchone()
    assert found is not None
    return {column: value for column, value in found.items() if column != "held_at"}


def _wait_logged(fleet: Fleet, name: str, text: str, timeout: float = 30) -> None:
    log = fleet.logs / f"{name}.log"
    wait_until(lambda: log.exists() and text in log.read_text(errors="replace"),
               f"{name} logged {text!r}", timeout, every=0.05, detail=fleet.log_text)


def _release(dsn: str, request_id: str) -> None:
    """Let a request that waits for its countdown start now: the ledger says
    it may, and that its message is gone, so the sweeper publishes it again."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE runs SET not_before = now() - interval '1 minute', "
                     "dispatched_at = '-infinity' WHERE request_id = %s", (request_id,))


@pytest.mark.parametrize(
    ("args", "kwargs", "differ"),
    [
        ([calls("bob"), "s-bob"], {"user_id": "bob", "metadata": {"who": "bob"}},
         "its session_id, user_id, prompt, metadata differ"),
        (["", "s-alice"], {"user_id": "alice"}, "its prompt differs"),
    ],
    ids=["other-arguments", "invalid-prompt"],
)
def test_a_message_reusing_a_request_id_never_runs_and_never_changes_its_row(
    fleet: Fleet, args: list[Any], kwargs: dict[str, Any], differ: str
) -> None:
    port = free_port()
    fleet.start("w1", concurrency=1, LOOMFLOW_WORKER_METRICS_PORT=str(port),
                LOOMFLOW_WORKER_HANDOFF_GRACE="0.5", LOOMFLOW_WORKER_SWEEP_INTERVAL="0.3")
    # Not ASCII: the prompt is compared by its hash, on both sides as UTF-8.
    alice = run_agent.apply_async((calls("alicé ✓"), "s-alice"), {"user_id": "alice"},
                                  countdown=3600)
    before = _row(fleet.dsn, alice.id)
    app.send_task(RUN_AGENT, args=args, kwargs=kwargs, task_id=alice.id)
    # Alice's own message waits for its countdown: a task under her id that
    # ended is the other message.
    fleet.wait_tasks_ended("w1", [alice.id])
    assert _row(fleet.dsn, alice.id) == before
    assert tool_counts(fleet.dsn) == {}
    _wait_logged(fleet, "w1", f"message {alice.id} refused and dropped: {differ} from the "
                              "request the runs ledger holds under that id")
    assert scrape(port)['loomflow_worker_messages_refused_total{reason="mismatch"}'] == 1

    _release(fleet.dsn, alice.id)
    assert alice.get(timeout=60)["output"] == "done: recorded alicé ✓"
    assert tool_counts(fleet.dsn) == {"alicé ✓": 1}
    assert ledger(fleet.dsn, alice.id)["status"] == "succeeded"


def test_a_message_reusing_a_finished_request_id_gets_nothing_and_changes_nothing(
    fleet: Fleet,
) -> None:
    fleet.start("w1", concurrency=1)
    alice = run_agent.delay(calls("alice"), "s-alice", user_id="alice")
    assert alice.get(timeout=60)["output"] == "done: recorded alice"
    before = _row(fleet.dsn, alice.id)
    app.send_task(RUN_AGENT, args=[calls("bob"), "s-bob"], task_id=alice.id)
    _wait_logged(fleet, "w1", f"message {alice.id} refused and dropped: its session_id, "
                              "user_id, prompt differ")
    _wait_broker_empty(fleet)
    assert _row(fleet.dsn, alice.id) == before
    assert run_agent.AsyncResult(alice.id).get(timeout=10)["output"] == "done: recorded alice"
    assert tool_counts(fleet.dsn) == {"alice": 1}


def _incompressible(length: int) -> str:
    """Random text Postgres can't compress into an index entry."""
    return secrets.token_urlsafe(length)[:length]


def test_an_id_too_long_to_index_ends_the_request_failed_once(fleet: Fleet) -> None:
    fleet.start("w1", concurrency=1)
    session = _incompressible(200_000)
    huge = app.send_task(RUN_AGENT, args=[calls("x"), session],
                         kwargs={"user_id": _incompressible(100_000),
                                 "agent": _incompressible(100_000)})
    with pytest.raises(RunFailed, match="session_id is 200000 characters long; the limit is 512"):
        huge.get(timeout=60)
    fleet.wait_tasks_ended("w1", [huge.id])
    row = _row(fleet.dsn, huge.id)
    assert (row["status"], row["attempts"], row["failures"]) == ("failed", 0, 0)
    assert len(row["session_id"]) == len(row["user_id"]) == len(row["agent"]) == 512
    assert row["session_id"] == session[:509] + "..."
    log = (fleet.logs / "w1.log").read_text()
    assert log.count(f"[{huge.id}] received") == 1
    assert f"[{huge.id}] retry" not in log
    # Ids within 512 characters but too many bytes for the ledger's indexes
    # together (a scope of two of them): refused at enqueue, failed on the wire.
    emoji = "".join(chr(0x1F300 + i) for i in range(512))
    with pytest.raises(InvalidInput, match="session_id is 2048 bytes as UTF-8"):
        run_agent.delay(calls("x"), emoji, user_id=emoji[::-1])
    wide = app.send_task(RUN_AGENT, args=[calls("x"), emoji], kwargs={"user_id": emoji[::-1]})
    with pytest.raises(RunFailed, match="session_id is 2048 bytes as UTF-8; the limit is 1024"):
        wide.get(timeout=60)
    row = _row(fleet.dsn, wide.id)
    assert (row["status"], row["attempts"], row["session_id"]) == (
        "failed", 0, emoji[:255] + "...")
    # The worker goes on.
    assert run_agent.delay(calls("after"), "s1").get(timeout=60)["output"] == "done: recorded after"
