"""What Celery lets a caller do to a task, kept true to the ledger: calling it
directly, reusing a task_id, a broker down at enqueue, bad input, dropping
waiting work. Real Postgres, Redis and workers."""

from __future__ import annotations

import time
import uuid

import psycopg
import pytest
import redis
from pydantic import SecretStr

from loomflow_worker import InvalidInput, cancel_queued, cancel_request
from loomflow_worker import tasks as tasks_module
from loomflow_worker.execution.ledger import EnqueuePool
from loomflow_worker.execution.registry import import_agent_modules
from loomflow_worker.execution.request import check_request
from loomflow_worker.tasks import RunCancelled, resume_agent, run_agent

from .celery_harness import QUICK_RESULT_CHECK, REDIS_URL, Fleet, ledger, wait_status, wait_swept
from .helpers import calls, cli, lines, tool_counts


def _rows(dsn: str) -> list[tuple[str, str, str | None, str]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        found = conn.execute(
            "SELECT request_id, session_id, user_id, status FROM runs ORDER BY seq"
        ).fetchall()
    return [(r[0], r[1], r[2], r[3]) for r in found]


def _waiting(fleet: Fleet) -> int:
    """Messages in the fleet's queue on Redis (each priority's list)."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        return sum(int(client.llen(key))
                   for key in client.scan_iter(match=f"{fleet.prefix}{fleet.queue}*"))
    finally:
        client.close()


# ---- calling the task directly -----------------------------------------------------------------


def test_calling_a_task_directly_says_to_enqueue_it_and_writes_nothing(fleet: Fleet) -> None:
    for task in (run_agent, resume_agent):
        with pytest.raises(InvalidInput, match=r"called directly.*\.delay\(\.\.\.\) or "
                                               r"\.apply_async\(\.\.\.\)"):
            task(calls("x"), "s1")
    assert _rows(fleet.dsn) == []


# ---- task_id, an idempotency key ---------------------------------------------------------------


@pytest.mark.slow
def test_a_task_id_sent_again_returns_the_first_handle_and_publishes_nothing(
    fleet: Fleet,
) -> None:
    task_id = str(uuid.uuid4())
    args, kwargs = (calls("once"), "s1"), {"user_id": "alice", "metadata": {"n": 1}}
    first = run_agent.apply_async(args, kwargs, task_id=task_id)
    assert _waiting(fleet) == 1
    # The same request, however its arguments are spelled, and whatever on_busy says.
    for again in (
        run_agent.apply_async(args, kwargs, task_id=task_id),
        run_agent.apply_async(kwargs={"prompt": args[0], "session_id": "s1", **kwargs},
                              task_id=task_id),
        run_agent.apply_async(args, kwargs, task_id=task_id, on_busy="interrupt"),
        run_agent.apply_async(args, kwargs, task_id=task_id, on_busy="reject"),
    ):
        assert again.id == first.id
    assert _waiting(fleet) == 1
    assert _rows(fleet.dsn) == [(task_id, "s1", "alice", "queued")]

    fleet.start("w1", concurrency=1)
    assert first.get(timeout=60)["output"] == "done: recorded once"
    assert tool_counts(fleet.dsn) == {"once": 1}
    assert ledger(fleet.dsn, task_id)["attempts"] == 1
    # Sent again once it finished: still that request, still not run again.
    assert run_agent.apply_async(args, kwargs, task_id=task_id).get(timeout=10)[
        "output"] == "done: recorded once"
    assert tool_counts(fleet.dsn) == {"once": 1}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"user_id": "bob"}, "user_id differs"),
        ({"prompt": calls("other")}, "prompt differs"),
        ({"session_id": "s2", "metadata": {"n": 2}}, "session_id, metadata differ"),
        ({"agent": "flaky"}, "agent differs"),
    ],
)
def test_a_task_id_sent_again_with_other_arguments_is_refused(
    fleet: Fleet, change: dict[str, object], named: str
) -> None:
    task_id = str(uuid.uuid4())
    request = {"prompt": calls("mine"), "session_id": "s1", "user_id": "alice",
               "metadata": {"n": 1}}
    run_agent.apply_async(kwargs=request, task_id=task_id)
    for on_busy in ("enqueue", "reject", "interrupt"):
        with pytest.raises(InvalidInput, match=rf"task_id '{task_id}' is already the id of "
                                               rf"another request \(its {named}\)"):
            run_agent.apply_async(kwargs={**request, **change}, task_id=task_id,
                                  on_busy=on_busy)
    with pytest.raises(InvalidInput, match=r"\(its kind, metadata differ\)"):
        resume_agent.apply_async(kwargs={k: v for k, v in request.items() if k != "metadata"},
                                 task_id=task_id)
    assert _waiting(fleet) == 1
    assert _rows(fleet.dsn) == [(task_id, "s1", "alice", "queued")]


# ---- the broker down at enqueue ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "down",
    [
        {"broker_url": "redis://127.0.0.1:1/0"},
        {"broker_url": "amqp://guest:guest@127.0.0.1:1//"},
        # Redis down altogether: the caller's result subscription fails too.
        {"broker_url": "redis://127.0.0.1:1/0", "result_backend": "redis://127.0.0.1:1/1"},
    ],
    ids=["redis", "rabbitmq", "redis-and-results"],
)
def test_a_request_accepted_while_the_broker_is_down_returns_its_handle_and_runs_once(
    fleet: Fleet, down: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    up = tasks_module.settings()
    tasks_module.configure(
        up.model_copy(update={k: SecretStr(v) for k, v in down.items()})
    )
    try:
        started = time.monotonic()
        result = run_agent.delay(calls("late"), "s1")
        took = time.monotonic() - started
    finally:
        tasks_module.configure(up)
    assert took < 5, f".delay() took {took:.1f}s with the broker down"
    assert ledger(fleet.dsn, result.id)["status"] == "queued"
    assert any(result.id in r.getMessage() and "accepted" in r.getMessage()
               for r in caplog.records)
    # The command says the same: the request id on stdout, what happened on stderr.
    done = cli(fleet, "enqueue", calls("late-cli"), "--session", "s2",
               **{f"LOOMFLOW_WORKER_{k.upper()}": v for k, v in down.items()})
    assert done.returncode == 0, done.stderr
    by_cli = done.stdout.strip()
    assert f"request {by_cli} is accepted" in done.stderr
    # A worker's sweeper publishes them: the queue is empty, the requests queued.
    fleet.start("w1", concurrency=1, LOOMFLOW_WORKER_HANDOFF_GRACE="0.5",
                LOOMFLOW_WORKER_SWEEP_INTERVAL="0.3")
    assert run_agent.AsyncResult(result.id).get(timeout=60)["output"] == "done: recorded late"
    assert wait_status(fleet.dsn, by_cli, ("succeeded",)) == "succeeded"
    assert tool_counts(fleet.dsn) == {"late": 1, "late-cli": 1}


@pytest.mark.slow
def test_a_retry_the_broker_refuses_is_published_by_the_sweeper_once_it_is_back(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    """Celery's retry of a running request (``apply_async`` under the request's
    own id, with ``retries``) is published as it was received; when the broker
    refuses it, the caller is not failed: the request stays queued in the
    ledger, marked for the sweeper, which publishes it once a worker is up."""
    up = tasks_module.settings()
    request_id = str(uuid.uuid4())
    import_agent_modules(up.agents)
    req = check_request(up, kind="run", prompt=calls("retried"), session_id="s1")
    enqueue = EnqueuePool()
    try:
        enqueue.insert(up.database_url.get_secret_value(), 5, request_id, req)
    finally:
        enqueue.close()
    args, kwargs = req.task_args()
    tasks_module.configure(up.model_copy(update={"broker_url": SecretStr("redis://127.0.0.1:1/0")}))
    run_agent.push_request(id=request_id, retries=0)
    try:
        started = time.monotonic()
        result = run_agent.apply_async(args, kwargs, task_id=request_id, retries=1, countdown=1)
        took = time.monotonic() - started
    finally:
        run_agent.pop_request()
        tasks_module.configure(up)
    assert result.id == request_id
    assert took < 5, f"the retry's publish took {took:.1f}s with the broker down"
    assert any(request_id in r.getMessage() and "queued for its retry" in r.getMessage()
               for r in caplog.records)
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT status, dispatched_at = '-infinity' FROM runs"
                           " WHERE request_id = %s", (request_id,)).fetchone()
    assert row == ("queued", True)
    fleet.start("w1", concurrency=1, LOOMFLOW_WORKER_HANDOFF_GRACE="0.5")
    assert run_agent.AsyncResult(request_id).get(timeout=60)["output"] == "done: recorded retried"
    assert tool_counts(fleet.dsn) == {"retried": 1}


# ---- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "metadata", "error"),
    [
        ("hello \ud800 there", None, r"prompt contains an unpaired surrogate .* at position 6"),
        ("nul \x00", None, "prompt contains a NUL character at position 4"),
        ("p", {"note": "a \udfff"}, r"metadata\['note'\] contains an unpaired surrogate"),
        ("p", {"k\ud83d": 1}, r"a key of metadata contains an unpaired surrogate"),
        ("p", {"list": ["ok", "x\x00"]}, r"metadata\['list'\]\[1\] contains a NUL character"),
        ("p", "deep", "metadata nests deeper than 64 levels"),
        ("p", "very deep", "metadata nests deeper than 64 levels"),
    ],
)
def test_bad_input_is_refused_with_nothing_written(
    fleet: Fleet, prompt: str, metadata: object, error: str
) -> None:
    if metadata in ("deep", "very deep"):
        nested: dict[str, object] = {}
        for _ in range(65 if metadata == "deep" else 100_000):
            nested = {"a": nested}
        metadata = nested
    with pytest.raises(InvalidInput, match=error):
        run_agent.delay(prompt, "s1", metadata=metadata)
    assert _rows(fleet.dsn) == []
    assert _waiting(fleet) == 0


def test_a_task_id_postgres_cannot_store_is_refused_with_nothing_written(fleet: Fleet) -> None:
    for task_id in ("a\x00b", "\ud800", " "):
        with pytest.raises(InvalidInput, match="task_id"):
            run_agent.apply_async(("p", "s1"), task_id=task_id)
        with pytest.raises(InvalidInput, match="request_id"):
            cancel_request(task_id)
    assert _rows(fleet.dsn) == []


def test_metadata_holding_the_text_of_an_escape_is_stored_as_given(fleet: Fleet) -> None:
    metadata = {"path": "C:\\u0000dir", "deep": [[[{"ok": "\\ud800"}]]]}
    result = run_agent.delay(calls("m"), "s1", metadata=metadata)
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT metadata FROM runs WHERE request_id = %s",
                           (result.id,)).fetchone()
    assert row is not None and row[0] == metadata


# ---- dropping waiting work -------------------------------------------------------------------


@pytest.mark.slow
def test_cancel_queued_drops_waiting_work_and_the_sessions_move_on(fleet: Fleet) -> None:
    dropped = [run_agent.delay(calls(f"drop{i}"), "s1", user_id=f"u{i % 2}") for i in range(3)]
    other_user = run_agent.delay(calls("keep-user"), "s1", user_id="u9")
    other_session = run_agent.delay(calls("keep-session"), "s2", user_id="u0")

    done = cli(fleet, "cancel", "--queued", "--session", "s1", "--user", "u0")
    assert done.returncode == 0, done.stderr
    assert set(lines(done.stdout)) == {dropped[0].id, dropped[2].id}
    assert "cancelled 2 queued requests" in done.stderr
    # Without a filter the command asks first; declining changes nothing.
    declined = cli(fleet, "cancel", "--queued", input="n\n")
    assert declined.returncode == 1 and "Cancel every queued request" in declined.stdout
    assert set(cancel_queued(session_id="s1")) == {dropped[1].id, other_user.id}

    statuses = {r[0]: r[3] for r in _rows(fleet.dsn)}
    assert [statuses[r.id] for r in dropped] == ["cancelled"] * 3
    assert statuses[other_user.id] == "cancelled"
    assert statuses[other_session.id] == "queued"

    fleet.start("w1", concurrency=1)
    after = run_agent.delay(calls("after"), "s1", user_id="u0")
    assert after.get(timeout=60)["output"] == "done: recorded after"
    assert other_session.get(timeout=60)["output"] == "done: recorded keep-session"
    for request in dropped:
        with pytest.raises(RunCancelled):
            request.get(timeout=30)
    assert tool_counts(fleet.dsn) == {"after": 1, "keep-session": 1}
    wait_status(fleet.dsn, dropped[0].id, ("cancelled",))


@pytest.mark.slow
def test_cancel_needs_a_request_or_queued(fleet: Fleet) -> None:
    for args in ((), ("x", "--queued"), ("x", "--session", "s")):
        done = cli(fleet, "cancel", *args)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr


# ---- fire and forget ---------------------------------------------------------------------------


def _assert_no_result_stored(fleet: Fleet, request_id: str) -> None:
    from loomflow_worker.tasks import results

    assert results.results_missing([request_id]) == {request_id}
    assert "which its worker could not store" not in fleet.log_text()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["apply_async", "task default"])
def test_a_result_its_caller_ignores_is_never_stored_by_the_sweeper(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    fleet.env.update(QUICK_RESULT_CHECK)
    fleet.start("w1", concurrency=2, pool="threads")
    if how == "apply_async":
        ignored = run_agent.apply_async((calls("f1"), "s"), ignore_result=True)
    else:
        monkeypatch.setattr(tasks_module.app.tasks[run_agent.name], "ignore_result", True)
        ignored = run_agent.delay(calls("f1"), "s")
    assert wait_status(fleet.dsn, ignored.id, ("succeeded",), timeout=30) == "succeeded"
    wait_swept(fleet, ignored.id)
    _assert_no_result_stored(fleet, ignored.id)
    assert tool_counts(fleet.dsn) == {"f1": 1}


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_forgotten_result_is_not_stored_again(fleet: Fleet, pool: str) -> None:
    fleet.env.update(QUICK_RESULT_CHECK)
    fleet.start("w1", concurrency=2, pool=pool)
    done = run_agent.delay(calls("g1"), "s")
    assert done.get(timeout=30)["output"] == "done: recorded g1"
    done.forget()
    wait_swept(fleet, done.id)
    _assert_no_result_stored(fleet, done.id)
