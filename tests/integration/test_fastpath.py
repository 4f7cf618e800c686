"""The lock connections' hot statements sent straight through libpq (runtime/fastpath.py)."""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import psycopg
import pytest
from loomflow.runtime.journal import journal_scope

from loomflow_worker.runtime import LockLost, PostgresRuntime, SessionBusy, fastpath, lockconn
from loomflow_worker.runtime.lockconn import Batch, JournalRow, LockConnection
from loomflow_worker.testing import EffectsLog

from .helpers import calls, make_agent, wait_until_async, warm_runtime

pytestmark = pytest.mark.anyio


def _count_turns(lock_conn: LockConnection[Any]) -> dict[str, int]:
    """Count the exclusive turns and the journal writes sent to ``lock_conn`` from now on."""
    counts = {"turns": 0, "writes": 0, "exclusive": 0}
    run, send, write = lock_conn.run, lock_conn.send, lock_conn.write

    async def counted_run(fn: Callable[[Any], Awaitable[Any]]) -> Any:
        counts["turns"] += 1
        counts["exclusive"] += 1  # a turn of its own, through psycopg
        return await run(fn)

    async def counted_send(batch: Batch[Any]) -> Any:
        counts["turns"] += 1
        return await send(batch)

    async def counted_write(rows: list[JournalRow]) -> None:
        counts["writes"] += 1
        await write(rows)

    lock_conn.run = counted_run  # type: ignore[method-assign]
    lock_conn.send = counted_send  # type: ignore[method-assign]
    lock_conn.write = counted_write  # type: ignore[method-assign]
    return counts


async def test_a_run_finishes_and_unlocks_in_one_round_trip(dsn: str) -> None:
    """Lock and open, then the steps' writes, then the last step's write, the
    epoch advance and the unlock together: two turns on the lock connection
    besides the writes of the five steps before the last."""
    async with warm_runtime(dsn) as (runtime, agent, effects):
        counts = _count_turns(runtime.journal.live_connections()[0])
        result = await agent.run(calls("a", "b"), session_id="s", user_id="u")
        assert result.output == "done: recorded a, recorded b"
        # The lock and the open go with the other runs' statements too.
        assert counts == {"turns": 2, "writes": 5, "exclusive": 0}
        # The epoch advanced and the scope is free: the next run opens epoch 2 at once.
        with anyio.fail_after(5):
            again = await make_agent(runtime, effects).run(
                calls("c"), session_id="s", user_id="u"
            )
        assert again.output == "done: recorded c"
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT loomflow_worker_epoch(value) FROM journal_steps"
                " WHERE session_id = %s AND step_name = '__run_epoch__'",
                (journal_scope("s", "u"),),
            )
            row = await cur.fetchone()
        assert row is not None and row[0] == 2


async def test_a_steps_record_is_committed_before_the_next_step_runs(dsn: str) -> None:
    """A step's write goes with the run's next statement, but the next step's
    callable starts only once it is committed: a process that dies in a step
    never loses the step before it. Each tool reads, as it starts, what the
    journal holds of the run from another connection."""
    scope = journal_scope("s", "u")
    held: dict[str, list[str]] = {}

    async def look(tag: str) -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT split_part(step_name, '@', 1) FROM journal_steps"
                " WHERE session_id = %(s)s AND step_name NOT LIKE '\\_\\_%%'"
                " UNION ALL SELECT split_part(step_name, '@', 1) FROM journal_streams"
                " WHERE session_id = %(s)s", {"s": scope})
            held[tag] = sorted(
                str(row[0]).split(":")[-2] if row[0].startswith("idem:") else str(row[0])
                for row in await cur.fetchall())

    effects = EffectsLog(dsn, on_start=look)
    await effects.setup()
    runtime = await PostgresRuntime.connect(dsn, lock_connections=1)
    try:
        result = await make_agent(runtime, effects).run(calls("a", "b"), session_id="s",
                                                        user_id="u")
        assert result.output == "done: recorded a, recorded b"
    finally:
        await runtime.aclose()
    # Each step committed before the step after it started.
    assert held == {"a": ["model_call_1"],
                    "b": ["model_call_1", "model_call_2", "tool_call_1_0"]}, held
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM journal_steps WHERE session_id = %s"
            " AND step_name LIKE '%%persist_episode%%'", (scope,))
        last = await cur.fetchone()
    # The last step, written in the finish's round trip.
    assert last is not None and last[0] == 1


async def test_a_failed_epoch_advance_raises_and_still_frees_the_scope(dsn: str) -> None:
    """The advance and the unlock share a round trip, with a commit between them:
    when Postgres refuses the advance, the run gets the error and the scope's lock
    is released all the same."""
    effects = EffectsLog(dsn)
    await effects.setup()
    runtime = await PostgresRuntime.connect(dsn, lock_connections=1)
    refuse = """
        CREATE FUNCTION refuse_epoch() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.step_name = '__run_epoch__' THEN
                RAISE EXCEPTION 'no epoch today' USING ERRCODE = 'check_violation';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER refuse_epoch BEFORE INSERT OR UPDATE ON journal_steps
            FOR EACH ROW EXECUTE FUNCTION refuse_epoch();
    """
    try:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin:
            await admin.execute(refuse)
            try:
                with pytest.raises(psycopg.errors.CheckViolation, match="no epoch today"):
                    await make_agent(runtime, effects).run(
                        calls("a"), session_id="s", user_id="u"
                    )
            finally:
                await admin.execute("DROP TRIGGER refuse_epoch ON journal_steps")
        # Free at once, in this process and in another.
        for rt in (runtime, await PostgresRuntime.connect(dsn, lock_wait_timeout=0)):
            try:
                with anyio.fail_after(5):
                    result = await make_agent(rt, effects).run(
                        calls("b"), session_id="s", user_id="u"
                    )
                assert result.output.startswith("done:")
            except SessionBusy:
                pytest.fail("the scope stayed locked after the advance failed")
            finally:
                if rt is not runtime:
                    await rt.aclose()
    finally:
        await runtime.aclose()


async def _journal(conn: psycopg.AsyncConnection[Any]) -> list[tuple[Any, ...]]:
    cur = await conn.execute(
        "SELECT 'steps', step_name, value FROM journal_steps WHERE session_id = 's'"
        " UNION ALL SELECT 'streams', step_name, chunks FROM journal_streams"
        " WHERE session_id = 's' ORDER BY 1, 2"
    )
    return await cur.fetchall()


async def test_statement_errors_are_psycopgs_and_leave_the_connection_usable(
    dsn: str,
) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        # Text with a NUL is refused by the server, not cut short.
        with pytest.raises(psycopg.DataError):
            await lockconn.upsert(conn, [JournalRow("steps", "s", "k\x00ey", b"v")])
        await lockconn.upsert(conn, [JournalRow("steps", "s", "key", b"v1")])
        await lockconn.upsert(conn, [JournalRow("streams", "s", "key", b"v2")])
        assert await _journal(conn) == [("steps", "key", b"v1"), ("streams", "key", b"v2")]


async def test_a_few_journal_rows_are_written_all_or_none(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        rows = [JournalRow("steps", "s", "a", b"1"), JournalRow("streams", "s", "b", b"2")]
        with pytest.raises(psycopg.DataError):
            await lockconn.upsert(conn, [*rows, JournalRow("steps", "s", "c\x00", b"3")])
        assert await _journal(conn) == []
        await lockconn.upsert(conn, rows)
        assert await _journal(conn) == [("steps", "a", b"1"), ("streams", "b", b"2")]


async def test_a_pipeline_skips_to_the_next_sync_after_an_error(dsn: str) -> None:
    bad = fastpath.Statement.of(
        "put_step", ("scope", "key", "value", "request", "attempt"),
        (fastpath.TEXT_OID, fastpath.TEXT_OID, fastpath.BYTEA_OID, fastpath.TEXT_OID,
         fastpath.INT4_OID))
    unlock = (fastpath.UNLOCK_SCOPE, (fastpath.int8(42),))
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("SELECT pg_advisory_lock(42)")
        results = await fastpath.pipeline(conn, [
            (bad, (fastpath.text("s"), fastpath.text("k\x00"), b"v", None, None)),
            (fastpath.PUT_STEP, (fastpath.text("s"), fastpath.text("skipped"), b"v", None, None)),
            fastpath.SYNC,
            unlock,
        ])
        assert isinstance(results[0], psycopg.DataError)
        assert isinstance(results[1], psycopg.errors.PipelineAborted)
        assert fastpath.rows(results[2]) == [{"released": True}]
        # Not in pipeline mode any more: psycopg uses the connection as before.
        cur = await conn.execute(
            "SELECT count(*) FROM journal_steps WHERE step_name = 'skipped'"
        )
        assert await cur.fetchone() == (0,)


async def test_a_watched_connection_keeps_its_one_reader_from_answer_to_answer(
    dsn: str,
) -> None:
    # The loop's turn that resumes a waiter may still hold a call of the
    # reader for the answer that waiter then reads: that call must not take
    # the reader away (two epoll_ctl calls and a re-registration each round trip).
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        fastpath.watch(conn)
        try:
            watched = fastpath._watched[conn]
            for n in range(20):
                results = await fastpath.pipeline(
                    conn, [(fastpath.TRY_LOCK, (fastpath.int8(7),))])
                assert not isinstance(results[0], psycopg.Error)
                # Nobody waits now, as between a lock connection's turns.
                await anyio.lowlevel.checkpoint()
                assert watched.fd is not None, f"the reader was removed after answer {n + 1}"
            # Data nobody waits for (the backend ended between turns) still
            # removes it, and stays for the next wait to read.
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as other:
                await other.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
            async def removed() -> bool:
                return watched.fd is None

            await wait_until_async(removed, "the reader removed from a socket nobody reads", 5,
                                   every=0.01)
            with pytest.raises(psycopg.OperationalError):
                await fastpath.pipeline(conn, [(fastpath.TRY_LOCK, (fastpath.int8(7),))])
        finally:
            fastpath.unwatch(conn)


def test_a_statement_numbers_its_placeholders_in_the_order_given() -> None:
    stmt = fastpath.Statement.of("advance_epoch", ("value", "scope", "new"),
                                 (fastpath.BYTEA_OID, fastpath.TEXT_OID, fastpath.INT4_OID))
    sql = stmt.sql.decode()
    assert "%(" not in sql
    assert "$2, '__run_epoch__', $1" in sql
    assert sql.count("$3") == 3
    with pytest.raises(ValueError, match="takes"):
        fastpath.Statement.of("advance_epoch", ("scope",), (fastpath.TEXT_OID,))


async def test_a_finish_whose_connection_is_lost_raises_and_frees_the_scope(dsn: str) -> None:
    """The epoch advance and the unlock go out together; when the connection
    dies under them the run hears LockLost (its advance may not have been
    committed), and Postgres has freed the scope."""
    runtime = await PostgresRuntime.connect(dsn, lock_connections=1)
    other = await PostgresRuntime.connect(dsn, lock_connections=1)
    try:
        lease = await runtime.journal.acquire("finish-lost", 0)
        await lease.open(pinned=None, resume_last=False)
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin:
            await admin.execute("SELECT pg_terminate_backend(%s)", (lease.backend_pid,))
        with pytest.raises(LockLost):
            await runtime.journal.finish_and_release(lease, 0, advance=True)
        assert lease.released
        with anyio.fail_after(5):
            taken = await other.journal.acquire("finish-lost", 5)
        await other.journal.release(taken)
    finally:
        await other.aclose()
        await runtime.aclose()


async def test_a_caller_stopped_while_its_lock_statement_runs_leaves_the_scope_free(
    dsn: str,
) -> None:
    """A caller cancelled while the statement that takes its scope's lock is
    in flight (a revoke before its run began) frees the lock: a session lock
    outlives the caller, and the process may carry other runs for long."""
    from loomflow_worker.runtime import scope_lock_key

    slow = fastpath.Query("test_slow_lock",
                          b"SELECT pg_try_advisory_lock($1) AS locked, pg_sleep(0.5)", ("key",))

    def gate(key: int, may_lock: bool) -> Batch[bool | None]:
        def read(conn: Any, results: list[Any]) -> bool | None:
            return bool(fastpath.dicts(conn, fastpath.succeeded(results)[0])[0]["locked"])

        return Batch(lambda conn: [slow.call(conn, {"key": key})], read)

    runtime = await PostgresRuntime.connect(dsn, lock_connections=1)
    try:
        with anyio.move_on_after(0.2) as stopped:
            await runtime.journal.acquire_if("s", None, gate)
        assert stopped.cancelled_caught
        key = scope_lock_key("s")
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as other:
            cur = await other.execute("SELECT pg_try_advisory_lock(%s)", (key,))
            row = await cur.fetchone()
        assert row is not None and row[0] is True, "the scope stayed locked by the stopped caller"
        # And the process may take it again at once.
        with anyio.fail_after(5):
            await runtime.journal.acquire_if("s", None, gate)
    finally:
        await runtime.aclose()


class _HeldRow:
    """A journal row another transaction inserted and holds uncommitted: an
    upsert of the same key waits for it (a write in flight for as long as the
    test likes)."""

    def __init__(self, dsn: str, scope: str, key: str) -> None:
        self.dsn, self.scope, self.key = dsn, scope, key

    async def __aenter__(self) -> _HeldRow:
        self.conn = await psycopg.AsyncConnection.connect(self.dsn)
        await self.conn.execute(
            "INSERT INTO journal_steps (session_id, step_name, value, created_at)"
            " VALUES (%s, %s, 'held', 0)", (self.scope, self.key))
        return self

    async def release(self) -> None:
        await self.conn.rollback()

    async def __aexit__(self, *exc: object) -> None:
        await self.conn.close()


async def _written(dsn: str, scope: str, key: str) -> bytes | None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute("SELECT value FROM journal_steps WHERE session_id = %s"
                                 " AND step_name = %s", (scope, key))
        row = await cur.fetchone()
    return None if row is None else bytes(row[0])


async def test_a_write_its_caller_stopped_waiting_for_is_read_and_the_connection_goes_on(
    dsn: str,
) -> None:
    """A run alone on its lock connection sends its write itself, and the
    socket's reader reads the answer: a caller cancelled meanwhile (a revoke)
    stops waiting, the answer is read all the same, and the connection serves
    the next write, unfenced."""
    runtime = await PostgresRuntime.connect(dsn, lock_connections=1)
    try:
        lease = await runtime.journal.acquire("alone", 0)
        await lease.open(pinned=None, resume_last=False)
        lock_conn = lease.lock_conn
        await lock_conn.write([JournalRow("steps", "alone", "warm", b"w")])  # prepared now
        async with _HeldRow(dsn, "alone", "k") as held:
            with anyio.move_on_after(0.5) as stopped:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lock_conn.write, [JournalRow("steps", "alone", "k", b"mine")])
                    await anyio.sleep(0.1)
                    # Sent by its caller: in flight, the server task not woken.
                    assert lock_conn._flight is not None
            assert stopped.cancelled_caught
            await held.release()
            with anyio.fail_after(5):
                await lock_conn.write([JournalRow("steps", "alone", "next", b"n")])
        assert lock_conn.fenced is None
        assert await _written(dsn, "alone", "k") == b"mine"
        assert await _written(dsn, "alone", "next") == b"n"
        await runtime.journal.release(lease)
    finally:
        await runtime.aclose()


@pytest.mark.parametrize("how", ["backend ended", "no answer"])
async def test_a_write_sent_by_its_caller_on_a_lost_connection_fences_every_run_on_it(
    dsn: str, how: str,
) -> None:
    """G6 for a write its caller sent itself: the backend ended under it, or
    no answer within the I/O timeout (a held row here), fences the connection
    at once, for the writer and for every other run on it."""
    runtime = await PostgresRuntime.connect(dsn, lock_connections=1, lock_io_timeout=1.0)
    try:
        lease = await runtime.journal.acquire("lost", 0)
        other = await runtime.journal.acquire("other", 0)
        await lease.open(pinned=None, resume_last=False)
        lock_conn = lease.lock_conn
        assert other.lock_conn is lock_conn
        await lock_conn.write([JournalRow("steps", "lost", "warm", b"w")])
        async with _HeldRow(dsn, "lost", "k") as held:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_kill_when_in_flight, dsn, lock_conn, how == "backend ended")
                with anyio.fail_after(10), pytest.raises(LockLost):
                    await lock_conn.write([JournalRow("steps", "lost", "k", b"mine")])
            await held.release()
        assert lock_conn.fenced is not None and other.fenced is not None
        with pytest.raises(LockLost):
            await other.lock_conn.write([JournalRow("steps", "other", "k", b"x")])
    finally:
        await runtime.aclose()


async def _kill_when_in_flight(dsn: str, lock_conn: LockConnection[Any], kill: bool) -> None:
    await anyio.sleep(0.2)
    assert lock_conn._flight is not None  # sent by its caller, waiting for the held row
    if kill:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin:
            await admin.execute("SELECT pg_terminate_backend(%s)", (lock_conn.backend_pid,))


async def test_a_write_the_sockets_buffer_cannot_take_at_once_is_sent_by_the_server(
    dsn: str,
) -> None:
    """A caller whose statements fill the socket's buffer leaves the rest to
    the server, which waits for the socket as its turns do: the write is
    committed, and the connection serves the next one."""
    runtime = await PostgresRuntime.connect(dsn, lock_connections=1)
    try:
        lease = await runtime.journal.acquire("big", 0)
        await lease.open(pinned=None, resume_last=False)
        lock_conn = lease.lock_conn
        await lock_conn.write([JournalRow("steps", "big", "warm", b"w")])
        sock = socket.socket(fileno=os.dup(lock_conn.conn.pgconn.socket))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.close()  # the duplicate only
        value = os.urandom(60_000)
        sent: list[bool] = []
        send_now = lock_conn._send_now

        def watched(*args: Any) -> bool:
            took = send_now(*args)
            sent.append(took and lock_conn._flight is not None and lock_conn._flight.by_server)
            return took

        lock_conn._send_now = watched  # type: ignore[method-assign]
        with anyio.fail_after(10):
            await lock_conn.write([JournalRow("steps", "big", "k", value)])
            await lock_conn.write([JournalRow("steps", "big", "next", b"n")])
        assert sent == [True, False]
        assert lock_conn.fenced is None
        assert await _written(dsn, "big", "k") == value
        assert await _written(dsn, "big", "next") == b"n"
    finally:
        await runtime.aclose()


async def test_a_write_refused_before_it_is_sent_leaves_the_connection_as_it_was(
    dsn: str,
) -> None:
    """A value libpq can't send (a bug in the caller) raises to that caller;
    nothing was sent, and the next statements, the caller's own and the
    server's, go as before."""
    runtime = await PostgresRuntime.connect(dsn, lock_connections=1, lock_io_timeout=2.0)
    try:
        lease = await runtime.journal.acquire("refused", 0)
        await lease.open(pinned=None, resume_last=False)
        lock_conn = lease.lock_conn
        await lock_conn.write([JournalRow("steps", "refused", "warm", b"w")])
        with pytest.raises(TypeError):
            await lock_conn.write([JournalRow("steps", "refused", "k", "text")])  # type: ignore[arg-type]
        with anyio.fail_after(5):
            await lock_conn.write([JournalRow("steps", "refused", "next", b"n")])
            # Larger than a caller sends itself: the server's turn.
            await lock_conn.write([JournalRow("steps", "refused", "big", b"b" * 100_000)])
        assert lock_conn.fenced is None
        assert await _written(dsn, "refused", "big") == b"b" * 100_000
    finally:
        await runtime.aclose()
