"""Turn-taking, crash recovery and fencing across real OS processes (G1, G3, G5, G6).

The multi-process tests run ``tests/integration/proc_agent.py`` in
subprocesses (a start barrier on stdin lines them up) and judge them by
what Postgres recorded: the ``EffectsLog`` table (every tool execution,
with its process and its start and end times) and the journal itself.
The fencing tests run in-process and cut the run's lock connection for
real: ``pg_terminate_backend`` on it, or a TCP proxy that stops
forwarding.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream
from loomflow import Agent
from loomflow.runtime import _codec, journal_scope

from loomflow_worker.runtime import (
    Lease,
    LockLost,
    PostgresRuntime,
    current_lease,
    run_options,
    scope_lock_key,
)
from loomflow_worker.testing import DeterministicModel, EffectsLog, Execution
from tests.waiting import wait_until_async

from .proc_agent import EVENT_PREFIX

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
USER = "u1"

# ---- prompts -------------------------------------------------------------------------------


def chain(*tags: str) -> str:
    """A prompt asking for one tool call per turn, one turn per tag."""
    return "\n".join(f'call record {{"tag": "{tag}"}}' for tag in tags)


def answer(*tags: str) -> str:
    """What ``DeterministicModel`` answers after the tool calls of ``chain(*tags)``."""
    return "done: " + ", ".join(f"recorded {tag}" for tag in tags)


# ---- subprocesses ----------------------------------------------------------------------------


@dataclass
class Child:
    """A running ``proc_agent`` and the events it reported so far."""

    name: str
    proc: Process
    stdout: BufferedByteReceiveStream
    stderr_path: Path
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-6000:]

    def runs(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "run"]

    async def next_event(self, deadline: float) -> dict[str, Any] | None:
        """The next event it prints, or ``None`` once its stdout is closed."""
        while True:
            try:
                with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
                    line = await self.stdout.receive_until(b"\n", 1 << 20)
            except (anyio.IncompleteRead, anyio.EndOfStream):
                return None
            except TimeoutError:
                raise AssertionError(
                    f"{self.name}: no event before the deadline; stderr:\n{self.stderr()}"
                ) from None
            text = line.decode("utf-8", "replace")
            if text.startswith(EVENT_PREFIX):
                event: dict[str, Any] = json.loads(text[len(EVENT_PREFIX) :])
                self.events.append(event)
                return event

    async def expect(self, name: str, within: float) -> dict[str, Any]:
        """Read events until one called ``name``, for at most ``within`` seconds."""
        deadline = anyio.current_time() + within
        while True:
            event = await self.next_event(deadline)
            if event is None:
                raise AssertionError(
                    f"{self.name} closed its stdout before {name!r}; stderr:\n{self.stderr()}"
                )
            if event["event"] == name:
                return event

    async def go(self) -> None:
        """Lift its start barrier."""
        assert self.proc.stdin is not None
        await self.proc.stdin.send(b"go\n")

    async def finish(self, within: float) -> int:
        """Read the rest of its events, wait for it to exit and return its exit code."""
        deadline = anyio.current_time() + within
        while await self.next_event(deadline) is not None:
            pass
        with anyio.fail_after(max(0.1, deadline - anyio.current_time())):
            return await self.proc.wait()


Spawn = Callable[..., Awaitable[Child]]


def agent_args(
    dsn: str,
    session: str,
    prompts: Sequence[str],
    *,
    sleep: float = 0.0,
    crash_tag: str | None = None,
    wait_go: bool = False,
) -> list[str]:
    args = ["--dsn", dsn, "--session", session, "--user", USER, "--sleep", str(sleep)]
    for prompt in prompts:
        args += ["--prompt", prompt]
    if crash_tag is not None:
        args += ["--crash-tag", crash_tag]
    if wait_go:
        args.append("--wait-go")
    return args


@asynccontextmanager
async def processes(tmp_path: Path) -> AsyncIterator[Spawn]:
    """``spawn(name, *args)`` starts a ``proc_agent``; every one left is killed at exit."""
    children: list[Child] = []

    async def spawn(name: str, *args: str) -> Child:
        stderr_path = tmp_path / f"{name}.stderr"
        with stderr_path.open("wb") as stderr:
            proc = await anyio.open_process(
                [sys.executable, "-m", "tests.integration.proc_agent", *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                cwd=ROOT,
            )
        assert proc.stdout is not None
        child = Child(name, proc, BufferedByteReceiveStream(proc.stdout), stderr_path)
        children.append(child)
        return child

    try:
        yield spawn
    finally:
        with anyio.CancelScope(shield=True):
            for child in children:
                if child.proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        child.proc.kill()
                with anyio.move_on_after(10):
                    await child.proc.aclose()


async def start_together(children: Sequence[Child], within: float = 30) -> None:
    """Wait until every child is connected and waiting, then let them all go."""
    for child in children:
        await child.expect("ready", within)
    for child in children:
        await child.go()


async def finish_all(children: Sequence[Child], within: float) -> None:
    for child in children:
        code = await child.finish(within)
        assert code == 0, f"{child.name} exited with {code}; stderr:\n{child.stderr()}"


# ---- what Postgres recorded ------------------------------------------------------------------


async def read_epoch(dsn: str, scope: str) -> int | None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT value FROM journal_steps WHERE session_id = %s AND step_name = %s",
            (scope, "__run_epoch__"),
        )
        row = await cur.fetchone()
    if row is None:
        return None
    epoch = _codec.loads(bytes(row[0]))
    assert isinstance(epoch, int)
    return epoch


JournalRow = tuple[str, str, str, str, float]


async def journal_snapshot(dsn: str) -> set[JournalRow]:
    """Every journal row (steps and streams) with a digest of its value and its write time."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT 'step', session_id, step_name, md5(value), created_at FROM journal_steps"
            " UNION ALL"
            " SELECT 'stream', session_id, step_name, md5(chunks), created_at"
            " FROM journal_streams"
        )
        return set(await cur.fetchall())


async def wait_lock_free(conn: psycopg.AsyncConnection[Any], key: int, within: float) -> float:
    """Poll until the advisory lock ``key`` can be taken; release it again.

    Returns the ``time.time()`` at which it was taken."""
    async def taken() -> float | None:
        """When it took the lock (and released it), or None: still held."""
        cur = await conn.execute("SELECT pg_try_advisory_lock(%s)", (key,))
        row = await cur.fetchone()
        if row is None or not row[0]:
            return None
        taken_at = time.time()
        cur = await conn.execute("SELECT pg_advisory_unlock(%s)", (key,))
        row = await cur.fetchone()
        assert row is not None and row[0] is True
        return taken_at

    taken_at = await wait_until_async(taken, f"advisory lock {key} free", within, every=0.005)
    assert taken_at is not None
    return taken_at


async def lock_is_free(conn: psycopg.AsyncConnection[Any], key: int) -> bool:
    cur = await conn.execute("SELECT pg_try_advisory_lock(%s)", (key,))
    row = await cur.fetchone()
    if row is None or not row[0]:
        return False
    await conn.execute("SELECT pg_advisory_unlock(%s)", (key,))
    return True


Span = tuple[datetime, datetime]


def span(executions: Sequence[Execution]) -> Span:
    """``[first start, last finish]`` of some tool executions, all of them finished."""
    assert executions, "no executions"
    unfinished = [e for e in executions if e.finished_at is None]
    assert not unfinished, f"unfinished executions: {unfinished}"
    return min(e.started_at for e in executions), max(e.finished_at for e in executions)


def assert_disjoint(spans: dict[str, Span]) -> list[str]:
    """No two spans intersect; returns their names in time order."""
    ordered = sorted(spans.items(), key=lambda item: item[1][0])
    for (a, (_, a_end)), (b, (b_start, _)) in itertools.pairwise(ordered):
        assert a_end <= b_start, (
            f"{a} ran until {a_end.isoformat()} but {b} started at {b_start.isoformat()}: "
            f"runs on one scope interleaved ({ordered})"
        )
    return [name for name, _ in ordered]


def assert_contended(children: Sequence[Child]) -> None:
    """Every run was asked for before any returned: they really competed for the scope."""
    runs = [r for child in children for r in child.runs()]
    assert max(r["asked"] for r in runs) < min(r["returned"] for r in runs), runs


# ---- 1. turn-taking across processes (G3) ---------------------------------------------------


async def test_two_processes_on_one_scope_never_interleave(dsn: str, tmp_path: Path) -> None:
    session = "s-interleave"
    scope = journal_scope(session, USER)
    tags = {"a": ("a1", "a2", "a3"), "b": ("b1", "b2", "b3")}
    async with processes(tmp_path) as spawn:
        children = {
            name: await spawn(name, *agent_args(dsn, session, [chain(*t)], sleep=0.2, wait_go=True))
            for name, t in tags.items()
        }
        await start_together(list(children.values()))
        await finish_all(list(children.values()), within=30)

    for name, child in children.items():
        [run] = child.runs()
        assert run["output"] == answer(*tags[name])
    assert_contended(list(children.values()))

    executions = await EffectsLog(dsn).executions()
    assert Counter(e.tag for e in executions) == {t: 1 for ts in tags.values() for t in ts}
    spans = {
        name: span([e for e in executions if e.pid == child.pid])
        for name, child in children.items()
    }
    first, second = assert_disjoint(spans)
    # The run that went first opened epoch 0, the one that waited for it epoch 1.
    assert children[first].runs()[0]["epochs"] == [0]
    assert children[second].runs()[0]["epochs"] == [1]
    assert await read_epoch(dsn, scope) == 2


# ---- 2. SIGKILL mid-tool, resume in a new process (G1) --------------------------------------


async def test_sigkill_mid_tool_frees_the_scope_and_resumes(dsn: str, tmp_path: Path) -> None:
    session = "s-sigkill"
    scope = journal_scope(session, USER)
    prompt = chain("t1", "t2", "t3")
    async with (
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin,
        processes(tmp_path) as spawn,
    ):
        first = await spawn("first", *agent_args(dsn, session, [prompt], crash_tag="t3"))
        killing = await first.expect("killing", within=30)
        freed_at = await wait_lock_free(admin, scope_lock_key(scope), within=5)
        code = await first.finish(within=10)
        assert code == -signal.SIGKILL, first.stderr()
        lock_free_after = freed_at - killing["at"]
        print(f"scope lock free {lock_free_after * 1000:.1f} ms after SIGKILL")
        assert lock_free_after < 1.0
        assert first.runs() == []

        second = await spawn("second", *agent_args(dsn, session, [prompt]))
        await finish_all([second], within=30)

    [run] = second.runs()
    assert run["output"] == answer("t1", "t2", "t3")
    executions = await EffectsLog(dsn).executions()
    assert Counter(e.tag for e in executions) == {"t1": 1, "t2": 1, "t3": 2}
    assert {e.pid for e in executions if e.tag in ("t1", "t2")} == {first.pid}
    # t3 twice: cut short by the kill, then run to the end by the new process.
    t3 = [(e.pid, e.finished_at is not None) for e in executions if e.tag == "t3"]
    assert t3 == [(first.pid, False), (second.pid, True)]
    # The killed run journaled model calls 1-3 (the third one asked for t3) and
    # tools t1, t2: the new process replays those 5 steps in the same epoch,
    # then executes t3, the final model call and the episode write.
    assert run["epochs"] == [0]
    assert run["model_calls"] == 1
    assert run["steps_replayed"] == 5
    assert run["steps_executed"] == 3
    assert await read_epoch(dsn, scope) == 1


# ---- 3. loomflow's cross-process race (LOOMFLOW-NOTES bug 1; G3, G5) -----------------------


async def test_same_request_twice_at_once_runs_twice_in_turn(dsn: str, tmp_path: Path) -> None:
    session = "s-race"
    scope = journal_scope(session, USER)
    prompt = chain("t1", "t2")
    async with processes(tmp_path) as spawn:
        children = [
            await spawn(name, *agent_args(dsn, session, [prompt], sleep=0.2, wait_go=True))
            for name in ("x", "y")
        ]
        await start_together(children)
        await finish_all(children, within=30)

    assert_contended(children)
    for child in children:
        [run] = child.runs()
        assert run["output"] == answer("t1", "t2")
        # Each request ran fresh in its own epoch: nothing of the other's replayed.
        assert run["steps_replayed"] == 0
        assert run["model_calls"] == 3
    assert sorted(child.runs()[0]["epochs"] for child in children) == [[0], [1]]

    executions = await EffectsLog(dsn).executions()
    assert Counter((e.tag, e.pid) for e in executions) == {
        (tag, child.pid): 1 for tag in ("t1", "t2") for child in children
    }
    assert_disjoint(
        {child.name: span([e for e in executions if e.pid == child.pid]) for child in children}
    )
    assert await read_epoch(dsn, scope) == 2


# ---- 4. no lost epoch update, no step back (G5) --------------------------------------------


async def test_concurrent_runs_advance_the_epoch_once_each(
    dsn: str, tmp_path: Path, runtime: PostgresRuntime
) -> None:
    session = "s-epochs"
    scope = journal_scope(session, USER)
    n_procs, n_runs = 4, 3
    async with processes(tmp_path) as spawn:
        children = [
            await spawn(
                f"p{i}",
                *agent_args(
                    dsn,
                    session,
                    [chain(f"p{i}-r{j}") for j in range(n_runs)],
                    sleep=0.02,
                    wait_go=True,
                ),
            )
            for i in range(n_procs)
        ]
        await start_together(children)
        await finish_all(children, within=60)

    total = n_procs * n_runs
    runs = [run for child in children for run in child.runs()]
    assert len(runs) == total
    assert all(run["steps_replayed"] == 0 for run in runs), runs
    # Every run opened an epoch of its own: none reused, none skipped ...
    assert sorted(e for run in runs for e in run["epochs"]) == list(range(total))
    # ... and a process's later runs opened later epochs.
    for child in children:
        opened = [run["epochs"][0] for run in child.runs()]
        assert opened == sorted(opened), (child.name, opened)
    assert await read_epoch(dsn, scope) == total

    effects = EffectsLog(dsn)
    executions = await effects.executions()
    assert Counter(e.tag for e in executions) == {
        f"p{i}-r{j}": 1 for i in range(n_procs) for j in range(n_runs)
    }
    assert_disjoint({e.tag: span([e]) for e in executions})

    # The 13th run repeats p0's first request: it must run, not replay epoch 0.
    model = DeterministicModel()
    agent = Agent("t", model=model, tools=[effects.tool()], runtime=runtime, auto_extract=False)
    opened_13: list[int] = []

    async def on_open(attempt: Lease, epoch: int) -> None:
        opened_13.append(epoch)

    with run_options(on_open=on_open):
        result = await agent.run(chain("p0-r0"), session_id=session, user_id=USER)
    assert result.output == answer("p0-r0")
    assert opened_13 == [total]
    assert runtime.stats.steps_replayed == 0
    assert model.calls == 2
    assert (await effects.counts("p0-r0"))["p0-r0"] == 2
    assert await read_epoch(dsn, scope) == total + 1


# ---- 5. fencing: the lock connection's backend is terminated (G6) ---------------------------


async def test_terminated_lock_backend_fences_the_run(dsn: str, runtime: PostgresRuntime) -> None:
    session = "s-terminated"
    scope = journal_scope(session, USER)
    prompt = chain("t1", "t2", "t3")
    cut: dict[str, Any] = {}

    async def terminate_own_lock_backend(tag: str) -> None:
        if tag != "t2" or cut:
            return
        attempt = current_lease()
        assert attempt is not None and attempt.scope == scope
        cut["journal"] = await journal_snapshot(dsn)
        cut["pid"] = attempt.backend_pid
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin:
            # Wait (up to 5 s) until the backend is gone: its lock is free.
            cur = await admin.execute("SELECT pg_terminate_backend(%s, 5000)", (cut["pid"],))
            row = await cur.fetchone()
            assert row is not None and row[0] is True

    effects = EffectsLog(dsn, on_start=terminate_own_lock_backend)
    model = DeterministicModel()
    agent = Agent("t", model=model, tools=[effects.tool()], runtime=runtime, auto_extract=False)
    with pytest.raises(LockLost) as raised:
        await agent.run(prompt, session_id=session, user_id=USER)

    # t2's result could not be journaled; loomflow turned that LockLost into an
    # error ToolResult, and the next step (model call 3) raised it out of run().
    assert type(raised.value) is LockLost
    assert raised.value.scope == scope
    assert isinstance(raised.value.__cause__, psycopg.errors.AdminShutdown)
    assert model.calls == 2
    assert await effects.counts() == {"t1": 1, "t2": 1}
    assert await journal_snapshot(dsn) == cut["journal"], "journal written after the cut"
    assert await read_epoch(dsn, scope) is None

    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin:
        assert await lock_is_free(admin, scope_lock_key(scope))

    # Another runtime takes the scope and resumes: t1 replays, t2 runs again.
    other = await PostgresRuntime.connect(dsn, lock_wait_timeout=10)
    try:
        effects.on_start = None
        model_2 = DeterministicModel()
        agent_2 = Agent(
            "t", model=model_2, tools=[effects.tool()], runtime=other, auto_extract=False
        )
        result = await agent_2.run(prompt, session_id=session, user_id=USER)
        assert result.output == answer("t1", "t2", "t3")
        assert other.stats.steps_replayed == 3  # model calls 1-2 and t1
        assert model_2.calls == 2  # the ones after t2 and after t3
    finally:
        await other.aclose()
    assert await effects.counts() == {"t1": 1, "t2": 2, "t3": 1}
    assert await read_epoch(dsn, scope) == 1

    # The fenced runtime dropped its dead lock connection and works again.
    result = await agent.run(chain("t4"), session_id=session, user_id=USER)
    assert result.output == answer("t4")
    assert await read_epoch(dsn, scope) == 2


# ---- 6. fencing: the lock connection freezes (G6) -------------------------------------------


class FreezableProxy:
    """A TCP proxy to Postgres whose links can be frozen like a network partition.

    ``freeze()`` stops forwarding in both directions: bytes read from
    either side are dropped, an end of stream is not passed on, and new
    connections wait. ``resume()`` forwards again; a link that lost bytes
    while frozen can't carry on (its stream has a hole) and is closed."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._frozen = False
        self._thawed = asyncio.Event()
        self._thawed.set()
        self._links: set[_Link] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def freeze(self) -> None:
        self._frozen = True
        self._thawed.clear()

    def resume(self) -> None:
        for link in list(self._links):
            if link.broken:
                link.close()
        self._frozen = False
        self._thawed.set()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            link.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # asyncio runs this as a task nobody awaits: it must not end cancelled.
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._serve(reader, writer)
        except asyncio.CancelledError:
            writer.close()
        finally:
            self._handlers.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._thawed.wait()
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return
        link = _Link(writer, up_writer)
        self._links.add(link)
        try:
            await asyncio.gather(
                self._pump(link, reader, up_writer), self._pump(link, up_reader, writer)
            )
        finally:
            self._links.discard(link)
            link.close()

    async def _pump(
        self, link: _Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            while data := await reader.read(65536):
                if self._frozen or link.broken:
                    link.broken = True
                    continue
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        if self._frozen:
            # A partition passes no FIN on: the peer stays up until resume().
            link.broken = True
            await link.closed.wait()
        else:
            link.close()


@dataclass(eq=False)
class _Link:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    broken: bool = False
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    def close(self) -> None:
        self.client.close()
        self.upstream.close()
        self.closed.set()


@pytest.fixture
async def proxy(dsn: str) -> AsyncIterator[FreezableProxy]:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    px = FreezableProxy(
        str(params.get("host") or "127.0.0.1"), int(str(params.get("port") or 5432))
    )
    await px.start()
    try:
        yield px
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await px.stop()


async def test_frozen_lock_connection_fences_the_run(dsn: str, proxy: FreezableProxy) -> None:
    io_timeout = 1.0
    session = "s-frozen"
    scope = journal_scope(session, USER)
    key = scope_lock_key(scope)
    prompt = chain("t1", "t2", "t3")
    proxy_dsn = psycopg.conninfo.make_conninfo(dsn, host="127.0.0.1", port=proxy.port)
    frozen: dict[str, Any] = {}

    async def freeze_lock_connection(tag: str) -> None:
        if tag != "t2" or frozen:
            return
        attempt = current_lease()
        assert attempt is not None and attempt.scope == scope
        frozen["pid"] = attempt.backend_pid
        frozen["journal"] = await journal_snapshot(dsn)
        proxy.freeze()
        frozen["at"] = anyio.current_time()

    effects = EffectsLog(dsn, on_start=freeze_lock_connection)
    model = DeterministicModel()
    runtime = await PostgresRuntime.connect(
        proxy_dsn, lock_io_timeout=io_timeout, lock_wait_timeout=5
    )
    try:
        agent = Agent("t", model=model, tools=[effects.tool()], runtime=runtime, auto_extract=False)
        # A hang fails here, well before pytest's own timeout.
        with anyio.fail_after(io_timeout + 20), pytest.raises(LockLost) as raised:
            await agent.run(prompt, session_id=session, user_id=USER)
        fenced_after = anyio.current_time() - frozen["at"]
        print(f"LockLost {fenced_after:.2f} s after the freeze (lock_io_timeout={io_timeout})")
        assert fenced_after < io_timeout + 1.5
        assert type(raised.value) is LockLost
        assert isinstance(raised.value.__cause__, TimeoutError)
        assert model.calls == 2

        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin:
            # The server still sees the frozen backend and its lock: the
            # fenced run gave up on its own, and wrote nothing since.
            cur = await admin.execute(
                "SELECT application_name FROM pg_stat_activity WHERE pid = %s", (frozen["pid"],)
            )
            assert await cur.fetchall() == [("loomflow-worker lock",)]
            assert not await lock_is_free(admin, key)
            # What an operator (or a sweeper) does about a frozen worker.
            cur = await admin.execute("SELECT pg_terminate_backend(%s, 5000)", (frozen["pid"],))
            assert await cur.fetchone() == (True,)
            await wait_lock_free(admin, key, within=5)
        proxy.resume()
        assert await journal_snapshot(dsn) == frozen["journal"], "journal written after freeze"
        assert await effects.counts() == {"t1": 1, "t2": 1}
    finally:
        proxy.resume()
        with anyio.CancelScope(shield=True), anyio.move_on_after(15):
            await runtime.aclose()

    # Another runtime, straight to Postgres, resumes: t1 replays, t2 runs again.
    direct = await PostgresRuntime.connect(dsn, lock_wait_timeout=5)
    try:
        effects.on_start = None
        model_2 = DeterministicModel()
        agent_2 = Agent(
            "t", model=model_2, tools=[effects.tool()], runtime=direct, auto_extract=False
        )
        result = await agent_2.run(prompt, session_id=session, user_id=USER)
        assert result.output == answer("t1", "t2", "t3")
        assert direct.stats.steps_replayed == 3  # model calls 1-2 and t1
        assert model_2.calls == 2
    finally:
        await direct.aclose()
    assert await effects.counts() == {"t1": 1, "t2": 2, "t3": 1}
    assert await read_epoch(dsn, scope) == 1
