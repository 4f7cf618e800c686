"""Measure how soon the runs of a SIGKILLed worker process resume in another one.

One threads-pool worker process (``celery worker -P threads -c RUNS``) carries ``--runs``
(300) runs that wait on their model (``BENCH_MODEL_LATENCY``, ``--latency`` s, no tool call);
a second worker of the same kind is started and ready; the first is SIGKILLed (its whole
process group). A run whose lock is free is taken for dead once its heartbeat is older than two
heartbeat intervals: that moment, the runs' last heartbeat plus two intervals, is when their
lease ran out. Reported per trial, after the lease ran out (and after the kill):

- when the sweeper dispatched the first and the last of them (``runs.swept_at``), and
- when the first, the median and the last resumed (the start of their next attempt).

The workers run with the package's defaults (heartbeat every 2 s, a sweep every second) unless
``--fast`` (0.5 s each). Each trial has a scratch database, queue and key prefix of its own
(created and dropped as in ``bench_celery.py``, through ``LOOMFLOW_WORKER_BENCH_ADMIN_DSN``
and ``LOOMFLOW_WORKER_BENCH_REDIS``).

Run it with::

    python bench/bench_orphans.py [--runs 300] [--trials 3] [--latency 30] [--fast]
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
import psycopg  # noqa: E402

from bench.bench_celery import (  # noqa: E402
    ADMIN_DSN_ENV,
    DEFAULT_ADMIN_DSN,
    DEFAULT_REDIS,
    REDIS_ENV,
    Fleet,
    _exit_on_sigterm,
    git_state,
    ours_config,
    teardown,
)
from bench.bench_runtime import create_database, database_uri  # noqa: E402
from loomflow_worker import tasks  # noqa: E402
from loomflow_worker.runtime import PostgresRuntime  # noqa: E402
from loomflow_worker.settings import Settings  # noqa: E402

WAIT_S = 120.0
POLL_S = 0.05


@dataclass
class Trial:
    """Seconds after the lease ran out (and the lease, after the kill)."""

    lease_after_kill: float
    swept_first: float
    swept_last: float
    resumed: list[float]


def _count_running(conn: psycopg.Connection[Any], ids: list[str]) -> int:
    row = conn.execute("SELECT count(*) FROM runs WHERE request_id = ANY(%s) "
                       "AND status = 'running'", (ids,)).fetchone()
    return int(row[0]) if row else 0


def _all_resumed(conn: psycopg.Connection[Any], ids: list[str],
                 since: datetime) -> list[datetime] | None:
    """When each of ``ids`` started an attempt after ``since``, once all did."""
    rows = conn.execute("SELECT min(started_at) FROM run_attempts WHERE request_id = ANY(%s) "
                        "AND started_at > %s GROUP BY request_id", (ids, since)).fetchall()
    return [row[0] for row in rows] if len(rows) == len(ids) else None


def _wait(what: str, check: Any) -> Any:
    deadline = time.monotonic() + WAIT_S
    while not (found := check()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not within {WAIT_S:g}s")
        time.sleep(POLL_S)
    return found


def _seconds(at: datetime, since: datetime) -> float:
    return (at - since).total_seconds()


def run_trial(fleet: Fleet, env: dict[str, str], dsn: str, runs: int, heartbeat: float,
              index: int) -> Trial:
    victim, spare = f"victim{index}", f"spare{index}"
    fleet.start(victim, "loomflow_worker.tasks", runs, env, pool="threads")
    fleet.wait_ready([victim])
    ids = [tasks.run_agent.delay(f"hello {i}", f"orphan-{index}-{i}").id for i in range(runs)]
    with psycopg.connect(dsn, autocommit=True) as conn:
        _wait(f"{runs} runs in flight", lambda: _count_running(conn, ids) == runs)
        fleet.start(spare, "loomflow_worker.tasks", runs, env, pool="threads")
        fleet.wait_ready([spare])
        if _count_running(conn, ids) != runs:
            raise RuntimeError("some runs ended before the kill: raise --latency")
        os.killpg(fleet.workers[victim].proc.pid, signal.SIGKILL)
        row = conn.execute("SELECT clock_timestamp(), max(heartbeat_at) FROM runs "
                           "WHERE request_id = ANY(%s)", (ids,)).fetchone()
        assert row is not None
        killed, last_beat = row
        fleet.workers.pop(victim).proc.wait(timeout=30)
        lease_out = last_beat + timedelta(seconds=2 * heartbeat)
        resumed = _wait(f"{runs} runs resumed", lambda: _all_resumed(conn, ids, killed))
        swept = conn.execute("SELECT min(swept_at), max(swept_at) FROM runs "
                             "WHERE request_id = ANY(%s)", (ids,)).fetchone()
    assert swept is not None
    fleet.stop([spare])
    return Trial(_seconds(lease_out, killed), _seconds(swept[0], lease_out),
                 _seconds(swept[1], lease_out), sorted(_seconds(at, lease_out)
                                                       for at in resumed))


def report(trials: Sequence[Trial], runs: int) -> list[str]:
    out = [f"\n{runs} runs of one SIGKILLed process, s after their lease ran out "
           "(p50 over trials; max in brackets)"]

    def line(label: str, values: list[float]) -> None:
        out.append(f"  {label:<34}{statistics.median(values):>7.2f}  [{max(values):.2f}]")

    line("lease ran out, after the kill", [t.lease_after_kill for t in trials])
    line("sweeper dispatched the first", [t.swept_first for t in trials])
    line("sweeper dispatched the last", [t.swept_last for t in trials])
    line("first resumed", [t.resumed[0] for t in trials])
    line("median resumed", [statistics.median(t.resumed) for t in trials])
    line("last resumed", [t.resumed[-1] for t in trials])
    line("last resumed, after the kill", [t.resumed[-1] + t.lease_after_kill for t in trials])
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=300,
                        help="runs in flight in the process killed (default 300)")
    parser.add_argument("--trials", type=int, default=3, help="trials (default 3)")
    parser.add_argument("--latency", type=float, default=30.0,
                        help="seconds each model call waits (default 30)")
    parser.add_argument("--fast", action="store_true",
                        help="heartbeat and sweep every 0.5 s (default: the package's 2 s, 1 s)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.trials < 1:
        parser.error("--runs and --trials must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    admin_dsn = os.environ.get(ADMIN_DSN_ENV, DEFAULT_ADMIN_DSN)
    redis_url = os.environ.get(REDIS_ENV, DEFAULT_REDIS)
    defaults = Settings.model_fields
    heartbeat = 0.5 if args.fast else float(defaults["heartbeat_interval"].default)
    sweep = 0.5 if args.fast else float(defaults["sweep_interval"].default)
    base_env = {
        **{k: v for k, v in os.environ.items()
           if not k.startswith(("LOOMFLOW_WORKER_", "BENCH_"))},
        "PYTHONPATH": str(ROOT),
        "BENCH_MODEL_LATENCY": str(args.latency),
        "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": str(heartbeat),
        "LOOMFLOW_WORKER_SWEEP_INTERVAL": str(sweep),
    }
    print(f"python {platform.python_version()}, celery {version('celery')}, "
          f"{os.cpu_count()} CPUs; {git_state()}; load average {os.getloadavg()[0]:.2f}")
    print(f"settings: --runs {args.runs} --trials {args.trials} --latency {args.latency:g}; "
          f"heartbeat {heartbeat:g} s, sweep {sweep:g} s", flush=True)
    trials: list[Trial] = []
    for index in range(args.trials):
        tag = uuid.uuid4().hex[:8]
        dbname, prefix = f"lfw_bench_{tag}", f"lfwbench:{tag}:"
        dsn = database_uri(admin_dsn, dbname)
        env, settings = ours_config(dsn, redis_url, prefix, f"lfwo-{tag}")
        logs = Path(tempfile.mkdtemp(prefix=f"lfw_bench_orphans_{tag}_"))
        fleet = Fleet(logs, tag, base_env)
        try:
            create_database(admin_dsn, dbname)
            anyio.run(_migrate, dsn)
            tasks.configure(settings)
            trial = run_trial(fleet, env, dsn, args.runs, heartbeat, index)
        finally:
            teardown(fleet, redis_url, prefix, admin_dsn, [dbname])
        trials.append(trial)
        print(f"  trial {index + 1}: lease ran out {trial.lease_after_kill:.2f} s after the "
              f"kill; dispatched {trial.swept_first:.2f}..{trial.swept_last:.2f} s and "
              f"resumed {trial.resumed[0]:.2f}..{trial.resumed[-1]:.2f} s after it "
              f"(worker logs in {logs})", flush=True)
    print("\n".join(report(trials, args.runs)))
    return 0


async def _migrate(dsn: str) -> None:
    rt = await PostgresRuntime.connect(dsn)
    try:
        await rt.init_schema()
    finally:
        await rt.aclose()


if __name__ == "__main__":
    raise SystemExit(main())
