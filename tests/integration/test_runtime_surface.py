"""Connecting, migrating, bad input, loomflow compatibility, busy scopes."""

from __future__ import annotations

import inspect
import pickle
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import psycopg
import pytest
from loomflow.runtime import PostgresRuntime as LoomflowPostgresRuntime
from loomflow.runtime import journal_scope
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool

from loomflow_worker.runtime import (
    DatabaseUnavailable,
    InvalidInput,
    PostgresRuntime,
    SchemaError,
    SessionBusy,
    latest_version,
    migrate,
    scope_lock_key,
)
from loomflow_worker.runtime.runtime import RuntimeOptions
from loomflow_worker.runtime.sql import migrations
from loomflow_worker.testing import DeterministicModel, EffectsLog

from .helpers import calls, crash_on, crashes, make_agent, wait_until_async

pytestmark = pytest.mark.anyio


# ---- connecting and migrating ---------------------------------------------------------


async def test_an_unreachable_database_is_a_clear_error_naming_the_host() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(DatabaseUnavailable) as info:
        await PostgresRuntime.connect(f"postgresql://postgres:s3cret@127.0.0.1:{port}/db")
    assert f"127.0.0.1:{port}/db" in str(info.value)
    assert "s3cret" not in str(info.value)
    assert time.monotonic() - started < 5


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP port that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        server.close()


async def test_a_server_that_never_answers_times_out_instead_of_hanging(
    silent_server: int,
) -> None:
    started = time.monotonic()
    with pytest.raises(DatabaseUnavailable) as info:
        await PostgresRuntime.connect(
            f"postgresql://postgres@127.0.0.1:{silent_server}/db", connect_timeout=2
        )
    assert f"127.0.0.1:{silent_server}" in str(info.value)
    assert time.monotonic() - started < 10


async def test_many_processes_migrating_at_once_apply_each_version_once(empty_dsn: str) -> None:
    async def one() -> list[int]:
        async with await psycopg.AsyncConnection.connect(empty_dsn) as conn:
            return await migrate(conn)

    results: list[list[int]] = []

    async def run() -> None:
        results.append(await one())

    async with anyio.create_task_group() as tg:
        for _ in range(8):
            tg.start_soon(run)
    applied = [r for r in results if r]
    assert len(applied) == 1
    assert applied[0] == [m.version for m in migrations()]
    async with await psycopg.AsyncConnection.connect(empty_dsn) as conn:
        cur = await conn.execute("SELECT version FROM loomflow_worker_schema ORDER BY version")
        assert [r[0] for r in await cur.fetchall()] == applied[0]
        assert await migrate(conn) == []


async def test_a_schema_newer_than_the_package_is_refused(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO loomflow_worker_schema (version, name) VALUES (%s, 'future')",
            (latest_version() + 1,),
        )
        with pytest.raises(SchemaError, match="upgrade loomflow-worker"):
            await migrate(conn)


async def test_construction_from_an_existing_pool(dsn: str) -> None:
    pool: AsyncConnectionPool = AsyncConnectionPool(dsn, open=False, kwargs={"autocommit": True})
    await pool.open()
    try:
        runtime = PostgresRuntime(pool)
        effects = EffectsLog(dsn)
        result = await make_agent(runtime, effects).run(calls("a"), session_id="s")
        assert result.output == "done: recorded a"
        await runtime.aclose()
        assert not pool.closed  # the caller's pool stays the caller's
    finally:
        await pool.close()


async def test_a_pool_of_another_driver_is_refused() -> None:
    with pytest.raises(InvalidInput, match="AsyncConnectionPool"):
        PostgresRuntime(object())  # type: ignore[arg-type]


def test_connect_passes_on_every_option_of_the_constructor() -> None:
    params = inspect.signature(PostgresRuntime).parameters
    options = {name for name, p in params.items()
               if p.kind is inspect.Parameter.KEYWORD_ONLY and not name.startswith("_")}
    assert set(RuntimeOptions.__annotations__) == options


async def test_the_lock_connections_connect_within_the_runtime_s_connect_timeout(
    dsn: str,
) -> None:
    runtime = await PostgresRuntime.connect(dsn, connect_timeout=3)
    try:
        assert runtime.journal.lock_settings.connect_timeout == 3
    finally:
        await runtime.aclose()


# ---- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("session_id", "message"),
    [("", "empty"), ("   ", "empty"), ("a\x00b", "control character"),
     ("line\nbreak", "control character"), ("x" * 600, "600 characters")],
)
async def test_bad_session_ids_are_refused_before_anything_is_written(
    runtime: PostgresRuntime, dsn: str, session_id: str, message: str
) -> None:
    effects = EffectsLog(dsn)
    with pytest.raises(InvalidInput, match=message):
        await make_agent(runtime, effects).run(calls("a"), session_id=session_id)
    assert await effects.counts() == {}


async def test_a_bad_user_id_is_refused(runtime: PostgresRuntime, dsn: str) -> None:
    with pytest.raises(InvalidInput, match="user_id"):
        await make_agent(runtime, EffectsLog(dsn)).run(
            calls("a"), session_id="s", user_id="bad\x07id"
        )


class Opaque:
    """A value the JSON codec can't store."""


async def test_an_unencodable_value_is_logged_counted_and_reexecuted(
    runtime: PostgresRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    executed = 0

    async def produce() -> Opaque:
        nonlocal executed
        executed += 1
        return Opaque()

    class Stop(BaseException):
        pass

    for _ in range(2):
        with pytest.raises(Stop):
            async with runtime.session("s"):
                assert isinstance(await runtime.step("opaque", produce), Opaque)
                raise Stop
    assert executed == 2
    assert runtime.stats.codec.unencodable == 2
    assert "can't store" in caplog.text


class Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (Path.touch, (str(Path("/tmp") / "lfw-unpickled-marker"),))


async def test_an_undecodable_value_reruns_the_step_and_nothing_is_unpickled(
    runtime: PostgresRuntime, dsn: str, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(Boom()).replace(
        b"/tmp/lfw-unpickled-marker", str(marker).encode()
    )
    executed = 0

    async def produce() -> str:
        nonlocal executed
        executed += 1
        return "fresh"

    class Stop(BaseException):
        pass

    with pytest.raises(Stop):
        async with runtime.session("s"):
            await runtime.step("v", produce)
            raise Stop
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "UPDATE journal_steps SET value = %s WHERE session_id = 's' AND step_name LIKE 'v@%%'",
            (payload,),
        )
        assert cur.rowcount == 1
    async with runtime.session("s"):
        assert await runtime.step("v", produce) == "fresh"
    assert executed == 2
    assert not marker.exists()
    assert runtime.stats.codec.undecodable == 1
    assert "can't decode" in caplog.text


# ---- busy scopes ---------------------------------------------------------------------------


async def test_a_busy_scope_raises_session_busy_after_the_wait(dsn: str) -> None:
    waiter = await PostgresRuntime.connect(dsn, lock_wait_timeout=0.3)
    try:
        # Another process holds the scope.
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as other:
            await other.execute("SELECT pg_advisory_lock(%s)", (scope_lock_key("s"),))
            started = time.monotonic()
            with pytest.raises(SessionBusy, match="busy") as info:
                async with waiter.session("s"):
                    pass
            assert 0.25 < time.monotonic() - started < 3
            assert info.value.scope == "s"
            async with waiter.session("other"):  # another session is free
                pass
        async with waiter.session("s"):  # free once the holder is gone
            pass
    finally:
        await waiter.aclose()


async def _tried_the_lock(dsn: str, runtime: PostgresRuntime) -> bool:
    """Whether a lock connection of ``runtime`` has tried a scope's lock (a
    waiting run tries it again every few milliseconds; it does not block)."""
    pids = [lock_conn.backend_pid for lock_conn in runtime.journal.live_connections()]
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = ANY(%s)"
            " AND query LIKE '%%pg_try_advisory_lock%%')", (pids,))
        row = await cur.fetchone()
    return bool(row and row[0])


async def test_a_waiting_run_starts_when_the_holder_ends(dsn: str) -> None:
    first = await PostgresRuntime.connect(dsn)
    second = await PostgresRuntime.connect(dsn, lock_wait_timeout=10)
    order: list[str] = []
    held = anyio.Event()

    async def hold() -> None:
        async with first.session("s"):
            held.set()
            # The second run waits meanwhile.
            await wait_until_async(lambda: _tried_the_lock(dsn, second),
                                   "the second run tried the lock", 5, every=0.01)
            order.append("first ends")

    async def wait() -> None:
        await held.wait()
        async with second.session("s"):
            order.append("second starts")

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(hold)
            tg.start_soon(wait)
    finally:
        await first.aclose()
        await second.aclose()
    assert order == ["first ends", "second starts"]


# ---- loomflow compatibility ------------------------------------------------------------


async def test_a_journal_written_by_loomflows_runtime_resumes_here(dsn: str) -> None:
    parts = conninfo_to_dict(dsn)
    url = f"postgresql://{parts['user']}@{parts['host']}:{parts['port']}/{parts['dbname']}"
    theirs = await LoomflowPostgresRuntime.connect(url)
    try:
        crashing = EffectsLog(dsn, on_start=crash_on("b"))
        with crashes():
            await make_agent(theirs, crashing).run(calls("a", "b"), session_id="s", user_id="u")
    finally:
        await theirs.aclose()
    ours = await PostgresRuntime.connect(dsn)
    try:
        effects = EffectsLog(dsn)
        model = DeterministicModel()
        result = await make_agent(ours, effects, model=model).run(
            calls("a", "b"), session_id="s", user_id="u"
        )
    finally:
        await ours.aclose()
    assert result.output == "done: recorded a, recorded b"
    assert await effects.counts() == {"a": 1, "b": 2}
    assert model.calls == 1  # turns 1 and 2 replayed from loomflow's journal
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM journal_steps WHERE session_id = %s",
            (journal_scope("s", "u"),),
        )
        row = await cur.fetchone()
        assert row is not None and row[0] > 0


async def test_many_first_runs_at_once_on_a_new_runtime(dsn: str) -> None:
    runtime = await PostgresRuntime.connect(dsn)
    opened: list[str] = []

    async def one(session_id: str) -> None:
        async with runtime.session(session_id):
            opened.append(session_id)

    try:
        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, f"s{i}")
    finally:
        await runtime.aclose()
    assert sorted(opened) == [f"s{i}" for i in range(6)]
