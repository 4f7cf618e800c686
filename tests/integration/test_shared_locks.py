"""Many runs in one process share a few lock connections (no Celery)."""

from __future__ import annotations

import contextlib
import threading
import time
from itertools import pairwise
from typing import Any

import anyio
import psycopg
import pytest
from loomflow import Agent, tool
from loomflow.runtime.journal import journal_scope
from psycopg.pq import TransactionStatus

from loomflow_worker.runtime import LockLost, PostgresRuntime, current_lease
from loomflow_worker.runtime.keys import scope_lock_key
from loomflow_worker.testing import DeterministicModel, EffectsLog

from .helpers import calls, make_agent, steps_journaled_twice, wait_until_async, warm_runtime

pytestmark = pytest.mark.anyio


async def _lock_backends(dsn: str) -> int:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = 'loomflow-worker lock'"
        )
        row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def test_fifty_runs_share_two_lock_connections_and_batch_their_writes(dsn: str) -> None:
    effects = EffectsLog(dsn, sleep=0.3)
    await effects.setup()
    runtime = await PostgresRuntime.connect(dsn, lock_connections=2)
    seen: list[int] = []

    async def one(i: int) -> None:
        agent = make_agent(runtime, effects)
        result = await agent.run(calls(f"r{i}-a", f"r{i}-b"), session_id=f"s{i}", user_id="u")
        assert result.output == f"done: recorded r{i}-a, recorded r{i}-b"

    async def watch() -> None:
        while True:
            seen.append(await _lock_backends(dsn))
            await anyio.sleep(0.05)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            async with anyio.create_task_group() as runs:
                for i in range(50):
                    runs.start_soon(one, i)
            tg.cancel_scope.cancel()
        lines = runtime.journal.live_connections()
        assert len(lines) == 2
        rows = sum(line.rows_written for line in lines)
        batches = sum(line.batches for line in lines)
    finally:
        await runtime.aclose()
    assert max(seen) == 2
    # 50 runs x (their model and tool steps + the last-run mark). One statement
    # per write would be about 6 of every 7 rows (a run's first write carries
    # the mark); the writes of runs in step with each other share statements.
    assert rows >= 50 * 5
    assert batches < 0.75 * rows, (batches, rows)
    assert (await effects.counts()) == {f"r{i}-{x}": 1 for i in range(50) for x in "ab"}
    assert steps_journaled_twice(dsn) == []


async def test_runs_of_one_process_on_one_session_take_turns(dsn: str) -> None:
    """A session lock is reentrant on its connection: the process must not take it twice."""
    effects = EffectsLog(dsn, sleep=0.2)
    await effects.setup()
    runtime = await PostgresRuntime.connect(dsn, lock_connections=1, lock_wait_timeout=30)
    try:
        async def one(i: int) -> None:
            await make_agent(runtime, effects).run(calls(f"t{i}-a", f"t{i}-b"), session_id="s")

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i)
    finally:
        await runtime.aclose()
    spans = sorted(
        (min(e.started_at for e in runs), max(e.finished_at for e in runs if e.finished_at))
        for runs in _by_request(await effects.executions()).values()
    )
    assert len(spans) == 4
    for (_, end), (start, _) in pairwise(spans):
        assert end <= start, spans


def _by_request(executions: list[Any]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for e in executions:
        out.setdefault(e.tag.split("-")[0], []).append(e)
    return out


async def test_a_synchronous_tool_does_not_hold_up_the_other_runs(dsn: str) -> None:
    effects = EffectsLog(dsn)
    await effects.setup()
    runtime = await PostgresRuntime.connect(dsn)

    crunching = threading.Event()

    @tool(name="crunch", description="A slow synchronous computation.")
    def crunch(seconds: float) -> str:
        crunching.set()
        time.sleep(seconds)  # blocks its thread, not the loop
        return "crunched"

    slow = Agent("slow", model=DeterministicModel(), tools=[crunch], runtime=runtime,
                 auto_extract=False)
    finished: dict[str, float] = {}
    started = time.perf_counter()

    async def run_slow() -> None:
        await slow.run('call crunch {"seconds": 2.0}', session_id="slow", user_id="u")
        finished["slow"] = time.perf_counter() - started

    async def run_quick(i: int) -> None:
        await make_agent(runtime, effects).run(calls(f"q{i}"), session_id=f"q{i}", user_id="u")
        finished[f"q{i}"] = time.perf_counter() - started

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_slow)
            await anyio.to_thread.run_sync(crunching.wait, 30)  # the slow tool is running
            for i in range(10):
                tg.start_soon(run_quick, i)
    finally:
        await runtime.aclose()
    quick = [v for k, v in finished.items() if k != "slow"]
    assert len(quick) == 10
    assert max(quick) < finished["slow"] - 0.5, finished


async def test_a_lost_lock_connection_fences_every_run_on_it(dsn: str) -> None:
    cut: dict[str, Any] = {}
    running = anyio.Event()
    effects = EffectsLog(dsn, sleep=1.0)
    await effects.setup()
    runtime = await PostgresRuntime.connect(dsn, lock_connections=1)

    async def note_backend(tag: str) -> None:
        attempt = current_lease()
        assert attempt is not None
        cut.setdefault("pid", attempt.backend_pid)
        cut["in_tool"] = cut.get("in_tool", 0) + tag.endswith("-a")
        if cut["in_tool"] == 20:
            running.set()  # every run is in its first tool call

    effects.on_start = note_backend
    outcomes: list[BaseException | None] = []

    async def one(i: int) -> None:
        try:
            await make_agent(runtime, effects).run(
                calls(f"f{i}-a", f"f{i}-b"), session_id=f"f{i}", user_id="u"
            )
            outcomes.append(None)
        except LockLost as exc:
            outcomes.append(exc)

    try:
        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(one, i)
            with anyio.fail_after(30):
                await running.wait()
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin:
                cur = await admin.execute("SELECT pg_terminate_backend(%s, 5000)", (cut["pid"],))
                assert await cur.fetchone() == (True,)
                cur = await admin.execute("SELECT clock_timestamp()")
                row = await cur.fetchone()
                assert row is not None
                cut["at"] = row[0]
    finally:
        await runtime.aclose()
    assert len(outcomes) == 20
    assert all(isinstance(o, LockLost) for o in outcomes), outcomes
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM journal_writes WHERE written_at > %s", (cut["at"],)
        )
        assert await cur.fetchone() == (0,)
    # No second tool call ran: each run stopped at the step after the cut.
    assert not any(tag.endswith("-b") for tag in (await effects.counts()))


async def test_an_open_that_fails_after_the_lock_leaves_the_scope_free(dsn: str) -> None:
    """The open query rides in the lock's round trip; when Postgres refuses it
    (here the journal's table is away), the lock taken just before must not
    stay held on the shared connection."""
    effects = EffectsLog(dsn)
    await effects.setup()
    runtime = await PostgresRuntime.connect(dsn, lock_connections=1)
    try:
        agent = make_agent(runtime, effects)
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin:
            await admin.execute("ALTER TABLE journal_streams RENAME TO journal_streams_away")
            try:
                with pytest.raises(psycopg.errors.UndefinedTable):
                    await agent.run(calls("a"), session_id="s", user_id="u")
            finally:
                await admin.execute("ALTER TABLE journal_streams_away RENAME TO journal_streams")
        other = await PostgresRuntime.connect(dsn, lock_connections=1)
        try:
            with anyio.fail_after(5):
                result = await make_agent(other, effects).run(
                    calls("b"), session_id="s", user_id="u"
                )
            assert result.output == "done: recorded b"
        finally:
            await other.aclose()
    finally:
        await runtime.aclose()


async def test_a_run_cancelled_after_its_open_failed_still_frees_the_scope(dsn: str) -> None:
    """The lock taken before a failed open is freed in a turn of its own: a
    caller cancelled while that turn waits for the connection (busy with
    another statement) must not leave the lock held on the shared connection."""
    async with warm_runtime(dsn) as (runtime, agent, _):
        lock_conn = runtime.journal.live_connections()[0]
        busy_done = anyio.Event()
        cancelled_while_busy: list[bool] = []

        async def occupy(seconds: float, delay: float) -> None:
            await anyio.sleep(delay)
            await lock_conn.run(lambda conn: conn.execute(f"SELECT pg_sleep({seconds})"))

        async def busy() -> None:
            # Queued behind the run's lock and open: it holds the connection
            # while the run learns that its open failed.
            await occupy(2.0, 0.15)
            busy_done.set()

        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin:
            await admin.execute("ALTER TABLE journal_streams RENAME TO journal_streams_away")
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(occupy, 0.3, 0.0)
                    tg.start_soon(busy)
                    with anyio.CancelScope() as run_scope:

                        async def cancel_while_the_unlock_waits() -> None:
                            # The open failed at about 0.3 s; the busy
                            # statement holds the connection until about 2.3 s.
                            await anyio.sleep(0.8)
                            cancelled_while_busy.append(not busy_done.is_set())
                            run_scope.cancel()

                        tg.start_soon(cancel_while_the_unlock_waits)
                        await anyio.sleep(0.05)
                        with contextlib.suppress(psycopg.errors.UndefinedTable):
                            await agent.run(calls("a"), session_id="s", user_id="u")
                    assert cancelled_while_busy == [True]
                    with anyio.fail_after(10):
                        await busy_done.wait()
            finally:
                await admin.execute("ALTER TABLE journal_streams_away RENAME TO journal_streams")
            key = scope_lock_key(journal_scope("s", "u"))

            async def held() -> tuple[int] | None:
                """How many times the lock connection holds the session's lock."""
                cur = await admin.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                    " AND granted AND objsubid = 1 AND pid = %s"
                    " AND classid = ((%s::bigint >> 32) & 4294967295)::oid"
                    " AND objid = (%s::bigint & 4294967295)::oid",
                    (lock_conn.backend_pid, key, key))
                return await cur.fetchone()

            await wait_until_async(held, "the session's lock released", 5,
                                   until=lambda row: row == (0,), every=0.05)


async def test_a_late_loop_is_not_a_silent_server(dsn: str) -> None:
    """A statement whose answer came while the loop was held (longer than the
    I/O timeout) is read once the loop runs again: the connection is not fenced.
    A statement the server really does not answer in time still is."""
    runtime = await PostgresRuntime.connect(dsn, lock_connections=1, lock_io_timeout=1.0)
    try:
        lease = await runtime.journal.acquire("late-loop", wait=0)

        on_its_way = anyio.Event()

        async def answered_at_once(conn: Any) -> Any:
            on_its_way.set()
            cur = await conn.execute("SELECT pg_sleep(0.1)")
            return await cur.fetchone()

        async with anyio.create_task_group() as tg:
            tg.start_soon(lease.io, answered_at_once)
            await on_its_way.wait()
            # Sent (the task ran on to its first wait, for the answer), not read yet.
            status = lease.lock_conn.conn.info.transaction_status
            assert status == TransactionStatus.ACTIVE, status
            time.sleep(2.5)  # the loop held, past the 1 s I/O timeout
        assert lease.fenced is None and lease.lock_conn.fenced is None

        async def silent(conn: Any) -> Any:
            cur = await conn.execute("SELECT pg_sleep(3)")
            return await cur.fetchone()

        with pytest.raises(LockLost, match="no answer within 1s"):
            await lease.io(silent)
        assert lease.fenced is not None
    finally:
        await runtime.aclose()
