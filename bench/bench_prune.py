"""Benchmark pruning: what a large prune costs the runs journaling beside it.

On a scratch database it creates and drops, it loads 1,000,000 old journal rows
(one ``INSERT ... SELECT FROM generate_series``) and 20,000 old finished
requests, then measures the latency of fresh journal steps written by
concurrent runs (``PostgresRuntime``, each run a loop of fresh steps):

1. without a prune, for ``--baseline`` seconds;
2. while ``loomflow_worker.runtime.prune.Pruner`` deletes everything older than 30 days
   in batches at full speed, as ``loomflow-worker prune`` does;
3. (the rows loaded again) while it deletes them the way the sweeper's retention
   does: batches of 1,000 for at most 0.5 s a sweep, one sweep a second.

It prints p50/p99 of each, their ratio to the first, and how long each prune took. Run it with::

    python bench/bench_prune.py [--quick]

The admin connection string defaults to postgresql://postgres@127.0.0.1:5432/postgres
and is overridden by LOOMFLOW_WORKER_BENCH_ADMIN_DSN.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import anyio
import anyio.to_thread
import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from loomflow_worker.runtime import PostgresRuntime
from loomflow_worker.runtime.codec import CodecStats, encode
from loomflow_worker.runtime.prune import Pruner
from loomflow_worker.sweeper.retention import PRUNE_BATCH, PRUNE_BUDGET

ADMIN_DSN_ENV = "LOOMFLOW_WORKER_BENCH_ADMIN_DSN"
DEFAULT_ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
AGE = timedelta(days=40)
CUTOFF = timedelta(days=30)
STEPS_PER_RUN = 100
SWEEP_INTERVAL = 1.0


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    k = (len(ordered) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


@dataclass
class Phase:
    name: str
    latencies: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def row(self) -> str:
        lat = self.latencies
        return (f"  {self.name:<17} {len(lat):>8,} {len(lat) / self.seconds:>9,.0f}/s "
                f"{percentile(lat, 0.5) * 1e3:>8.2f} {percentile(lat, 0.99) * 1e3:>8.2f} "
                f"{max(lat) * 1e3:>8.1f}")


def load(dsn: str, rows: int, runs: int) -> float:
    """Old journal rows and finished requests; returns the seconds it took."""
    blob = encode("x" * 25, "json", CodecStats(), key="bench")
    old = time.time() - AGE.total_seconds()
    started = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO journal_steps (session_id, step_name, value, created_at)"
            " SELECT 'old-' || (i %% 2000), 'step-' || i, %s, %s + i * 0.001"
            "   FROM generate_series(1, %s) AS i",
            (blob, old, rows),
        )
        conn.execute(
            "INSERT INTO runs (request_id, scope, session_id, agent, prompt, status,"
            "                  enqueued_at, finished_at, epoch, attempts)"
            " SELECT 'old-' || i, 'old-' || (i %% 2000), 'old-' || (i %% 2000), 'default', 'p',"
            "        'succeeded', now() - %s, now() - %s, 0, 1"
            "   FROM generate_series(1, %s) AS i",
            (AGE, AGE, runs),
        )
        conn.execute(
            "INSERT INTO run_attempts (request_id, attempt, worker, pid, epoch, started_at,"
            "                          ended_at, outcome)"
            " SELECT request_id, 1, 'bench', 1, 0, enqueued_at, finished_at, 'succeeded'"
            "   FROM runs"
        )
        conn.execute("VACUUM ANALYZE journal_steps")
        conn.execute("VACUUM ANALYZE runs")
        conn.execute("VACUUM ANALYZE run_attempts")
    return time.perf_counter() - started


async def journal(rt: PostgresRuntime, phase: Phase, stop: anyio.Event, writer: int) -> None:
    """Runs of fresh steps, one after another, until ``stop``; each step timed."""

    async def noop(i: int) -> str:
        return "x" * 25

    while not stop.is_set():
        async with rt.session(f"live-{writer}-{uuid.uuid4().hex[:8]}"):
            for i in range(STEPS_PER_RUN):
                begun = time.perf_counter()
                await rt.step(f"s{i}", noop, i)
                phase.latencies.append(time.perf_counter() - begun)
                if stop.is_set():
                    break


def prune(dsn: str, batch_size: int, budget: float | None = None) -> tuple[float, dict[str, int]]:
    """The CLI's prune (all at once), or with ``budget`` the sweeper's retention: up to
    ``budget`` seconds of batches per sweep, one sweep a second."""
    pruner = Pruner(datetime.now(UTC) - CUTOFF, batch_size=batch_size)
    with psycopg.connect(dsn, autocommit=True) as conn:
        started = time.perf_counter()
        while True:
            tick = time.perf_counter()
            totals = pruner.run(conn, budget=budget)
            if pruner.done:
                return time.perf_counter() - started, totals
            time.sleep(max(0.0, SWEEP_INTERVAL - (time.perf_counter() - tick)))


async def measure(
    dsn: str, writers: int, baseline: float, batch_size: int, sweeper: bool, rows: int,
    runs: int,
) -> None:
    rt = await PostgresRuntime.connect(dsn, max_size=writers + 2, lock_connections=2)
    try:
        # One run alone first: the runtime opens its lock pool on first use, and
        # concurrent first uses trip over each other (see the report).
        async with rt.session("warm-up"):
            pass
        # Warm-up: connections open, statements prepared.
        warm = Phase("warm-up")
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            for w in range(writers):
                tg.start_soon(journal, rt, warm, stop, w)
            await anyio.sleep(1.0)
            stop.set()

        # The baseline is taken half before and half after the prunes, so a
        # machine whose load drifts meanwhile skews both sides alike.
        quiet = Phase("without prune")

        async def without(seconds: float) -> None:
            stop = anyio.Event()
            started = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for w in range(writers):
                    tg.start_soon(journal, rt, quiet, stop, w)
                await anyio.sleep(seconds)
                stop.set()
            quiet.seconds += time.perf_counter() - started

        await without(baseline / 2)

        async def during(name: str, label: str, size: int, budget: float | None) -> Phase:
            phase = Phase(name)
            stop = anyio.Event()
            started = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for w in range(writers):
                    tg.start_soon(journal, rt, phase, stop, w)
                took, totals = await anyio.to_thread.run_sync(prune, dsn, size, budget)
                stop.set()
            phase.seconds = time.perf_counter() - started
            deleted = sum(totals.values())
            print(f"{label}: deleted {totals['journal_steps']:,} journal steps and "
                  f"{totals['runs']:,} finished requests in {took:.1f}s "
                  f"({deleted / took:,.0f} rows/s)")
            return phase

        phases = [await during(
            "during prune", f"prune (batches of {batch_size:,})", batch_size, None)]
        if sweeper:
            seconds = await anyio.to_thread.run_sync(load, dsn, rows, runs)
            print(f"loaded them again in {seconds:.1f}s")
            phases.append(await during(
                "during retention",
                f"sweeper retention (batches of {PRUNE_BATCH:,}, {PRUNE_BUDGET:g}s a sweep)",
                PRUNE_BATCH, PRUNE_BUDGET,
            ))
        await without(baseline / 2)
    finally:
        await rt.aclose()

    print(f"step latency, {writers} concurrent runs writing fresh steps (ms):")
    print(f"  {'':<17} {'steps':>8} {'rate':>11} {'p50':>8} {'p99':>8} {'max':>8}")
    print(quiet.row())
    for phase in phases:
        print(phase.row())
    for phase in phases:
        p50 = statistics.median(phase.latencies) / statistics.median(quiet.latencies)
        p99 = percentile(phase.latencies, 0.99) / percentile(quiet.latencies, 0.99)
        print(f"  {phase.name} / without prune: p50 x{p50:.2f}, p99 x{p99:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="old journal rows")
    parser.add_argument("--runs", type=int, default=20_000, help="old finished requests")
    parser.add_argument("--writers", type=int, default=4, help="concurrent journaling runs")
    parser.add_argument("--baseline", type=float, default=10.0,
                        help="seconds measured without a prune")
    parser.add_argument("--batch-size", type=int, default=5000)
    parser.add_argument("--no-sweeper", dest="sweeper", action="store_false",
                        help="skip the second load pruned the way the sweeper's retention does")
    parser.add_argument("--quick", action="store_true", help="100,000 rows, a short baseline")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.runs, args.baseline = 100_000, 2_000, 3.0

    admin_dsn = os.environ.get(ADMIN_DSN_ENV, DEFAULT_ADMIN_DSN)
    name = f"lfw_bench_prune_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = make_conninfo(admin_dsn, dbname=name)
    try:
        async def migrate() -> None:
            rt = await PostgresRuntime.connect(dsn)
            try:
                await rt.init_schema()
            finally:
                await rt.aclose()

        anyio.run(migrate)
        seconds = load(dsn, args.rows, args.runs)
        print(f"loaded {args.rows:,} journal rows and {args.runs:,} finished requests "
              f"(40 days old) in {seconds:.1f}s")
        anyio.run(measure, dsn, args.writers, args.baseline, args.batch_size, args.sweeper,
                  args.rows, args.runs)
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT (SELECT count(*) FROM journal_steps WHERE session_id LIKE 'old-%%'),"
                "       (SELECT count(*) FROM runs), (SELECT count(*) FROM run_attempts)"
            ).fetchone()
        assert row == (0, 0, 0), f"rows left after the prune: {row}"
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


if __name__ == "__main__":
    main()
