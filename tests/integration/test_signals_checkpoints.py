"""Signals across processes, checkpoints and pruning, on the real Postgres."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import psycopg
import pytest
from loomflow import Agent, tool
from loomflow.runtime import Checkpoint, journal_scope

from loomflow_worker.runtime import InvalidInput, PostgresRuntime
from loomflow_worker.testing import DeterministicModel

from .helpers import epoch_of, signal_listeners, wait_until

pytestmark = pytest.mark.anyio

SEND = """
import anyio, sys
from loomflow_worker.runtime import PostgresRuntime

async def main() -> None:
    rt = await PostgresRuntime.connect(sys.argv[1])
    try:
        await rt.signal(sys.argv[2], sys.argv[3], {"from": "another process", "n": 1})
    finally:
        await rt.aclose()

anyio.run(main)
"""


async def _listening(dsn: str) -> None:
    """Until a waiter's runtime listens for signals."""
    await anyio.to_thread.run_sync(
        lambda: wait_until(lambda: signal_listeners(dsn), "no waiter listens for signals"))


def send_from_another_process(dsn: str, session_id: str, name: str) -> None:
    subprocess.run([sys.executable, "-c", SEND, dsn, session_id, name], check=True, timeout=60)


@pytest.mark.slow
async def test_a_signal_from_another_process_wakes_the_waiter(
    runtime: PostgresRuntime, dsn: str
) -> None:
    got: list[object] = []

    async def wait() -> None:
        got.append(await runtime.wait_for_signal("s", "approval", timeout_s=30))

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await _listening(dsn)
        started = time.monotonic()
        await anyio.to_thread.run_sync(
            send_from_another_process, runtime.journal.conninfo, "s", "approval"
        )
    assert got == [{"from": "another process", "n": 1}]
    assert time.monotonic() - started < 10


async def test_a_signal_sent_before_the_waiter_starts_is_delivered(dsn: str) -> None:
    sender = await PostgresRuntime.connect(dsn)
    await sender.signal("s", "go", "first")
    await sender.signal("s", "go", "second")
    await sender.aclose()
    # a restart later: a new runtime, a new process as far as Postgres knows
    receiver = await PostgresRuntime.connect(dsn)
    try:
        assert await receiver.wait_for_signal("s", "go", timeout_s=5) == "first"
        assert await receiver.try_signal("s", "go") == "second"
        assert await receiver.try_signal("s", "go") is None
        with pytest.raises(TimeoutError):
            await receiver.wait_for_signal("s", "go", timeout_s=0.2)
    finally:
        await receiver.aclose()


async def test_signals_survive_the_listener_connection_dying(dsn: str) -> None:
    runtime = await PostgresRuntime.connect(dsn, signal_poll_interval=0.5)
    got: list[object] = []
    try:
        async def wait() -> None:
            got.append(await runtime.wait_for_signal("s", "n", timeout_s=30))

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await _listening(dsn)
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin:
                cur = await admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = 'loomflow-worker signals' AND datname = "
                    "current_database()"
                )
                assert [r[0] for r in await cur.fetchall()] == [True]
            sender = await PostgresRuntime.connect(dsn)
            await sender.signal("s", "n", 42)
            await sender.aclose()
        assert got == [42]
    finally:
        await runtime.aclose()


async def test_a_signal_taken_inside_a_run_replays_when_the_run_resumes(
    runtime: PostgresRuntime,
) -> None:
    await runtime.signal("s", "approval", {"action": "allow"})

    class Stop(BaseException):
        pass

    with pytest.raises(Stop):
        async with runtime.session("s"):
            assert await runtime.wait_for_signal("s", "approval", timeout_s=5) == {
                "action": "allow"
            }
            raise Stop
    # the mailbox is empty now, yet the resumed run gets its signal back
    assert await runtime.try_signal("s", "approval") is None
    async with runtime.session("s"):
        assert await runtime.wait_for_signal("s", "approval", timeout_s=1) == {"action": "allow"}


async def test_bad_signals_are_refused(runtime: PostgresRuntime) -> None:
    with pytest.raises(InvalidInput, match="empty"):
        await runtime.signal("s", "", 1)
    with pytest.raises(InvalidInput, match="can't be stored"):
        await runtime.signal("s", "x", object())
    with pytest.raises(AttributeError, match="try_signal"):
        runtime.poll_signal("s", "x")  # type: ignore[operator]


async def test_checkpoints_round_trip_and_keep_the_newest(dsn: str) -> None:
    runtime = await PostgresRuntime.connect(dsn, max_checkpoints_per_session=3)
    try:
        base = datetime.now(UTC)
        for turn in range(5):
            await runtime.put_checkpoint(
                Checkpoint(session_id="s", turn=turn, created_at=base + timedelta(seconds=turn))
            )
        listed = await runtime.list_checkpoints("s")
        assert [m.turn for m in listed] == [4, 3, 2]
        latest = await runtime.get_latest_checkpoint("s")
        assert latest is not None and latest.turn == 4
        one = await runtime.get_checkpoint("s", listed[1].checkpoint_id)
        assert one is not None and one.turn == 3
        assert await runtime.get_latest_checkpoint("other") is None
    finally:
        await runtime.aclose()


async def _fill(dsn: str, scopes: int, per_scope: int, created_at: float) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO journal_steps (session_id, step_name, value, created_at) "
            "SELECT 'old-' || (i %% %s), 'step-' || i, 'LJ1\"x\"'::bytea, %s "
            "FROM generate_series(1, %s) AS i",
            (scopes, created_at, scopes * per_scope),
        )


async def test_prune_deletes_in_batches_and_keeps_epochs(
    runtime: PostgresRuntime, dsn: str
) -> None:
    async def noop() -> str:
        return "v"

    for _ in range(2):
        async with runtime.session("kept"):
            await runtime.step("x", noop)
    await _fill(dsn, scopes=10, per_scope=1200, created_at=time.time() - 3600)
    batches: list[tuple[str, int]] = []
    deleted = await runtime.journal.prune_rows(
        before=datetime.now(UTC) - timedelta(minutes=30),
        batch_size=1000,
        on_batch=lambda table, n: batches.append((table, n)),
    )
    assert deleted == 12000
    assert len(batches) == 12 and all(n <= 1000 for _, n in batches)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute("SELECT count(*) FROM journal_steps WHERE session_id LIKE 'old-%'")
        row = await cur.fetchone()
        assert row is not None and row[0] == 0
    # recent entries stay; pruning everything before now keeps the epoch bookkeeping
    await runtime.prune(before=datetime.now(UTC) + timedelta(seconds=1))
    assert await epoch_of(dsn, "kept") == 2
    # a whole session goes, bookkeeping included
    await runtime.prune(session_id="kept")
    assert await epoch_of(dsn, "kept") is None


async def test_prune_does_not_block_a_running_step(runtime: PostgresRuntime, dsn: str) -> None:
    await _fill(dsn, scopes=50, per_scope=2000, created_at=time.time() - 3600)
    step_times: list[float] = []

    async def noop() -> int:
        return 1

    async def journal_while_pruning() -> None:
        async with runtime.session("busy"):
            for i in range(200):
                started = time.perf_counter()
                await runtime.step(f"s{i}", noop)
                step_times.append(time.perf_counter() - started)

    async with anyio.create_task_group() as tg:
        tg.start_soon(runtime.prune, datetime.now(UTC) - timedelta(minutes=1))
        tg.start_soon(journal_while_pruning)
    step_times.sort()
    # no step waited on a prune batch for long
    assert step_times[-1] < 1.0, step_times[-5:]
    assert await epoch_of(dsn, "busy") == 1


async def test_a_signal_delivered_through_the_session_handle_is_durable(dsn: str) -> None:
    """loomflow's RuntimeSession.deliver reaches the durable signals: a waiter
    after the session closed, in another runtime (process), still gets it."""
    sender = await PostgresRuntime.connect(dsn)
    waiter = await PostgresRuntime.connect(dsn)
    try:
        async with sender.session("chat-7") as sess:
            await sess.deliver("approve", {"by": "ops"})
        assert await waiter.wait_for_signal("chat-7", "approve", timeout_s=5) == {"by": "ops"}
        async with waiter.session("chat-8") as sess:
            await sender.signal("chat-8", "go", 3)
            assert await sess.wait_signal("go") == 3
    finally:
        await sender.aclose()
        await waiter.aclose()


async def test_poll_signal_is_not_there_as_loomflow_expects(runtime: PostgresRuntime) -> None:
    # loomflow looks for it with hasattr: a runtime that can't poll has none.
    assert not hasattr(runtime, "poll_signal")
    await runtime.signal("chat-9", "ping", 1)
    assert await runtime.try_signal("chat-9", "ping") == 1
    assert await runtime.try_signal("chat-9", "ping") is None


async def test_signals_are_scoped_per_session_and_user(dsn: str) -> None:
    """A signal naming a user reaches only that user's waiter on the session
    (inside a run: the run's user); one naming no user (loomflow's
    session-only ``signal(session_id, ...)``) reaches a waiter of any user; a
    waiter of no user never takes a user's signal."""
    sender = await PostgresRuntime.connect(dsn)
    waiter = await PostgresRuntime.connect(dsn, signal_poll_interval=0.2)
    got: list[Any] = []

    async def wait_signal(name: str) -> str:
        """Wait for the signal ``name`` on this session."""
        payload = await waiter.wait_for_signal("chat-42", name, timeout_s=10)
        got.append(payload)
        return "ok"

    agent = Agent("waits for a signal", model=DeterministicModel(), runtime=waiter,
                  tools=[tool(name="wait_signal", description="Wait.")(wait_signal)],
                  auto_extract=False)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: agent.run('call wait_signal {"name": "go"}',
                                            session_id="chat-42", user_id="alice"))
            await _listening(dsn)
            await sender.signal("chat-42", "go", "bob's", user_id="bob")
            # Bob's is the older signal: a waiter that took any user's would
            # take his first, and ``got`` would say so.
            await sender.signal("chat-42", "go", "alice's", user_id="alice")
        assert got == ["alice's"]

        # Bob's is still bob's: no user-less waiter and no other user takes it.
        assert await waiter.try_signal("chat-42", "go") is None
        assert await waiter.try_signal("chat-42", "go", user_id="carol") is None
        assert await waiter.try_signal("chat-42", "go", user_id="bob") == "bob's"

        # Session-only, as loomflow sends it: any user's waiter on the session.
        await sender.signal("chat-42", "go", "anyone's")
        assert await waiter.wait_for_signal("chat-42", "go", user_id="alice",
                                            timeout_s=5) == "anyone's"
        with pytest.raises(InvalidInput, match="user_id"):
            await sender.signal("chat-42", "go", 1, user_id="")
    finally:
        await sender.aclose()
        await waiter.aclose()


async def test_one_prune_spares_unfinished_scopes_and_deletes_finished_requests(
    runtime: PostgresRuntime, dsn: str
) -> None:
    """runtime.prune() follows the rules of `loomflow-worker prune` and of the
    sweeper's retention: a scope with an unfinished request keeps its journal,
    requests finished before the cutoff go, unfinished ones stay."""
    async def noop() -> str:
        return "v"

    for scope in ("parked", "done"):
        async with runtime.session(scope):
            await runtime.step("x", noop)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO runs (request_id, scope, session_id, agent, prompt, status,"
            " finished_at) VALUES ('waiting', 'parked', 'parked', 'a', 'p', 'queued', NULL),"
            " ('finished', 'done', 'done', 'a', 'p', 'succeeded', now())"
        )
    deleted = await runtime.prune(before=datetime.now(UTC) + timedelta(seconds=1))
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT session_id, count(*) FROM journal_steps"
            " WHERE step_name NOT IN ('__run_epoch__', '__last_run_epoch__') GROUP BY 1"
        )
        left = dict(await cur.fetchall())
        cur = await conn.execute("SELECT request_id FROM runs")
        requests = [r[0] for r in await cur.fetchall()]
        cur = await conn.execute("SELECT count(*) FROM direct_runs")
        direct = (await cur.fetchone() or [None])[0]
    assert left == {"parked": 1}
    assert requests == ["waiting"]
    assert direct == 0
    # done's step, its finished request, and the two runs opened here (outside
    # Celery, recorded in direct_runs), which ended before the cutoff.
    assert deleted == 4
    assert await epoch_of(dsn, "done") == 1


async def _signal_rows(dsn: str) -> list[tuple[str, str | None, str]]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT session_id, user_id, convert_from(payload, 'UTF8') FROM signals ORDER BY id"
        )
        return [(r[0], r[1], r[2]) for r in await cur.fetchall()]


async def test_signals_to_sessions_that_never_run_are_bounded(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """What loomflow 0.20's own test of that name asks of a runtime: signals
    to sessions no run ever opens can't pile up. A scope keeps its newest
    `signals_per_scope` undelivered signals (the oldest go at a send, logged),
    other scopes of the session keep theirs, and a prune takes the rest."""
    runtime = await PostgresRuntime.connect(dsn, signals_per_scope=3)
    try:
        for n in range(5):
            await runtime.signal("never-opened", "go", n, user_id="alice")
        await runtime.signal("never-opened", "go", "bob's", user_id="bob")
        await runtime.signal("never-opened", "go", "anyone's")
        left = await _signal_rows(dsn)
        assert [(u, p) for _, u, p in left] == [
            ("alice", "LJ12"), ("alice", "LJ13"), ("alice", "LJ14"),
            ("bob", 'LJ1"bob\'s"'), (None, 'LJ1"anyone\'s"'),
        ]
        assert "dropped the 1 oldest undelivered signal(s) of session 'never-opened'" in (
            caplog.text)
        assert await runtime.try_signal("never-opened", "go", user_id="alice") == 2

        for i in range(1000):
            await runtime.signal(f"nobody-{i}", "ping", i)
        assert len(await _signal_rows(dsn)) == 1004
        assert await runtime.prune(before=datetime.now(UTC) + timedelta(seconds=1)) == 1004
        assert await _signal_rows(dsn) == []
    finally:
        await runtime.aclose()


async def test_prune_takes_old_signals_and_spares_those_a_queued_request_awaits(
    runtime: PostgresRuntime, dsn: str
) -> None:
    """`prune(before=now)` deletes a 400-day-old signal; signals newer than the
    cutoff stay, and so do those sent to a session whose request is still
    unfinished (to its user, or to no user), whatever their age."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO signals (session_id, user_id, name, payload, created_at) VALUES"
            " ('old', NULL, 'go', 'x', now() - interval '400 days'),"
            " ('waiting', 'alice', 'go', 'for alice', now() - interval '400 days'),"
            " ('waiting', NULL, 'go', 'for anyone', now() - interval '400 days'),"
            " ('waiting', 'bob', 'go', 'for bob', now() - interval '400 days')"
        )
        await conn.execute(
            "INSERT INTO runs (request_id, scope, session_id, user_id, agent, prompt, status)"
            " VALUES ('queued', %s, 'waiting', 'alice', 'a', 'p', 'queued')",
            (journal_scope("waiting", "alice"),),
        )
    await runtime.signal("recent", "go", "y")
    assert await runtime.prune(before=datetime.now(UTC) - timedelta(hours=1)) == 2
    assert [(s, u) for s, u, _ in await _signal_rows(dsn)] == [
        ("waiting", "alice"), ("waiting", None), ("recent", None)]
    assert await runtime.prune(before=datetime.now(UTC) + timedelta(seconds=1),
                               session_id="recent") == 1
    assert [(s, u) for s, u, _ in await _signal_rows(dsn)] == [
        ("waiting", "alice"), ("waiting", None)]


@pytest.mark.parametrize("session_id, user_id", [
    ("chat-42", None), ("chat-42", "alice"), ("user:3:bob:x", None), ("anon:x", None),
    ("s", "ünïcödé 🙂"), ("a:b", "c:d"),
])
async def test_a_signal_is_stored_under_its_journal_scope(
    dsn: str, session_id: str, user_id: str | None
) -> None:
    runtime = await PostgresRuntime.connect(dsn)
    try:
        await runtime.signal(session_id, "go", 1, user_id=user_id)
    finally:
        await runtime.aclose()
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute("SELECT scope FROM signals")
        assert [r[0] for r in await cur.fetchall()] == [journal_scope(session_id, user_id)]


async def test_a_negative_signal_bound_is_refused(dsn: str) -> None:
    with pytest.raises(InvalidInput, match="signals kept per scope must be 0"):
        await PostgresRuntime.connect(dsn, signals_per_scope=-1)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid()")
        assert await cur.fetchone() == (0,)
