"""Benchmark loomflow_worker's Celery tasks against a plain Celery task running the same agent
on loomflow's own PostgresRuntime, on real ``celery worker`` processes.

Measures, on scratch databases it creates and drops and a Redis key prefix of its own:

1. throughput of a 3-tool agent run (DeterministicModel, a pure tool that does no I/O and
   does not sleep, three sequential tool calls), CPU-bound, with the same number of
   processes running agents on each side: a plain Celery task (``bench/plain_celery_app.py``)
   that runs the same agent on ``loomflow.runtime.PostgresRuntime`` (asyncpg) on 2 workers
   of 2 prefork children (one event loop thread, one runtime and one agent per child, made
   at ``worker_process_init``), against ours,
   ``loomflow_worker.tasks.run_agent.delay(prompt, session_id)``, as it ships: 4 worker
   processes of the threads pool (``--ours-pool threads``, ``--ours-threads`` runs each), or
   with ``--ours-pool prefork`` 2 workers of 2 prefork children like plain. Many requests
   over many sessions, as a backlog: each round is enqueued while the side's workers consume
   nothing (``cancel_consumer``), then drained (``add_consumer``); requests per second of the
   drain, interleaved rounds, and CPU time per request (enqueue included) of the workers, the
   Postgres backends, Redis and this process. ``--stream`` enqueues while the workers run
   instead, from this one thread, so the slower enqueue (ours writes a ledger row first) paces
   the round;
2. the handoff between consecutive requests of ONE session: N requests enqueued at once on
   one session, 2 workers of 1 child each; from ``run_attempts``, the next request's attempt
   ``started_at`` minus the previous request's attempt ``ended_at`` (written in the
   finishing transaction, before the unlock and the publish of the next request);
3. where ours' time goes, in this process, one request after another (no Celery): ours'
   ``execute`` (what a pool child runs) split into the agent run and the ledger and scope-lock
   work around it (and, when ours publishes live events, once more without them), against
   ``agent.run`` on loomflow's runtime, with the statements each sends.

Run it with::

    python bench/bench_celery.py [--quick]

The admin connection string defaults to postgresql://postgres@127.0.0.1:5432/postgres
(LOOMFLOW_WORKER_BENCH_ADMIN_DSN overrides it); Redis to redis://127.0.0.1:6379/0
(LOOMFLOW_WORKER_BENCH_REDIS), used as broker and result backend.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from importlib.metadata import version
from itertools import pairwise
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
import asyncpg  # noqa: E402
import psycopg  # noqa: E402
import redis  # noqa: E402
from celery.result import AsyncResult, ResultSet  # noqa: E402
from loomflow.runtime import PostgresRuntime as LoomPG  # noqa: E402

from bench import plain_celery_app as plain  # noqa: E402
from bench.agents_bench import build_agent, calls, expected_output  # noqa: E402
from bench.bench_runtime import (  # noqa: E402
    create_database,
    database_uri,
    describe,
    drop_database,
    percentile,
    verdict,
)
from loomflow_worker import tasks  # noqa: E402
from loomflow_worker.execution.registry import import_agent_modules  # noqa: E402
from loomflow_worker.runtime import PostgresRuntime  # noqa: E402
from loomflow_worker.settings import Settings  # noqa: E402

ADMIN_DSN_ENV = "LOOMFLOW_WORKER_BENCH_ADMIN_DSN"
DEFAULT_ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS_ENV = "LOOMFLOW_WORKER_BENCH_REDIS"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
AGENTS = "bench.agents_bench"

TARGET_THROUGHPUT_RATIO = 1.0
TARGET_HANDOFF_P50_MS = 50.0
# A round in which processes other than the side's own used more than this share of the CPUs
# was disturbed (by whatever else runs on the machine); reported, not dropped.
QUIET_OTHER = 0.10

RESULT_TIMEOUT_S = 300.0
READY_TIMEOUT_S = 90.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
NCPU = os.cpu_count() or 1

THREE_TOOLS = ("a", "b", "c")


# ---- worker processes -------------------------------------------------------------------------


@dataclass
class Worker:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class Fleet:
    """Real ``celery worker`` processes, each the leader of a process group of its own."""

    logs: Path
    tag: str
    env: dict[str, str]
    workers: dict[str, Worker] = field(default_factory=dict)

    def start(
        self, name: str, app: str, concurrency: int, env: dict[str, str], pool: str = "prefork",
        cwd: Path = ROOT, cpus: set[int] | None = None,
    ) -> None:
        """Start worker ``name``; on ``cpus`` only (its every process and thread), if given."""
        log = self.logs / f"{name}.log"
        out = (self.logs / f"{name}.out").open("wb")
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", app, "worker",
                 "-c", str(concurrency), "-n", f"{name}.{self.tag}@%h", "-P", pool,
                 "--without-gossip", "--without-mingle", "-l", "INFO", "-f", str(log)],
                cwd=cwd, env={**self.env, **env}, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=None if cpus is None else functools.partial(
                    os.sched_setaffinity, 0, cpus),
            )
        finally:
            out.close()
        self.workers[name] = Worker(name, proc, log)

    def wait_ready(self, names: Sequence[str]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        waiting = list(names)
        while waiting:
            for name in list(waiting):
                w = self.workers[name]
                if w.log.exists() and "ready." in w.log.read_text(errors="replace"):
                    waiting.remove(name)
                elif w.proc.poll() is not None:
                    out = (self.logs / f"{name}.out").read_text(errors="replace")
                    raise RuntimeError(f"worker {name} exited at start:\n{out[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers {waiting} not ready after {READY_TIMEOUT_S:g}s")
            time.sleep(0.1)

    def stop(self, names: Sequence[str], grace: float = 3.0) -> None:
        """SIGTERM the workers, give them ``grace`` seconds (an idle worker's pool children
        close their connections), then SIGKILL whatever is left of each process group.

        (Not the full warm or soft shutdown: the workers are idle by now, and a soft shutdown
        on idle waits out its whole timeout.)"""
        stopping = [self.workers.pop(n) for n in names if n in self.workers]
        for w in stopping:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for w in stopping:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for w in stopping:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.proc.pid, signal.SIGKILL)
        for w in stopping:
            w.proc.wait(timeout=30)

    def stop_all(self) -> None:
        try:
            self.stop(list(self.workers))
        except Exception as exc:  # the groups were signalled; say what went wrong
            print(f"stopping the workers failed: {exc}", file=sys.stderr)

    def count(self, names: Sequence[str], needle: str) -> int:
        return sum(
            self.workers[n].log.read_text(errors="replace").count(needle)
            for n in names
            if self.workers[n].log.exists()
        )

    def pgids(self, names: Sequence[str]) -> set[int]:
        return {self.workers[n].proc.pid for n in names}


# ---- CPU accounting ----------------------------------------------------------------------------


def _proc_stats() -> Iterator[tuple[int, int, int]]:
    """(pid, process group, utime + stime in ticks) of every process we can read."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        # fields[0] is field 3 (state): pgrp is field 5, utime 14, stime 15
        yield int(entry.name), int(fields[2]), int(fields[11]) + int(fields[12])


def worker_ticks(pgids: set[int]) -> dict[int, int]:
    return {pid: ticks for pid, pgrp, ticks in _proc_stats() if pgrp in pgids}


def backend_ticks(conn: psycopg.Connection[Any], dbname: str) -> dict[int, int]:
    """CPU ticks of the Postgres backends connected to ``dbname`` (same host)."""
    pids = {
        int(r[0])
        for r in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s", (dbname,)
        ).fetchall()
    }
    return {pid: ticks for pid, _, ticks in _proc_stats() if pid in pids}


def pg_background_ticks(conn: psycopg.Connection[Any], dbnames: Sequence[str]) -> dict[int, int]:
    """CPU ticks of Postgres' own processes (WAL writer, checkpointer, background writer,
    autovacuum workers of our databases): work the rounds cause but no backend pays for."""
    pids = {
        int(r[0])
        for r in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE backend_type <> 'client backend' "
            "AND (datname IS NULL OR datname = ANY(%s))",
            (list(dbnames),),
        ).fetchall()
    }
    return {pid: ticks for pid, _, ticks in _proc_stats() if pid in pids}


def machine_busy_s() -> float:
    """CPU seconds every process on the machine has used (all CPUs, /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / CLK_TCK


_settle_timeouts = [0]


def settle(max_wait: float = 2.0, window: float = 0.25, quiet: float = 0.08) -> float:
    """Wait until the machine is nearly idle (what the last round left behind, WAL writes,
    autovacuum, is done); return the seconds waited. On a machine that stays busy with other
    work, waiting helps nothing: after a wait that ran out, the next ones are short."""
    t0 = time.perf_counter()
    limit = max_wait if not _settle_timeouts[0] else min(max_wait, 0.5)
    while time.perf_counter() - t0 < limit:
        b0 = machine_busy_s()
        time.sleep(window)
        if (machine_busy_s() - b0) / (window * NCPU) < quiet:
            _settle_timeouts[0] = 0
            break
    else:
        _settle_timeouts[0] += 1
    return time.perf_counter() - t0


def redis_cpu(client: redis.Redis) -> float:
    info: dict[str, Any] = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


@dataclass
class CpuSnapshot:
    workers: dict[int, int]
    backends: dict[int, int]
    pg_background: dict[int, int]
    redis_s: float
    self_s: float
    machine_s: float


def _delta_ticks(before: dict[int, int], after: dict[int, int]) -> float:
    """Seconds of CPU: processes that appeared count in full, vanished ones not at all."""
    return sum(t - before.get(pid, 0) for pid, t in after.items()) / CLK_TCK


# ---- 1. throughput -----------------------------------------------------------------------------


VARIANTS = ("ours", "plain")


@dataclass
class Round:
    variant: str
    requests: int
    seconds: float
    enqueue_s: float
    cpu_s: dict[str, float]  # component -> seconds of CPU in the round
    # The same from the drain's start (the whole round's without --drain).
    drain_cpu_s: dict[str, float]
    enqueue_cpu_s: float = 0.0  # of the client's CPU, what the enqueue loop took
    parked: int = 0  # ours: deliveries that parked behind an older request of their session
    failed: int = 0
    overlapped: int = 0  # plain: runs that began before the previous run of their session ended
    first_error: str = ""
    settled: float = 0.0  # seconds waited before the round for the machine to go quiet

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def busy(self) -> float:
        return sum(self.drain_cpu_s.values()) / (self.seconds * NCPU)

    @property
    def other(self) -> float:
        return self.drain_cpu_s["other"] / (self.seconds * NCPU)


@dataclass
class ThroughputResult:
    requests: int
    sessions: int
    event_streams: int = 0  # ours' live-event streams in Redis (one per request), and
    event_entries: int = 0  # their entries, counted after the rounds
    orders: list[tuple[str, ...]] = field(default_factory=list)
    rounds: dict[str, list[Round]] = field(default_factory=lambda: {v: [] for v in VARIANTS})

    def rps(self, variant: str) -> list[float]:
        return [r.rps for r in self.rounds[variant]]

    def ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.rps("ours"), self.rps("plain"), strict=True)]

    def quiet_rounds(self) -> list[int]:
        """Rounds in which the rest of the machine stayed (nearly) out of the way."""
        return [
            r for r in range(len(self.orders))
            if all(self.rounds[v][r].other < QUIET_OTHER for v in VARIANTS)
        ]

    def cpu_ms_per_request(self, variant: str, component: str) -> float:
        return statistics.median(
            1000 * r.cpu_s[component] / r.requests for r in self.rounds[variant]
        )


CPU_COMPONENTS = ("main", "children", "postgres", "pg-bg", "redis", "client")


@dataclass
class Bench:
    """Everything a round needs to enqueue and account for one variant."""

    fleet: Fleet
    names: dict[str, list[str]]  # variant -> worker names
    dbnames: dict[str, str]  # variant -> database name
    watch: psycopg.Connection[Any]
    redis_client: redis.Redis
    queues: dict[str, str] = field(default_factory=dict)  # variant -> its queue
    # Whether a round is a backlog the workers drain (their consumers paused
    # while it is enqueued) rather than requests enqueued as they run.
    drain: bool = False

    def nodes(self, variant: str) -> list[str]:
        host = socket.gethostname()
        return [f"{name}.{self.fleet.tag}@{host}" for name in self.names[variant]]

    def consume(self, variant: str, on: bool) -> None:
        """Resume (or pause) the consumers of ``variant``'s workers on its queue,
        waiting for every worker to say it did."""
        app = tasks.app if variant == "ours" else plain.app
        nodes = self.nodes(variant)
        verb = app.control.add_consumer if on else app.control.cancel_consumer
        replies = verb(self.queues[variant], destination=nodes, reply=True, timeout=10)
        answered = {node for reply in replies or [] for node in reply}
        if answered != set(nodes):
            raise RuntimeError(f"{variant}: no {'add' if on else 'cancel'}_consumer reply "
                               f"from {sorted(set(nodes) - answered)}")

    def snapshot(self, variant: str) -> CpuSnapshot:
        return CpuSnapshot(
            worker_ticks(self.fleet.pgids(self.names[variant])),
            backend_ticks(self.watch, self.dbnames[variant]),
            pg_background_ticks(self.watch, list(self.dbnames.values())),
            redis_cpu(self.redis_client),
            time.process_time(),
            machine_busy_s(),
        )

    def cpu_since(self, variant: str, before: CpuSnapshot) -> dict[str, float]:
        after = self.snapshot(variant)
        leaders = self.fleet.pgids(self.names[variant])
        main_before = {p: t for p, t in before.workers.items() if p in leaders}
        main_after = {p: t for p, t in after.workers.items() if p in leaders}
        cpu = {
            "main": _delta_ticks(main_before, main_after),
            "children": _delta_ticks(before.workers, after.workers)
            - _delta_ticks(main_before, main_after),
            "postgres": _delta_ticks(before.backends, after.backends),
            "pg-bg": _delta_ticks(before.pg_background, after.pg_background),
            "redis": after.redis_s - before.redis_s,
            "client": after.self_s - before.self_s,
        }
        # Everything else the machine did meanwhile: the other side's idle workers, other
        # databases' backends, and whatever else runs on this machine.
        cpu["other"] = max(0.0, after.machine_s - before.machine_s - sum(cpu.values()))
        return cpu


def submit(variant: str) -> Callable[[str, str], AsyncResult]:
    if variant == "ours":
        return lambda prompt, sid: tasks.run_agent.delay(prompt, sid)
    return lambda prompt, sid: plain.run_agent.delay(prompt, sid)


def run_round(bench: Bench, variant: str, requests: int, sessions: int, tag: str) -> Round:
    """``requests`` runs over ``sessions`` sessions, enqueued round-robin as fast as we
    can; with ``bench.drain``, enqueued while the workers consume nothing, then drained
    (the round's time runs from the consumers' resumption; its CPU counts the enqueue)."""
    send = submit(variant)
    sids = [f"{tag}-s{k}" for k in range(sessions)]
    settled = settle()
    parked_before = bench.fleet.count(bench.names[variant], " parked")
    if bench.drain:
        bench.consume(variant, False)
    before = bench.snapshot(variant)
    t0, c0 = time.perf_counter(), time.process_time()
    sent = [send(calls(*THREE_TOOLS), sids[i % sessions]) for i in range(requests)]
    enqueued, enqueue_cpu = time.perf_counter() - t0, time.process_time() - c0
    during: CpuSnapshot | None = None
    if bench.drain:
        during = bench.snapshot(variant)
        t0 = time.perf_counter()
        bench.consume(variant, True)
    app = tasks.app if variant == "ours" else plain.app
    values = ResultSet(sent, app=app).join_native(timeout=RESULT_TIMEOUT_S, propagate=False)
    seconds = time.perf_counter() - t0
    cpu = bench.cpu_since(variant, before)
    drained = bench.cpu_since(variant, during) if during is not None else cpu
    want = expected_output(*THREE_TOOLS)
    bad = [v for v in values if not isinstance(v, dict) or v.get("output") != want]
    parked = bench.fleet.count(bench.names[variant], " parked") - parked_before
    done = Round(variant, requests, seconds, enqueued, cpu, drained, enqueue_cpu, parked,
                 failed=len(bad), first_error=repr(bad[0])[:300] if bad else "",
                 settled=settled)
    if variant == "ours" and bad:
        raise AssertionError(f"ours: {len(bad)} unexpected result(s), e.g. {bad[0]!r}")
    if variant == "plain":
        done.overlapped = overlapping_runs(
            [(sids[i % sessions], v) for i, v in enumerate(values) if isinstance(v, dict)]
        )
    return done


def overlapping_runs(runs: list[tuple[str, dict[str, Any]]]) -> int:
    """Runs that started before the run that started before them on their session ended."""
    by_session: dict[str, list[tuple[float, float]]] = {}
    for sid, v in runs:
        by_session.setdefault(sid, []).append((v["run_started"], v["run_ended"]))
    count = 0
    for spans in by_session.values():
        spans.sort()
        count += sum(1 for a, b in pairwise(spans) if b[0] < a[1])
    return count


def bench_throughput(
    bench: Bench, requests: int, sessions: int, rounds: int, tag: str
) -> ThroughputResult:
    for variant in VARIANTS:  # warm-up: every child builds its agent, fills its pools
        run_round(bench, variant, min(requests, 40), min(sessions, 40), f"{tag}-warm-{variant}")
    result = ThroughputResult(requests, sessions)
    for r in range(rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        result.orders.append(order)
        for variant in order:
            done = run_round(bench, variant, requests, sessions, f"{tag}-r{r}-{variant}")
            result.rounds[variant].append(done)
            note = ""
            if done.failed or done.overlapped:
                note = (f"; {done.overlapped} run(s) overlapped another run of their session, "
                        f"{done.failed} failed, e.g. {done.first_error}")
            print(f"   round {r + 1} {variant:<5} {done.rps:7.1f} req/s "
                  f"({done.requests} in {done.seconds:.2f} s, after {done.settled:.1f} s "
                  f"settling){note}", flush=True)
    return result


def count_event_streams(client: redis.Redis, prefix: str) -> tuple[int, int]:
    """(streams, entries) of ours' live events (``<prefix>lfw:events:<request_id>``)."""
    keys = list(client.scan_iter(match=f"{prefix}lfw:events:*", count=1000))
    if not keys:
        return 0, 0
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.xlen(key)
    return len(keys), sum(int(n) for n in pipe.execute())


def check_ledger(dsn: str, tag: str) -> tuple[int, int, int]:
    """(requests, attempts, requests not succeeded) of this run's ledger."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*), coalesce(sum(attempts), 0), "
            "count(*) FILTER (WHERE status <> 'succeeded') FROM runs "
            "WHERE starts_with(session_id, %s)",
            (tag,),
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


# ---- 2. handoff --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    seq: int
    request_id: str
    worker: str
    started_at: datetime
    ended_at: datetime | None
    dispatched_at: datetime


@dataclass
class HandoffResult:
    requests: int
    workers_seen: int
    handoff_ms: list[float] = field(default_factory=list)
    crossed: list[bool] = field(default_factory=list)
    to_dispatch_ms: list[float] = field(default_factory=list)  # prev ended -> next dispatched
    dispatch_to_start_ms: list[float] = field(default_factory=list)
    parked: int = 0
    seconds: float = 0.0

    def subset(self, crossed: bool | None) -> list[float]:
        return [
            h for h, c in zip(self.handoff_ms, self.crossed, strict=True)
            if crossed is None or c == crossed
        ]


def bench_handoff(
    fleet: Fleet, names: list[str], dsn: str, queue: str, requests: int, tag: str
) -> HandoffResult:
    def send(prompt: str, sid: str) -> AsyncResult:
        # The workers publish their handoffs to their own queue, LOOMFLOW_WORKER_QUEUE.
        return tasks.run_agent.apply_async((prompt, sid), queue=queue)

    # Warm-up: each child builds its agent and opens its connections.
    warm = [send(calls("w"), f"{tag}-warm-{k}") for k in range(4)]
    for res in warm:
        res.get(timeout=RESULT_TIMEOUT_S)
    sid = f"{tag}-one"
    parked_before = fleet.count(names, " parked")
    t0 = time.perf_counter()
    sent = [send(calls(f"h{i}"), sid) for i in range(requests)]
    for i, res in enumerate(sent):
        value = res.get(timeout=RESULT_TIMEOUT_S)
        if value["output"] != expected_output(f"h{i}"):
            raise AssertionError(f"request {i}: {value['output']!r}")
    seconds = time.perf_counter() - t0
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT r.seq, r.request_id, a.attempt, a.worker, a.started_at, a.ended_at, "
            "       r.dispatched_at "
            "  FROM runs r JOIN run_attempts a USING (request_id) "
            " WHERE r.session_id = %s ORDER BY r.seq, a.attempt",
            (sid,),
        ).fetchall()
    first: dict[int, Attempt] = {}
    last: dict[int, Attempt] = {}
    for seq, rid, _n, worker, started, ended, dispatched in rows:
        att = Attempt(seq, rid, worker, started, ended, dispatched)
        first.setdefault(seq, att)
        last[seq] = att
    seqs = sorted(first)
    if len(seqs) != requests:
        raise AssertionError(f"{len(seqs)} of {requests} requests have an attempt")
    result = HandoffResult(requests, len({a.worker for a in first.values()}), seconds=seconds)
    for a, b in pairwise(seqs):
        prev, nxt = last[a], first[b]
        assert prev.ended_at is not None
        if nxt.started_at < prev.ended_at:
            raise AssertionError(f"request {b} started before request {a} ended")
        result.handoff_ms.append((nxt.started_at - prev.ended_at).total_seconds() * 1000)
        result.crossed.append(prev.worker != nxt.worker)
        if nxt.dispatched_at > prev.ended_at:  # handed off by prev (not by the first flood)
            result.to_dispatch_ms.append(
                (nxt.dispatched_at - prev.ended_at).total_seconds() * 1000
            )
            result.dispatch_to_start_ms.append(
                (nxt.started_at - nxt.dispatched_at).total_seconds() * 1000
            )
    result.parked = fleet.count(names, " parked") - parked_before
    return result


# ---- 3. where the time goes: the run and what is around it, in this process -------------------


@dataclass
class SplitResult:
    """Per request, in this process, one request after another (no Celery, no contention):
    ours' ``execute`` (what a pool child runs) split into the agent run and the ledger and
    scope-lock work around it, against the plain task's ``agent.run`` on loomflow's runtime.
    Times in ms: (wall p50, CPU mean) per round; statements per request."""

    requests: int
    ours_total: list[tuple[float, float]] = field(default_factory=list)
    ours_run: list[tuple[float, float]] = field(default_factory=list)
    plain_run: list[tuple[float, float]] = field(default_factory=list)
    # ours' execute() again with its live-event publisher taken away (WorkerContext.events)
    ours_no_events: list[tuple[float, float]] = field(default_factory=list)
    statements: dict[str, float] = field(default_factory=dict)

    def median(self, rows: list[tuple[float, float]], k: int) -> float:
        return statistics.median(r[k] for r in rows)


@contextlib.contextmanager
def counting_statements(counts: collections.Counter[str]) -> Iterator[None]:
    """Count the statements psycopg (ours) and asyncpg (loomflow's runtime) send."""
    patched: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, label: str, per_call: int = 1) -> None:
        original = getattr(owner, name)

        if name == "transaction":  # psycopg: an async context manager factory (BEGIN, COMMIT)
            def counted_cm(self: Any, *args: Any, **kwargs: Any) -> Any:
                counts[label] += per_call
                return original(self, *args, **kwargs)

            setattr(owner, name, counted_cm)
        else:
            async def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
                counts[label] += per_call
                return await original(self, *args, **kwargs)

            setattr(owner, name, counted)
        patched.append((owner, name, original))

    wrap(psycopg.AsyncCursor, "execute", "psycopg")
    wrap(psycopg.AsyncConnection, "transaction", "psycopg", per_call=2)
    for name in ("execute", "fetch", "fetchrow", "fetchval", "executemany"):
        wrap(asyncpg.connection.Connection, name, "asyncpg")
    try:
        yield
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)


async def bench_split(
    settings: Settings, plain_dsn: str, requests: int, rounds: int, tag: str
) -> SplitResult:
    from loomflow_worker.execution import execute as ours_execute
    from loomflow_worker.worker.context import WorkerContext

    import_agent_modules(settings.agents)
    ctx = WorkerContext(settings)
    loom = await LoomPG.connect(plain_dsn, min_size=settings.pool_min_size,
                                max_size=settings.pool_max_size)
    agent = build_agent(loom)
    inner: list[tuple[float, float]] = []
    run_agent = ours_execute._call_agent

    async def timed_run_agent(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return await run_agent(*args, **kwargs)
        finally:
            inner.append((time.perf_counter() - t0, time.thread_time() - c0))

    async def ours(sid: str) -> None:
        args = {"prompt": calls(*THREE_TOOLS), "session_id": sid, "user_id": None,
                "agent": "default", "metadata": None}
        outcome = await ours_execute.execute(ctx, str(uuid.uuid4()), args, "run")
        if outcome.kind != "succeeded":
            raise AssertionError(f"ours in-process: {outcome}")

    async def plain_run(sid: str) -> None:
        result = await agent.run(calls(*THREE_TOOLS), session_id=sid,
                                 metadata={"request_id": str(uuid.uuid4())}, emit=plain._noop_emit)
        if result.output != expected_output(*THREE_TOOLS):
            raise AssertionError(f"plain in-process: {result.output!r}")

    async def measure(fn: Callable[[str], Any], prefix: str) -> list[tuple[float, float]]:
        out = []
        for i in range(requests):
            t0, c0 = time.perf_counter(), time.thread_time()
            await fn(f"{prefix}-s{i % 50}")
            out.append((time.perf_counter() - t0, time.thread_time() - c0))
        return out

    def summary(rows: list[tuple[float, float]]) -> tuple[float, float]:
        return (1000 * statistics.median(r[0] for r in rows),
                1000 * statistics.fmean(r[1] for r in rows))

    result = SplitResult(requests)
    ours_execute._call_agent = timed_run_agent
    try:
        for i in range(20):  # warm-up
            await ours(f"{tag}-split-warm-o{i}")
            await plain_run(f"{tag}-split-warm-p{i}")
        counts: collections.Counter[str] = collections.Counter()
        with counting_statements(counts):
            for i in range(10):
                await ours(f"{tag}-split-count-o{i}")
                await plain_run(f"{tag}-split-count-p{i}")
        result.statements = {k: v / 10 for k, v in counts.items()}
        events = getattr(ctx, "events", None)  # live events to Redis (newer loomflow_worker)
        variants: tuple[str, ...] = ("ours", "plain") + (("ours-no-events",) if events else ())
        for r in range(rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for variant in order:
                settle()
                if variant == "ours":
                    inner.clear()
                    result.ours_total.append(summary(await measure(ours, f"{tag}-split-{r}-o")))
                    result.ours_run.append(summary(inner))
                elif variant == "ours-no-events":
                    ctx.events = None
                    try:
                        result.ours_no_events.append(
                            summary(await measure(ours, f"{tag}-split-{r}-n"))
                        )
                    finally:
                        ctx.events = events
                else:
                    result.plain_run.append(
                        summary(await measure(plain_run, f"{tag}-split-{r}-p"))
                    )
    finally:
        ours_execute._call_agent = run_agent
        await ctx.aclose()
        await loom.aclose()
    return result


# ---- report ------------------------------------------------------------------------------------


def enqueue_cpu_ms(tp: ThroughputResult, variant: str) -> float:
    return statistics.median(1000 * r.enqueue_cpu_s / r.requests for r in tp.rounds[variant])


def stats_line(label: str, values: Sequence[float]) -> str:
    if not values:
        return f"   {label:<40} (none)"
    return (f"   {label:<40} n {len(values):3d}  min {min(values):7.2f}  "
            f"p50 {percentile(values, 0.5):7.2f}  p90 {percentile(values, 0.9):7.2f}  "
            f"p99 {percentile(values, 0.99):7.2f}  max {max(values):7.2f} ms")


def report(
    args: argparse.Namespace,
    tp: ThroughputResult,
    ho: HandoffResult | None,
    split: SplitResult | None,
) -> list[str]:
    out: list[str] = []
    p = out.append
    p("")
    p(f"1. throughput, 3-tool run, {tp.requests} requests on {tp.sessions} sessions per round, "
      f"2 workers x -c {args.concurrency} each side")
    p("   (busy = share of all CPUs in use during the round; other = of which not the side's "
      "own processes)")
    p(f"   {'round':<6}{'order':<13}{'ours req/s':>11}{'plain req/s':>12}{'ours/plain':>12}"
      f"{'busy/other ours':>17}{'plain':>11}{'ours parked':>13}{'plain overlap':>15}"
      f"{'plain failed':>14}")
    for r, order in enumerate(tp.orders):
        o, pl = tp.rounds["ours"][r], tp.rounds["plain"][r]
        p(f"   {r + 1:<6}{','.join(order):<13}{o.rps:>11.1f}{pl.rps:>12.1f}"
          f"{tp.ratios()[r]:>11.2f}x{o.busy:>10.0%}/{o.other:<6.0%}{pl.busy:>5.0%}/{pl.other:<5.0%}"
          f"{o.parked:>13d}{pl.overlapped:>15d}{pl.failed:>14d}")
    p(f"   {'median':<19}{statistics.median(tp.rps('ours')):>11.1f}"
      f"{statistics.median(tp.rps('plain')):>12.1f}{statistics.median(tp.ratios()):>11.2f}x")
    quiet = tp.quiet_rounds()
    if quiet and len(quiet) < len(tp.orders):
        p(f"   {'quiet rounds':<19}{'':>23}"
          f"{statistics.median(tp.ratios()[r] for r in quiet):>11.2f}x   "
          f"(the {len(quiet)} round(s) in which other < {QUIET_OTHER:.0%} for both sides)")
    p("   enqueue time of a round (client, s): "
      f"ours {statistics.median(r.enqueue_s for r in tp.rounds['ours']):.2f}, "
      f"plain {statistics.median(r.enqueue_s for r in tp.rounds['plain']):.2f}; "
      "its CPU per request (ms), of the client's: "
      f"ours {enqueue_cpu_ms(tp, 'ours'):.2f}, plain {enqueue_cpu_ms(tp, 'plain'):.2f}")
    p("   CPU per request, ms (median over rounds): main = the side's 2 worker main processes "
      "(consumer),")
    p("   children = their pool children (the tasks), postgres = backends connected to the side's "
      "database,")
    p("   pg-bg = Postgres' own processes (WAL writer, checkpointer, ...; shared by both sides, "
      "so only")
    p("   roughly the side's), redis = redis-server, client = this process (enqueue, results)")
    p(f"   {'':<8}" + "".join(f"{c:>10}" for c in (*CPU_COMPONENTS, "total")))
    for variant in VARIANTS:
        parts = [tp.cpu_ms_per_request(variant, c) for c in CPU_COMPONENTS]
        p(f"   {variant:<8}" + "".join(f"{x:>10.2f}" for x in (*parts, sum(parts))))
    if tp.event_streams:
        p(f"   ours published live events: {tp.event_streams} Redis streams, "
          f"{tp.event_entries / tp.event_streams:.1f} entries each (plain publishes none)")
    cpu = {v: sum(tp.cpu_ms_per_request(v, c) for c in CPU_COMPONENTS) for v in VARIANTS}
    p(f"   CPU per request plain/ours {cpu['plain'] / cpu['ours']:.2f}: the throughput ratio "
      "to expect when the CPUs are saturated")
    if ho is not None:
        p("")
        p(f"2. handoff within one session, {ho.requests} requests enqueued at once, "
          f"2 workers x -c 1 ({ho.workers_seen} pool children ran them; "
          f"{ho.parked} deliveries parked; all done in {ho.seconds:.2f} s)")
        p("   handoff = next request's attempt started_at - previous attempt's ended_at")
        p(stats_line("all pairs", ho.handoff_ms))
        p(f"   {'the first 6 pairs, in order':<40} "
          + ", ".join(f"{h:.1f}" for h in ho.handoff_ms[:6]) + " ms")
        p(stats_line("pairs that crossed workers", ho.subset(True)))
        p(stats_line("pairs on the same worker", ho.subset(False)))
        p("   split, for pairs whose next request was handed off after the previous ended:")
        p(stats_line("prev ended -> next marked dispatched", ho.to_dispatch_ms))
        p(stats_line("next marked dispatched -> next started", ho.dispatch_to_start_ms))
    if split is not None:
        sp = split
        p("")
        p(f"3. where the time goes: one request after another in this process, no Celery, "
          f"{sp.requests} requests x {len(sp.plain_run)} rounds (ms per request: wall p50, "
          "CPU mean)")
        around = [(t[0] - r[0], t[1] - r[1])
                  for t, r in zip(sp.ours_total, sp.ours_run, strict=True)]
        rows = [
            ("ours: execute() (a pool child's work)", sp.ours_total),
            ("  of which agent.run on ours' runtime", sp.ours_run),
            ("  around it: ledger, scope lock, finish", around),
            ("plain: agent.run on loomflow's runtime", sp.plain_run),
        ]
        if sp.ours_no_events:
            rows.insert(3, ("ours: execute() without live events", sp.ours_no_events))
        for label, vals in rows:
            p(f"   {label:<44} wall {sp.median(vals, 0):6.2f}   CPU {sp.median(vals, 1):6.2f}")
        p("   statements sent per request: " + ", ".join(
            f"{k} {v:.1f}" for k, v in sorted(sp.statements.items())
        ) + " (psycopg = ours, worker side; BEGIN and COMMIT counted; asyncpg = plain, "
          "including the pool's reset on every release)")
    ratio = statistics.median(tp.ratios())
    p("")
    p("summary (medians over rounds; the ratio is the median of per-round ratios)")
    p(f"throughput: ours {statistics.median(tp.rps('ours')):.1f} req/s, plain Celery + "
      f"loomflow PostgresRuntime {statistics.median(tp.rps('plain')):.1f} req/s -> "
      f"ours/plain {ratio:.2f}x (target >= {TARGET_THROUGHPUT_RATIO:g}: "
      f"{verdict(ratio >= TARGET_THROUGHPUT_RATIO)})")
    if ho is not None:
        crossed = ho.subset(True)
        p50 = percentile(ho.handoff_ms, 0.5)
        cp50 = percentile(crossed, 0.5) if crossed else float("nan")
        ok = p50 < TARGET_HANDOFF_P50_MS and (not crossed or cp50 < TARGET_HANDOFF_P50_MS)
        p(f"handoff ({len(ho.handoff_ms)} pairs, {len(crossed)} crossed workers): p50 "
          f"{p50:.1f} ms, p99 {percentile(ho.handoff_ms, 0.99):.1f} ms; crossed p50 "
          f"{cp50:.1f} ms, p99 {percentile(crossed, 0.99) if crossed else float('nan'):.1f} ms "
          f"(target p50 < {TARGET_HANDOFF_P50_MS:g} ms: "
          f"{verdict(ok)}, overall and crossed)")
    return out


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=200,
                        help="requests per round and side (default 200)")
    parser.add_argument("--sessions", type=int, default=50,
                        help="sessions the requests of a round are spread over (default 50)")
    parser.add_argument("--rounds", type=int, default=7,
                        help="interleaved throughput rounds per side (default 7)")
    parser.add_argument("--concurrency", type=int, default=2,
                        help="prefork children per throughput worker (default 2)")
    parser.add_argument("--handoffs", type=int, default=40,
                        help="requests on the one session of benchmark 2, 0 skips (default 40)")
    parser.add_argument("--split-requests", type=int, default=300,
                        help="requests per round of benchmark 3 (in-process split), 0 skips "
                             "(default 300)")
    parser.add_argument("--ours-pool", choices=["threads", "prefork"], default="threads",
                        help="ours' pool: threads (as `loomflow-worker worker` ships: as many "
                             "worker processes as plain has pool children, each carrying "
                             "--ours-threads runs) or prefork (2 workers x --concurrency "
                             "children, as plain); default threads")
    parser.add_argument("--ours-threads", type=int, default=8,
                        help="runs per ours worker process with --ours-pool threads (default 8)")
    parser.add_argument("--plain-acks-late", action="store_true",
                        help="give the plain app ours' delivery settings (acks_late, "
                             "reject_on_worker_lost, prefetch multiplier 1)")
    parser.add_argument("--stream", action="store_true",
                        help="enqueue each round while the workers run it (one client "
                        "thread, so a slower enqueue paces the round) instead of as a "
                        "backlog the workers then drain")
    parser.add_argument("--quick", action="store_true", help="small numbers for a smoke run")
    args = parser.parse_args(argv)
    args.split_rounds = 3
    if args.quick:
        args.requests, args.sessions, args.rounds, args.handoffs = 40, 20, 2, 10
        args.split_requests, args.split_rounds = 50, 1
    for name in ("requests", "sessions", "rounds", "concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.split_requests < 0:
        parser.error("--split-requests must not be negative")
    if args.handoffs == 1 or args.handoffs < 0:
        parser.error("--handoffs must be 0 or at least 2")
    return args


async def migrate(ours_dsn: str, plain_dsn: str) -> str:
    rt = await PostgresRuntime.connect(ours_dsn)
    try:
        await rt.init_schema()
    finally:
        await rt.aclose()
    loom = await LoomPG.connect(plain_dsn, min_size=1, max_size=1)
    try:
        await loom.init_schema()
    finally:
        await loom.aclose()
    async with await psycopg.AsyncConnection.connect(ours_dsn, autocommit=True) as conn:
        cur = await conn.execute("SHOW server_version")
        row = await cur.fetchone()
    return str(row[0]) if row else "?"


def clean_redis(url: str, prefix: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
        return len(keys)
    finally:
        client.close()


def git_state() -> str:
    """The commit and whether loomflow_worker/ differs from it (what was measured)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "loomflow_worker"],
                               cwd=ROOT, text=True, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "git state unknown"
    changed = len(dirty.splitlines())
    return f"commit {head}" + (f" + {changed} changed file(s) under loomflow_worker/"
                               if changed else "")


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the cleanup below, as Ctrl-C does


def ours_config(
    dsn: str, redis_url: str, prefix: str, queue: str, agents: str = AGENTS
) -> tuple[dict[str, str], Settings]:
    """Our workers' environment, and the same settings for this process."""
    env = {
        "LOOMFLOW_WORKER_DATABASE_URL": dsn,
        "LOOMFLOW_WORKER_BROKER_URL": redis_url,
        "LOOMFLOW_WORKER_RESULT_BACKEND": redis_url,
        "LOOMFLOW_WORKER_REDIS_KEY_PREFIX": prefix,
        "LOOMFLOW_WORKER_QUEUE": queue,
        "LOOMFLOW_WORKER_AGENTS": agents,
    }
    settings = Settings(
        database_url=dsn,  # type: ignore[arg-type]
        broker_url=redis_url,  # type: ignore[arg-type]
        result_backend=redis_url,  # type: ignore[arg-type]
        redis_key_prefix=prefix,
        queue=queue,
        agents=[agents],
    )
    return env, settings


def teardown(
    fleet: Fleet, redis_url: str, prefix: str, admin_dsn: str, dbnames: Iterable[str]
) -> int:
    """Stop the workers, delete the keys and drop the databases; every step is
    tried, whatever the one before it did. Returns how many keys went."""
    deleted = 0
    fleet.stop_all()
    try:
        tasks.configure(Settings())  # closes the enqueue pool on the scratch database
    except Exception as exc:
        print(f"resetting the Celery app failed: {exc}", file=sys.stderr)
    try:
        deleted = clean_redis(redis_url, prefix)
    except Exception as exc:
        print(f"deleting the redis keys under {prefix} failed: {exc}", file=sys.stderr)
    for name in dbnames:
        try:
            drop_database(admin_dsn, name)
        except Exception as exc:
            print(f"dropping {name} failed: {exc}", file=sys.stderr)
    return deleted


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    admin_dsn = os.environ.get(ADMIN_DSN_ENV, DEFAULT_ADMIN_DSN)
    redis_url = os.environ.get(REDIS_ENV, DEFAULT_REDIS)
    tag = uuid.uuid4().hex[:8]
    dbnames = {"ours": f"lfw_bench_{tag}", "plain": f"lfw_bench_{tag}_plain"}
    dsns = {v: database_uri(admin_dsn, n) for v, n in dbnames.items()}
    prefix = f"lfwbench:{tag}:"
    queues = {"ours": f"lfwb-{tag}-ours", "plain": f"lfwb-{tag}-plain",
              "handoff": f"lfwb-{tag}-handoff"}
    started = time.perf_counter()
    base_env = {
        **{k: v for k, v in os.environ.items()
           if not k.startswith(("LOOMFLOW_WORKER_", "BENCH_PLAIN_"))},
        "PYTHONPATH": str(ROOT),
    }
    ours_env, ours_settings = ours_config(dsns["ours"], redis_url, prefix, queues["ours"])
    plain_config = plain.PlainConfig(
        database_url=dsns["plain"], broker_url=redis_url, result_backend=redis_url,
        redis_key_prefix=prefix, queue=queues["plain"], acks_late=args.plain_acks_late,
        pool_min_size=ours_settings.pool_min_size, pool_max_size=ours_settings.pool_max_size,
    )
    logs = Path(tempfile.mkdtemp(prefix=f"lfw_bench_celery_{tag}_"))
    fleet = Fleet(logs, tag, base_env)
    deleted = 0
    try:
        for name in dbnames.values():
            create_database(admin_dsn, name)
        server = anyio.run(migrate, dsns["ours"], dsns["plain"])
        print(f"scratch databases {describe(dsns['ours'])} (ours) and {dbnames['plain']} "
              f"(plain), PostgreSQL {server}; redis {redis_url} key prefix {prefix}")
        print(f"python {platform.python_version()}, celery {version('celery')}, "
              f"psycopg {version('psycopg')}, asyncpg {version('asyncpg')}, "
              f"loomflow {version('loomflow')}, {os.cpu_count()} CPUs; {git_state()}; "
              f"load average {os.getloadavg()[0]:.2f}; worker logs in {logs}")
        plain_delivery = (
            "acks_late, prefetch 1 (--plain-acks-late)" if args.plain_acks_late
            else "Celery defaults: acks_late off, prefetch multiplier 4"
        )
        print(f"settings: --requests {args.requests} --sessions {args.sessions} "
              f"--rounds {args.rounds} --concurrency {args.concurrency} "
              f"--handoffs {args.handoffs} --split-requests {args.split_requests} "
              f"--ours-pool {args.ours_pool} --ours-threads {args.ours_threads}"
              f"{' --stream' if args.stream else ''}; "
              f"plain delivery: {plain_delivery}", flush=True)
        tasks.configure(ours_settings)
        plain.configure(plain_config)

        names = {"ours": ["ours1", "ours2"], "plain": ["plain1", "plain2"]}
        if args.ours_pool == "threads":
            # As many processes running agents as plain's pool children.
            names["ours"] = [f"ours{i + 1}" for i in range(2 * args.concurrency)]
            for name in names["ours"]:
                fleet.start(name, "loomflow_worker.tasks", args.ours_threads, ours_env,
                            pool="threads")
        else:
            for name in names["ours"]:
                fleet.start(name, "loomflow_worker.tasks", args.concurrency, ours_env)
        for name in names["plain"]:
            fleet.start(name, "bench.plain_celery_app", args.concurrency, plain_config.env())
        fleet.wait_ready(names["ours"] + names["plain"])
        print(f"1. {len(names['ours']) + len(names['plain'])} workers ready after "
              f"{time.perf_counter() - started:.1f} s; rounds:", flush=True)
        r = redis.Redis.from_url(redis_url)
        try:
            with psycopg.connect(admin_dsn, autocommit=True) as watch:
                bench = Bench(fleet, names, dbnames, watch, r, queues, drain=not args.stream)
                tp = bench_throughput(bench, args.requests, args.sessions, args.rounds, tag)
            tp.event_streams, tp.event_entries = count_event_streams(r, prefix)
        finally:
            r.close()
        n, attempts, unfinished = check_ledger(dsns["ours"], tag)
        if unfinished or attempts != n:
            raise AssertionError(
                f"ours' ledger: {n} requests, {attempts} attempts, {unfinished} not succeeded"
            )
        fleet.stop(names["ours"] + names["plain"])

        ho: HandoffResult | None = None
        if args.handoffs:
            # Not tasks.configure(...) with the new queue: a second configure() with the same
            # broker URL and key prefix leaves the app publishing through a closed pool.
            handoff_names = ["handoff1", "handoff2"]
            for name in handoff_names:
                fleet.start(name, "loomflow_worker.tasks", 1,
                            {**ours_env, "LOOMFLOW_WORKER_QUEUE": queues["handoff"]})
            fleet.wait_ready(handoff_names)
            print("2. handoff workers ready", flush=True)
            ho = bench_handoff(
                fleet, handoff_names, dsns["ours"], queues["handoff"], args.handoffs, tag
            )
            fleet.stop(handoff_names)  # benchmark 3 runs with no worker (or sweeper) about
        split: SplitResult | None = None
        if args.split_requests:
            print("3. in-process split", flush=True)
            split = anyio.run(bench_split, ours_settings, dsns["plain"], args.split_requests,
                              args.split_rounds, tag)
        print("\n".join(report(args, tp, ho, split)))
    finally:
        deleted = teardown(fleet, redis_url, prefix, admin_dsn, dbnames.values())
    print(f"\n(dropped {', '.join(dbnames.values())}; deleted {deleted} redis keys under "
          f"{prefix}; total {time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
