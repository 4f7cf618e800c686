"""Benchmark loomflow_worker's PostgresRuntime against a bare upsert and loomflow's own
PostgresRuntime, side by side in one run.

Measures, on a scratch database it creates and drops:

1. a fresh journaled step (no-op callable) inside one open run, against one bare
   ``INSERT ... ON CONFLICT DO UPDATE`` round trip (psycopg 3, one autocommit
   connection) and against loomflow's asyncpg ``PostgresRuntime``;
2. replaying a crashed run of 1,000 steps (every step answered from the journal,
   the callable never runs), ours against loomflow's;
3. the handoff of one scope's lock between two OS processes: how long after
   process A's run has left its session process B, waiting for the lock, starts
   its first step;
4. resuming a finished agent run of 100 tool calls (every model and tool call
   replayed), ours against loomflow's ``JournaledRuntime()`` and its in-memory
   journal.

The variants are interleaved in rounds (their order rotates every round) and
medians are reported, because the machine is noisy. Run it with::

    python bench/bench_runtime.py [--quick]

The admin connection string defaults to postgresql://postgres@127.0.0.1:5432/postgres
and is overridden by LOOMFLOW_WORKER_BENCH_ADMIN_DSN.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import multiprocessing
import os
import platform
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from multiprocessing.connection import Connection
from typing import Any
from urllib.parse import quote, urlencode

import anyio
import anyio.to_thread
import psycopg
from loomflow.core.context import get_run_context
from loomflow.runtime import PostgresRuntime as LoomPG
from loomflow.runtime.journaled import JournaledRuntime
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from loomflow_worker.runtime import PostgresRuntime, scope_lock_key
from loomflow_worker.runtime.codec import CodecStats, encode

ADMIN_DSN_ENV = "LOOMFLOW_WORKER_BENCH_ADMIN_DSN"
DEFAULT_ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"

# What every benchmarked step returns: 30 bytes once encoded, as the bare upsert writes.
STEP_VALUE = "x" * 25
STEP_BLOB = encode(STEP_VALUE, "json", CodecStats(), key="bench")
assert STEP_BLOB is not None

# The bare upsert is the statement the runtime sends for a fresh step.
UPSERT = (
    "INSERT INTO journal_steps (session_id, step_name, value, created_at)"
    " VALUES (%s, %s, %s, %s)"
    " ON CONFLICT (session_id, step_name) DO UPDATE"
    " SET value = EXCLUDED.value, created_at = EXCLUDED.created_at"
)

TARGET_OURS_OVER_UPSERT = 1.3
TARGET_LOOM_OVER_OURS_FRESH = 2.0
TARGET_LOOM_OVER_OURS_REPLAY = 20.0
TARGET_HANDOFF_P50_MS = 20.0
TARGET_RESUME_OVER_MEMORY = 1.2

LOCK_WAIT_S = 300.0  # process B waits this long for the scope at most
IPC_TIMEOUT_S = 60.0


class SimulatedCrash(BaseException):
    """Raised out of a session so that the run ends without advancing its epoch."""


# ---- statistics -------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, linearly interpolated."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    k = (len(ordered) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def ms(ns: float) -> float:
    return ns / 1e6


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


# ---- scratch database -------------------------------------------------------------------------


def database_uri(admin_dsn: str, dbname: str) -> str:
    """A ``postgresql://`` URI for ``dbname`` on the admin DSN's server.

    A URI rather than ``key=value`` because asyncpg (loomflow's runtime) reads only URIs."""
    parts: dict[str, Any] = {k: v for k, v in conninfo_to_dict(admin_dsn).items() if v}
    parts.pop("dbname", None)
    user = parts.pop("user", None)
    password = parts.pop("password", None)
    host = parts.pop("host", None)
    port = parts.pop("port", None)
    netloc = ""
    if user:
        netloc = quote(str(user), safe="")
        if password:
            netloc += ":" + quote(str(password), safe="")
        netloc += "@"
    if host and not str(host).startswith("/") and "," not in str(host):
        netloc += f"[{host}]" if ":" in str(host) else str(host)
        if port:
            netloc += f":{port}"
    else:
        if host:
            parts["host"] = host
        if port:
            parts["port"] = port
    query = f"?{urlencode({k: str(v) for k, v in parts.items()})}" if parts else ""
    return f"postgresql://{netloc}/{quote(dbname, safe='')}{query}"


def describe(dsn: str) -> str:
    parts = conninfo_to_dict(dsn)
    return f"{parts.get('host') or 'localhost'}:{parts.get('port') or 5432}/{parts.get('dbname')}"


def create_database(admin_dsn: str, name: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def drop_database(admin_dsn: str, name: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@contextlib.contextmanager
def scratch_database() -> Iterator[str]:
    """A database of its own for a benchmark (through LOOMFLOW_WORKER_BENCH_ADMIN_DSN, or
    the default), dropped after it; yields its connection string."""
    admin_dsn = os.environ.get(ADMIN_DSN_ENV, DEFAULT_ADMIN_DSN)
    dbname = f"lfw_bench_{uuid.uuid4().hex[:10]}"
    create_database(admin_dsn, dbname)
    try:
        yield database_uri(admin_dsn, dbname)
    finally:
        drop_database(admin_dsn, dbname)


# ---- 0. setup and checks ----------------------------------------------------------------------


async def noop() -> str:
    return STEP_VALUE


async def setup(dsn: str) -> str:
    """Migrate the scratch database and check that a session outside Agent.run works."""
    rt = await PostgresRuntime.connect(dsn)
    try:
        await rt.init_schema()
        ctx = get_run_context()
        if ctx.user_id is not None:
            raise RuntimeError(f"expected the default run context, got user_id={ctx.user_id!r}")
        async with rt.session("bench-context-check"):
            value = await rt.step("probe", noop)
        if value != STEP_VALUE:
            raise RuntimeError(f"step returned {value!r}")
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT count(*) FROM journal_steps WHERE session_id = %s AND step_name LIKE %s",
                ("bench-context-check", "probe@%"),
            )
            row = await cur.fetchone()
        if not row or row[0] != 1:
            raise RuntimeError("the probe step was not journaled under the bare session id")
        server = str(await _server_version(dsn))
    finally:
        await rt.aclose()
    return server


async def _server_version(dsn: str) -> str:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute("SHOW server_version")
        row = await cur.fetchone()
    return str(row[0]) if row else "?"


# ---- 1. fresh steps ---------------------------------------------------------------------------


async def fresh_runtime(rt: JournaledRuntime, sid: str, n: int) -> list[int]:
    """Per-step nanoseconds of ``n`` fresh steps inside one open run."""
    times: list[int] = []
    async with rt.session(sid):
        for i in range(n):
            t0 = time.perf_counter_ns()
            await rt.step(f"s{i}", noop)
            times.append(time.perf_counter_ns() - t0)
    return times


async def fresh_upsert(conn: psycopg.AsyncConnection[Any], sid: str, n: int) -> list[int]:
    """Per-statement nanoseconds of ``n`` bare upserts of a 30-byte value."""
    times: list[int] = []
    for i in range(n):
        params = (sid, f"s{i}@0123456789abcdef", STEP_BLOB, time.time())
        t0 = time.perf_counter_ns()
        await conn.execute(UPSERT, params)
        times.append(time.perf_counter_ns() - t0)
    return times


FRESH_VARIANTS = ("ours", "upsert", "loomflow")


@dataclass
class FreshResult:
    orders: list[tuple[str, ...]] = field(default_factory=list)
    # variant -> per-round list of per-step samples (ns)
    samples: dict[str, list[list[int]]] = field(
        default_factory=lambda: {v: [] for v in FRESH_VARIANTS}
    )

    def round_p50(self, variant: str) -> list[float]:
        return [statistics.median(s) for s in self.samples[variant]]

    def p50(self, variant: str) -> float:
        return statistics.median(self.round_p50(variant))

    def round_ratios(self, num: str, den: str) -> list[float]:
        return [a / b for a, b in zip(self.round_p50(num), self.round_p50(den), strict=True)]

    def ratio(self, num: str, den: str) -> float:
        return statistics.median(self.round_ratios(num, den))


async def bench_fresh(
    ours: PostgresRuntime,
    loom: LoomPG,
    bare: psycopg.AsyncConnection[Any],
    steps: int,
    rounds: int,
    tag: str,
) -> FreshResult:
    runners: dict[str, Callable[[str, int], Awaitable[list[int]]]] = {
        "ours": lambda sid, n: fresh_runtime(ours, sid, n),
        "upsert": lambda sid, n: fresh_upsert(bare, sid, n),
        "loomflow": lambda sid, n: fresh_runtime(loom, sid, n),
    }
    # Warm-up: open pools and lock connections, let psycopg prepare its statements.
    for name, run in runners.items():
        await run(f"{tag}-fresh-warm-{name}", min(steps, 50))
    result = FreshResult()
    for r in range(rounds):
        order = FRESH_VARIANTS[r % 3 :] + FRESH_VARIANTS[: r % 3]
        if r % 2:
            order = tuple(reversed(order))
        result.orders.append(order)
        for name in order:
            gc.collect()
            samples = await runners[name](f"{tag}-fresh-r{r}-{name}", steps)
            result.samples[name].append(samples)
    return result


# ---- 2. replay ---------------------------------------------------------------------------------


@dataclass
class ReplayResult:
    """Per round and runtime: ``replay`` is reopening the session and replaying every
    step (the clock stops when the last step returns); ``run`` adds the session's clean
    exit (the epoch advance and unlock) to it."""

    steps: int
    orders: list[tuple[str, ...]] = field(default_factory=list)
    times: dict[str, dict[str, list[int]]] = field(
        default_factory=lambda: {
            kind: {"ours": [], "loomflow": []} for kind in ("replay", "run")
        }
    )

    def median(self, variant: str, kind: str = "replay") -> float:
        return statistics.median(self.times[kind][variant])

    def round_ratios(self, kind: str = "replay") -> list[float]:
        t = self.times[kind]
        return [a / b for a, b in zip(t["loomflow"], t["ours"], strict=True)]

    def ratio(self, kind: str = "replay") -> float:
        return statistics.median(self.round_ratios(kind))


async def write_crashed_run(rt: JournaledRuntime, sid: str, steps: int) -> None:
    """Journal ``steps`` steps, then crash out of the session (the epoch stays)."""

    def value_of(i: int) -> Callable[[], Awaitable[str]]:
        async def fn() -> str:
            return f"value-{i:06d}-{STEP_VALUE}"

        return fn

    try:
        async with rt.session(sid):
            for i in range(steps):
                await rt.step(f"s{i}", value_of(i))
            raise SimulatedCrash
    except SimulatedCrash:
        pass


async def timed_replay(rt: JournaledRuntime, sid: str, steps: int) -> tuple[int, int]:
    """Nanoseconds to reopen ``sid`` and replay its ``steps`` steps: until the last step
    returned, and until the session (the run ending cleanly) was closed."""
    executed = 0

    async def must_not_run() -> str:
        nonlocal executed
        executed += 1
        return "executed"

    out: list[Any] = []
    t0 = time.perf_counter_ns()
    async with rt.session(sid):
        for i in range(steps):
            out.append(await rt.step(f"s{i}", must_not_run))
        replayed = time.perf_counter_ns() - t0
    closed = time.perf_counter_ns() - t0
    if executed:
        raise AssertionError(f"{type(rt).__module__}: {executed} replayed step(s) ran again")
    expected = [f"value-{i:06d}-{STEP_VALUE}" for i in range(steps)]
    if out != expected:
        bad = next(i for i, (a, b) in enumerate(zip(out, expected, strict=True)) if a != b)
        raise AssertionError(f"{type(rt).__module__}: step {bad} replayed {out[bad]!r}")
    return replayed, closed


async def bench_replay(
    ours: PostgresRuntime, loom: LoomPG, steps: int, rounds: int, tag: str
) -> ReplayResult:
    runtimes: dict[str, JournaledRuntime] = {"ours": ours, "loomflow": loom}
    for name, rt in runtimes.items():  # warm-up
        sid = f"{tag}-replay-warm-{name}"
        await write_crashed_run(rt, sid, min(steps, 50))
        await timed_replay(rt, sid, min(steps, 50))
    result = ReplayResult(steps=steps)
    for r in range(rounds):
        order = ("ours", "loomflow") if r % 2 == 0 else ("loomflow", "ours")
        result.orders.append(order)
        for name in order:
            rt = runtimes[name]
            sid = f"{tag}-replay-r{r}-{name}"
            await write_crashed_run(rt, sid, steps)
            replayed_before = ours.stats.steps_replayed
            gc.collect()
            replayed, closed = await timed_replay(rt, sid, steps)
            result.times["replay"][name].append(replayed)
            result.times["run"][name].append(closed)
            if name == "ours" and ours.stats.steps_replayed - replayed_before != steps:
                raise AssertionError(
                    f"ours replayed {ours.stats.steps_replayed - replayed_before} of {steps}"
                )
    return result


async def bench_in_process(
    dsn: str, steps: int, rounds: int, replay_steps: int
) -> tuple[FreshResult, ReplayResult]:
    tag = uuid.uuid4().hex[:6]
    ours = await PostgresRuntime.connect(dsn)
    try:
        loom = await LoomPG.connect(dsn)
        try:
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as bare:
                fresh = await bench_fresh(ours, loom, bare, steps, rounds, tag)
            replay = await bench_replay(ours, loom, replay_steps, rounds, tag)
        finally:
            await loom.aclose()
    finally:
        await ours.aclose()
    return fresh, replay


# ---- 4. resuming a finished agent run --------------------------------------------------------


@dataclass
class ResumeResult:
    tools: int
    times: dict[str, list[float]] = field(
        default_factory=lambda: {"ours": [], "in-memory": []}
    )

    def median(self, name: str) -> float:
        return statistics.median(self.times[name])

    def ratios(self) -> list[float]:
        return [o / m for o, m in zip(self.times["ours"], self.times["in-memory"], strict=True)]


async def _noop_emit(event: Any) -> None:
    return None


RESUMES_PER_ROUND = 5


async def bench_resume(dsn: str, tools: int, rounds: int) -> ResumeResult:
    """A finished run of ``tools`` sequential tool calls, resumed (every model and tool
    call replayed, as ``resume_agent`` does): ours against loomflow's ``JournaledRuntime()``
    with its in-memory journal, on the same agent, interleaved."""
    from loomflow import Agent
    from loomflow.runtime.journaled import resuming_last_run

    from bench.agents_bench import calls, record_tool
    from loomflow_worker import NoMemory
    from loomflow_worker.testing import DeterministicModel

    ours = await PostgresRuntime.connect(dsn)
    runtimes: dict[str, JournaledRuntime] = {"ours": ours, "in-memory": JournaledRuntime()}
    prompt = calls(*(f"t{i}" for i in range(tools)))
    result = ResumeResult(tools=tools)
    try:
        agents = {
            # No memory: a resumed run then sends the model what it sent before.
            name: Agent("bench agent", model=DeterministicModel(), tools=[record_tool()],
                        runtime=rt, memory=NoMemory(), auto_extract=False)
            for name, rt in runtimes.items()
        }
        for name, agent in agents.items():
            await agent.run(prompt, session_id=f"resume-{name}", emit=_noop_emit)
        for r in range(rounds + 1):
            order = list(agents) if r % 2 == 0 else list(reversed(agents))
            for name in order:
                model = agents[name].model
                before = model.calls
                # A round's time for a side is the median of a few resumes in a row:
                # one resume lasts about 20 ms, short enough for a single hiccup of
                # the machine to decide a round.
                took: list[int] = []
                for _ in range(RESUMES_PER_ROUND):
                    gc.collect()
                    started = time.perf_counter_ns()
                    with resuming_last_run():
                        await agents[name].run(prompt, session_id=f"resume-{name}",
                                               emit=_noop_emit)
                    took.append(time.perf_counter_ns() - started)
                if model.calls != before:
                    raise AssertionError(f"{name}: the resume called the model again")
                if r > 0:  # the first round warms up
                    result.times[name].append(statistics.median(took))
    finally:
        await ours.aclose()
    return result


# ---- 3. lock handoff between processes ---------------------------------------------------------


def _recv(pipe: Connection, what: str, timeout: float = IPC_TIMEOUT_S) -> Any:
    if not pipe.poll(timeout):
        raise RuntimeError(f"no {what!r} from a handoff process within {timeout:g}s")
    msg = pipe.recv()
    if msg[0] == "error":
        raise RuntimeError(f"handoff process failed: {msg[1]}")
    if msg[0] != what:
        raise RuntimeError(f"expected {what!r} from a handoff process, got {msg!r}")
    return msg


async def _hold(rt: PostgresRuntime, sid: str, pipe: Connection) -> None:
    """Process A: hold ``sid`` until told to let go; report when the run left."""
    async with rt.session(sid):
        await rt.step("a", noop)
        pipe.send(("held",))
        await anyio.to_thread.run_sync(pipe.recv)  # "release"
        exit_begin = time.time()
    exit_end = time.time()  # the session is closed: epoch advanced, lock released
    pipe.send(("released", exit_begin, exit_end))


async def _wait(rt: PostgresRuntime, sid: str, pipe: Connection) -> None:
    """Process B: open ``sid`` (blocking on A's lock); report when the first step starts."""
    called = time.time()
    pipe.send(("waiting",))
    async with rt.session(sid):
        started = time.time()
        await rt.step("b", noop)
    pipe.send(("done", called, started))


async def _handoff_worker_main(role: str, dsn: str, pipe: Connection) -> None:
    rt = await PostgresRuntime.connect(dsn, lock_wait_timeout=LOCK_WAIT_S)
    try:
        pipe.send(("ready", os.getpid()))
        while True:
            msg = await anyio.to_thread.run_sync(pipe.recv)
            if msg[0] == "stop":
                break
            await (_hold if role == "A" else _wait)(rt, msg[1], pipe)
    finally:
        await rt.aclose()


def _handoff_worker(role: str, dsn: str, pipe: Connection) -> None:
    # Ctrl-C is the parent's to handle: it stops the workers and drops the database.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        anyio.run(_handoff_worker_main, role, dsn, pipe)
    except BaseException as exc:
        pipe.send(("error", f"{role}: {type(exc).__name__}: {exc}"))
        raise


HELD_SQL = """
SELECT count(*) FROM pg_locks
 WHERE locktype = 'advisory' AND granted AND objsubid = 1
   AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND classid::bigint = %s AND objid::bigint = %s
"""


@dataclass
class HandoffResult:
    handoff_ns: list[int] = field(default_factory=list)  # B start - A after exit
    from_exit_begin_ns: list[int] = field(default_factory=list)  # B start - A before exit
    b_waited_ns: list[int] = field(default_factory=list)  # B start - B called session()
    hold_ms: float = 0.0


def bench_handoff(dsn: str, trials: int, warmup: int, hold_ms: float) -> HandoffResult:
    ctx = multiprocessing.get_context("spawn")
    pipes: dict[str, Connection] = {}
    procs: list[multiprocessing.process.BaseProcess] = []
    result = HandoffResult(hold_ms=hold_ms)
    tag = uuid.uuid4().hex[:6]
    try:
        for role in ("A", "B"):
            here, there = ctx.Pipe()
            worker = ctx.Process(target=_handoff_worker, args=(role, dsn, there), daemon=True)
            worker.start()
            there.close()
            pipes[role] = here
            procs.append(worker)
        for role in ("A", "B"):
            _recv(pipes[role], "ready")
        a, b = pipes["A"], pipes["B"]
        with psycopg.connect(dsn, autocommit=True) as watch:
            for trial in range(warmup + trials):
                sid = f"{tag}-handoff-{trial}"
                key = scope_lock_key(sid) & 0xFFFF_FFFF_FFFF_FFFF
                a.send(("hold", sid))
                _recv(a, "held")
                b.send(("go", sid))
                # B must be waiting for the lock before A lets go: it tells when it
                # opens the session, and A (seen holding it in pg_locks) waits hold_ms.
                _recv(b, "waiting")
                time.sleep(hold_ms / 1000)
                if b.poll():
                    raise RuntimeError(f"B did not wait for the lock: {b.recv()!r}")
                row = watch.execute(HELD_SQL, (key >> 32, key & 0xFFFF_FFFF)).fetchone()
                if not row or row[0] != 1:
                    raise RuntimeError("A does not hold the scope's lock while B waits")
                a.send(("release",))
                _, a_exit_begin, a_exit_end = _recv(a, "released")
                _, b_called, b_started = _recv(b, "done")
                if b_started < a_exit_begin:
                    raise AssertionError(
                        f"trial {trial}: B started {1000 * (a_exit_begin - b_started):.1f} ms "
                        "before A left its run: the scope lock did not exclude"
                    )
                if trial >= warmup:
                    result.handoff_ns.append(round((b_started - a_exit_end) * 1e9))
                    result.from_exit_begin_ns.append(round((b_started - a_exit_begin) * 1e9))
                    result.b_waited_ns.append(round((b_started - b_called) * 1e9))
        for pipe in pipes.values():
            pipe.send(("stop",))
        for proc in procs:
            proc.join(timeout=30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
        for pipe in pipes.values():
            pipe.close()
    return result


# ---- report ------------------------------------------------------------------------------------


def report(
    args: argparse.Namespace,
    fresh: FreshResult,
    replay: ReplayResult,
    handoff: HandoffResult | None,
    resume: ResumeResult | None = None,
) -> list[str]:
    out: list[str] = []
    p = out.append
    p("")
    p(f"1. fresh step, {args.steps} steps per run, {args.rounds} rounds "
      "(per-step p50 in ms per round; ratios per round)")
    p(f"   {'round':<6}{'order':<26}{'ours':>8}{'upsert':>8}{'loomflow':>10}"
      f"{'ours/upsert':>13}{'loom/ours':>11}")
    for r, order in enumerate(fresh.orders):
        p(f"   {r + 1:<6}{','.join(order):<26}"
          f"{ms(fresh.round_p50('ours')[r]):>8.3f}{ms(fresh.round_p50('upsert')[r]):>8.3f}"
          f"{ms(fresh.round_p50('loomflow')[r]):>10.3f}"
          f"{fresh.round_ratios('ours', 'upsert')[r]:>12.2f}x"
          f"{fresh.round_ratios('loomflow', 'ours')[r]:>10.2f}x")
    p(f"   {'median':<32}{ms(fresh.p50('ours')):>8.3f}{ms(fresh.p50('upsert')):>8.3f}"
      f"{ms(fresh.p50('loomflow')):>10.3f}{fresh.ratio('ours', 'upsert'):>12.2f}x"
      f"{fresh.ratio('loomflow', 'ours'):>10.2f}x")
    p("   all samples pooled (ms):  " + "   ".join(
        f"{v} mean {ms(statistics.fmean(s)):.3f} p90 {ms(percentile(s, 0.9)):.3f} "
        f"p99 {ms(percentile(s, 0.99)):.3f}"
        for v in FRESH_VARIANTS
        for s in [[x for rnd in fresh.samples[v] for x in rnd]]
    ))
    p("")
    p(f"2. replay of a crashed {replay.steps}-step run, {len(replay.orders)} rounds, ms")
    p("   replay = reopen the session and replay every step (clock stops after the last step);")
    p("   + exit = the same plus the session's clean exit (epoch advance, unlock)")
    p(f"   {'':<24}{'---------- replay ----------':>32}{'---------- + exit ----------':>32}")
    p(f"   {'round':<6}{'order':<18}" + f"{'ours':>10}{'loomflow':>11}{'loom/ours':>11}" * 2)
    for r, order in enumerate(replay.orders):
        p(f"   {r + 1:<6}{','.join(order):<18}" + "".join(
            f"{ms(replay.times[k]['ours'][r]):>10.2f}{ms(replay.times[k]['loomflow'][r]):>11.2f}"
            f"{replay.round_ratios(k)[r]:>10.1f}x"
            for k in ("replay", "run")
        ))
    p(f"   {'median':<24}" + "".join(
        f"{ms(replay.median('ours', k)):>10.2f}{ms(replay.median('loomflow', k)):>11.2f}"
        f"{replay.ratio(k):>10.1f}x"
        for k in ("replay", "run")
    ))
    p(f"   per replayed step (replay / steps): "
      f"ours {ms(replay.median('ours')) * 1000 / replay.steps:.1f} us, "
      f"loomflow {ms(replay.median('loomflow')) * 1000 / replay.steps:.1f} us")
    if handoff is not None:
        h, e, w = handoff.handoff_ns, handoff.from_exit_begin_ns, handoff.b_waited_ns
        p("")
        p(f"3. lock handoff between two processes, {len(h)} trials "
          f"(B waiting for the lock, held by A as pg_locks shows, for {handoff.hold_ms:g} ms)")
        for label, values in (
            ("B first step - A session exited (handoff)", h),
            ("B first step - A began leaving its session", e),
            ("B first step - B called session()", w),
        ):
            p(f"   {label:<44} min {ms(min(values)):7.2f}  p50 {ms(percentile(values, 0.5)):7.2f}"
              f"  p90 {ms(percentile(values, 0.9)):7.2f}  p99 {ms(percentile(values, 0.99)):7.2f}"
              f"  max {ms(max(values)):7.2f} ms")
    ours_upsert = fresh.ratio("ours", "upsert")
    loom_ours = fresh.ratio("loomflow", "ours")
    p("")
    p("summary (medians over rounds; ratios are medians of per-round ratios)")
    p(f"fresh step: ours {ms(fresh.p50('ours')):.2f} ms, bare upsert "
      f"{ms(fresh.p50('upsert')):.2f} ms, loomflow {ms(fresh.p50('loomflow')):.2f} ms -> "
      f"ours/upsert {ours_upsert:.2f}x (target <= {TARGET_OURS_OVER_UPSERT:g}: "
      f"{verdict(ours_upsert <= TARGET_OURS_OVER_UPSERT)}), loomflow/ours {loom_ours:.1f}x "
      f"(target >= {TARGET_LOOM_OVER_OURS_FRESH:g}: "
      f"{verdict(loom_ours >= TARGET_LOOM_OVER_OURS_FRESH)})")
    for kind, label in (("replay", ""), ("run", " + session exit")):
        ratio = replay.ratio(kind)
        p(f"replay {replay.steps} steps{label}: ours {ms(replay.median('ours', kind)):.1f} ms, "
          f"loomflow {ms(replay.median('loomflow', kind)):.0f} ms -> {ratio:.1f}x "
          f"(target >= {TARGET_LOOM_OVER_OURS_REPLAY:g}: "
          f"{verdict(ratio >= TARGET_LOOM_OVER_OURS_REPLAY)})")
    if resume is not None:
        ratio = statistics.median(resume.ratios())
        p(f"resume of a finished {resume.tools}-tool run ({len(resume.times['ours'])} "
          f"rounds): ours {ms(resume.median('ours')):.1f} ms, loomflow's JournaledRuntime() "
          f"(in memory) {ms(resume.median('in-memory')):.1f} ms -> {ratio:.2f}x "
          f"(target <= {TARGET_RESUME_OVER_MEMORY:g}: "
          f"{verdict(ratio <= TARGET_RESUME_OVER_MEMORY)})")
    if handoff is not None:
        p50 = ms(percentile(handoff.handoff_ns, 0.5))
        p(f"lock handoff ({len(handoff.handoff_ns)} trials): p50 {p50:.1f} ms, p99 "
          f"{ms(percentile(handoff.handoff_ns, 0.99)):.1f} ms (target p50 < "
          f"{TARGET_HANDOFF_P50_MS:g} ms: {verdict(p50 < TARGET_HANDOFF_P50_MS)})")
    return out


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=1000,
                        help="fresh steps per run and variant in each round (default 1000)")
    parser.add_argument("--rounds", type=int, default=7,
                        help="interleaved rounds for benchmarks 1 and 2 (default 7)")
    parser.add_argument("--replay-steps", type=int, default=1000,
                        help="steps in the run that is replayed (default 1000)")
    parser.add_argument("--handoffs", type=int, default=40,
                        help="lock handoff trials, 0 to skip (default 40)")
    parser.add_argument("--hold-ms", type=float, default=50.0,
                        help="how long A keeps the lock after B starts waiting (default 50)")
    parser.add_argument("--resume-tools", type=int, default=100,
                        help="tool calls in the finished run that is resumed, 0 to skip "
                             "(default 100)")
    parser.add_argument("--quick", action="store_true",
                        help="small numbers for a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.replay_steps, args.handoffs = 100, 2, 200, 8
    for name in ("steps", "rounds", "replay_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.handoffs < 0 or args.hold_ms < 0:
        parser.error("--handoffs and --hold-ms must not be negative")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    with scratch_database() as dsn:
        server = anyio.run(setup, dsn)
        print(f"scratch database {describe(dsn)} (PostgreSQL {server}); "
              f"python {platform.python_version()}, psycopg {version('psycopg')}, "
              f"asyncpg {version('asyncpg')}, loomflow {version('loomflow')}, "
              f"{os.cpu_count()} CPUs")
        print("run context outside Agent.run: default (user_id=None); a step in "
              "rt.session(...) is journaled under the bare session id: ok")
        print(f"settings: --steps {args.steps} --rounds {args.rounds} "
              f"--replay-steps {args.replay_steps} --handoffs {args.handoffs} "
              f"--hold-ms {args.hold_ms:g}", flush=True)
        fresh, replay = anyio.run(
            bench_in_process, dsn, args.steps, args.rounds, args.replay_steps
        )
        handoff = (
            bench_handoff(dsn, args.handoffs, warmup=3, hold_ms=args.hold_ms)
            if args.handoffs
            else None
        )
        resume = (
            anyio.run(bench_resume, dsn, args.resume_tools, max(args.rounds, 5))
            if args.resume_tools
            else None
        )
        print("\n".join(report(args, fresh, replay, handoff, resume)))
    dropped = conninfo_to_dict(dsn)["dbname"]
    print(f"\n(dropped {dropped}; total {time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
