"""Measure how fast a run interrupted by a SIGKILL starts again, ours against plain Celery.

Real ``celery worker`` processes, 2 per side (``-c 1``): ours (``loomflow_worker.tasks``,
``LOOMFLOW_WORKER_SWEEP_INTERVAL=0.5``, ``LOOMFLOW_WORKER_HEARTBEAT_INTERVAL=0.5``) and plain
Celery with its defaults (``bench/plain_recovery_app.py``: acks early, prefetch multiplier 4,
Redis visibility timeout 1 h) running the same agent on loomflow's PostgresRuntime. A trial
sends one request of ``--calls`` slow tool calls (``--tool-sleep`` s each, recorded with the
pid of the pool child that runs them), waits until the second call starts, and SIGKILLs

- ``child``: the pool child running it (``os.kill``), or
- ``worker``: the whole worker, main process and children (``os.killpg`` on its process group;
  the worker is started again once the trial is over).

Then, ours only: ``--full-runs`` (100) runs in flight on ONE threads-pool worker process,
SIGKILLed while every run is in its second tool call; the time until the last of them has
resumed in another process (p50 and max over ``--full-trials`` trials).

Recovery time = the moment that tool call starts again in another process (its ``started_at``,
Postgres' clock on this host) - the moment of the kill. A trial with no restart within
``--cap`` seconds counts as not recovered. The two sides run their trials at the same time (a
thread each), so plain's waits for a restart that never comes overlap ours' trials.

Run it with::

    python bench/bench_recovery.py [--trials N] [--cap S] [--quick]

Scratch databases, Redis key prefix and connection strings as in ``bench_celery.py``.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
import psycopg  # noqa: E402

from bench import plain_celery_app as plain  # noqa: E402
from bench.agents_bench import calls  # noqa: E402
from bench.agents_recovery import EFFECTS_DSN_ENV, TOOL_SLEEP_ENV  # noqa: E402
from bench.bench_celery import (  # noqa: E402
    ADMIN_DSN_ENV,
    DEFAULT_ADMIN_DSN,
    DEFAULT_REDIS,
    REDIS_ENV,
    Fleet,
    _exit_on_sigterm,
    git_state,
    migrate,
    ours_config,
    teardown,
)
from bench.bench_runtime import create_database, database_uri  # noqa: E402
from loomflow_worker import tasks  # noqa: E402
from loomflow_worker.testing import EffectsLog  # noqa: E402

AGENTS = "bench.agents_recovery"
PLAIN_APP = "bench.plain_recovery_app"
SIDES = ("ours", "plain")
KINDS = ("child", "worker")
KIND_LABEL = {"child": "pool child SIGKILL", "worker": "whole worker SIGKILL"}
OURS_RECOVERY_ENV = {
    "LOOMFLOW_WORKER_SWEEP_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "0.5",
}
START_TIMEOUT_S = 60.0  # for the victim tool call to start at all
FINISH_TIMEOUT_S = 60.0  # for a recovered run to finish before the next trial
POLL_S = 0.01


@dataclass
class Trial:
    kind: str
    side: str
    index: int
    recovered_s: float | None  # None: no restart within the cap
    victim_pid: int
    worker: str


@dataclass
class Side:
    """One side's workers and how to send it a request."""

    name: str
    workers: list[str]
    app: str
    env: dict[str, str]
    dsn: str
    enqueue: Callable[[str, str], Any]
    trials: list[Trial] = field(default_factory=list)
    error: BaseException | None = None


# ---- one trial ---------------------------------------------------------------------------------


def _running(conn: psycopg.Connection[Any], tag: str) -> tuple[int, float] | None:
    """(pid, started_at) of an unfinished execution of ``tag``, if there is one."""
    row = conn.execute(
        "SELECT pid, extract(epoch FROM started_at) FROM loomflow_worker_effects "
        "WHERE tag = %s AND finished_at IS NULL ORDER BY id DESC LIMIT 1",
        (tag,),
    ).fetchone()
    return (int(row[0]), float(row[1])) if row else None


def _restarted(conn: psycopg.Connection[Any], tag: str, not_pid: int) -> float | None:
    row = conn.execute(
        "SELECT extract(epoch FROM started_at) FROM loomflow_worker_effects "
        "WHERE tag = %s AND pid <> %s ORDER BY id LIMIT 1",
        (tag, not_pid),
    ).fetchone()
    return float(row[0]) if row else None


def _finished(conn: psycopg.Connection[Any], tag: str) -> bool:
    row = conn.execute(
        "SELECT 1 FROM loomflow_worker_effects WHERE tag = %s AND finished_at IS NOT NULL",
        (tag,),
    ).fetchone()
    return row is not None


def _poll(check: Callable[[], Any], timeout: float, stop: threading.Event) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop.is_set():
        found = check()
        if found:
            return found
        time.sleep(POLL_S)
    return None


def run_trial(
    side: Side, fleet: Fleet, conn: psycopg.Connection[Any], kind: str, index: int,
    n_calls: int, cap: float, tag: str, stop: threading.Event,
) -> Trial:
    tags = [f"{side.name}-{kind}-{index}-{tag}-{i}" for i in range(n_calls)]
    victim_tag = tags[1]
    side.enqueue(calls(*tags), f"rec-{side.name}-{kind}-{index}-{tag}")
    running = _poll(lambda: _running(conn, victim_tag), START_TIMEOUT_S, stop)
    if running is None:
        raise RuntimeError(f"{side.name}: {victim_tag} never started")
    pid, _ = running
    pgid = os.getpgid(pid)
    worker = next(n for n in side.workers if fleet.workers[n].proc.pid == pgid)
    killed_at = time.time()
    if kind == "child":
        os.kill(pid, signal.SIGKILL)
    else:
        os.killpg(pgid, signal.SIGKILL)
    again = _poll(lambda: _restarted(conn, victim_tag, pid), cap, stop)
    recovered = again - killed_at if again is not None and again - killed_at <= cap else None
    if kind == "worker":
        fleet.workers[worker].proc.wait(timeout=30)
        del fleet.workers[worker]
        fleet.start(worker, side.app, 1, side.env)
    # Let a recovered run finish, so the next trial finds both workers free.
    if recovered is not None and not _poll(
        lambda: _finished(conn, tags[-1]), FINISH_TIMEOUT_S, stop
    ):
        raise RuntimeError(f"{side.name}: recovered run {tags[0]}.. never finished")
    if kind == "worker":
        fleet.wait_ready([worker])
    return Trial(kind, side.name, index, recovered, pid, worker)


def run_side(side: Side, fleet: Fleet, args: argparse.Namespace, tag: str,
             stop: threading.Event) -> None:
    try:
        with psycopg.connect(side.dsn, autocommit=True) as conn:
            for kind in KINDS:
                for index in range(args.trials):
                    if stop.is_set():
                        return
                    trial = run_trial(side, fleet, conn, kind, index, args.calls, args.cap,
                                      tag, stop)
                    side.trials.append(trial)
                    shown = (f"{trial.recovered_s:.2f} s" if trial.recovered_s is not None
                             else f"not recovered (> {args.cap:g} s)")
                    print(f"   {side.name:<5} {kind:<6} #{index + 1}: killed pid "
                          f"{trial.victim_pid} ({trial.worker}) -> {shown}", flush=True)
    except BaseException as exc:
        side.error = exc
        stop.set()


# ---- a whole process with many runs in flight (ours only) ---------------------------------------


@dataclass
class FullTrial:
    runs: int
    resumed_s: list[float]  # per run: kill -> its interrupted tool call starts elsewhere

    @property
    def last_s(self) -> float:
        return max(self.resumed_s)


def _all_running(conn: psycopg.Connection[Any], tags: list[str]) -> bool:
    row = conn.execute(
        "SELECT count(DISTINCT tag) FROM loomflow_worker_effects "
        "WHERE tag = ANY(%s) AND finished_at IS NULL",
        (tags,),
    ).fetchone()
    return bool(row and row[0] == len(tags))


def _restarts(conn: psycopg.Connection[Any], tags: list[str], not_pid: int) -> dict[str, float]:
    rows = conn.execute(
        "SELECT tag, min(extract(epoch FROM started_at)) FROM loomflow_worker_effects "
        "WHERE tag = ANY(%s) AND pid <> %s GROUP BY tag",
        (tags, not_pid),
    ).fetchall()
    return {str(r[0]): float(r[1]) for r in rows}


def run_full_trial(
    fleet: Fleet, env: dict[str, str], dsn: str, runs: int, n_calls: int, cap: float,
    tag: str, index: int,
) -> FullTrial:
    """``runs`` requests in flight on ONE threads-pool process, which is SIGKILLed while
    every one of them is in its second tool call; another process resumes them."""
    victim, spare = f"full{index}a", f"full{index}b"
    fleet.start(victim, "loomflow_worker.tasks", runs, env, pool="threads")
    fleet.wait_ready([victim])
    requests = [[f"full-{index}-{tag}-{r}-{i}" for i in range(n_calls)] for r in range(runs)]
    for r, tags in enumerate(requests):
        tasks.run_agent.delay(calls(*tags), f"full-{index}-{tag}-s{r}")
    second = [tags[1] for tags in requests]
    stop = threading.Event()
    with psycopg.connect(dsn, autocommit=True) as conn:
        if not _poll(lambda: _all_running(conn, second), START_TIMEOUT_S, stop):
            raise RuntimeError(f"the {runs} runs were never all in flight at once")
        fleet.start(spare, "loomflow_worker.tasks", runs, env, pool="threads")
        fleet.wait_ready([spare])
        pid = fleet.workers[victim].proc.pid
        killed_at = time.time()
        os.killpg(pid, signal.SIGKILL)
        fleet.workers[victim].proc.wait(timeout=30)
        del fleet.workers[victim]
        restarted = _poll(
            lambda: (found if len(found := _restarts(conn, second, pid)) == runs else None),
            cap, stop,
        )
        if restarted is None:
            raise RuntimeError(f"not every run resumed within {cap:g} s")
        last = [tags[-1] for tags in requests]
        if not _poll(lambda: all(_finished(conn, t) for t in last), FINISH_TIMEOUT_S, stop):
            raise RuntimeError("the resumed runs did not all finish")
    fleet.stop([spare])
    return FullTrial(runs, [at - killed_at for at in restarted.values()])


# ---- report ------------------------------------------------------------------------------------


def _fmt(value: float | None, cap: float) -> str:
    return f"{value:.2f}" if value is not None else f">{cap:g}"


def _p50(trials: Sequence[Trial]) -> float | None:
    """Median, with unrecovered trials counted as longer than any recovered one."""
    p50 = statistics.median(
        t.recovered_s if t.recovered_s is not None else float("inf") for t in trials
    )
    return None if p50 == float("inf") else p50


def report(sides: dict[str, Side], cap: float, full: Sequence[FullTrial] = ()) -> list[str]:
    out: list[str] = []
    p = out.append
    p("")
    p(f"recovery time, s (kill -> the interrupted tool call starts again in another process; "
      f"cap {cap:g} s)")
    p(f"{'kind':<22}{'side':<7}{'trials':>7}{'recovered':>11}{'p50':>8}{'max':>8}   times")
    rows: dict[tuple[str, str], list[Trial]] = {}
    for kind in KINDS:
        for name in SIDES:
            trials = [t for t in sides[name].trials if t.kind == kind]
            rows[kind, name] = trials
            if not trials:
                continue
            recovered = [t.recovered_s for t in trials if t.recovered_s is not None]
            worst = None if len(recovered) < len(trials) else max(recovered)
            p(f"{KIND_LABEL[kind]:<22}{name:<7}{len(trials):>7}"
              f"{f'{len(recovered)}/{len(trials)}':>11}{_fmt(_p50(trials), cap):>8}"
              f"{_fmt(worst, cap):>8}   "
              + ", ".join(_fmt(t.recovered_s, cap) for t in trials))
    p("")
    p("summary")
    for kind in KINDS:
        parts = []
        for name in SIDES:
            trials = rows[kind, name]
            if not trials:
                continue
            recovered = [t.recovered_s for t in trials if t.recovered_s is not None]
            if recovered:
                worst = max(recovered) if len(recovered) == len(trials) else None
                parts.append(f"{name} recovered {len(recovered)}/{len(trials)}, p50 "
                             f"{_fmt(_p50(trials), cap)} s, max {_fmt(worst, cap)} s")
            else:
                parts.append(f"{name} recovered 0/{len(trials)} (none within {cap:g} s)")
        p(f"- {KIND_LABEL[kind]}: " + "; ".join(parts))
    p("- plain Celery's defaults ack a message when its task starts (acks_late off), so a run "
      "killed mid-tool")
    p("  is never redelivered, whatever the visibility timeout (it only covers unacked, i.e. "
      "prefetched,")
    p("  messages); ours acks late, rejects on a lost pool child, and its sweeper re-dispatches "
      "a dead")
    p("  worker's run once its heartbeat is older than 2 x heartbeat interval (here 1 s).")
    if full:
        lasts = [t.last_s for t in full]
        p(f"- one process with {full[0].runs} runs in flight SIGKILLed (ours, threads pool): "
          f"the last of the {full[0].runs} resumed after p50 {statistics.median(lasts):.2f} s, "
          f"max {max(lasts):.2f} s over {len(full)} trials ("
          + ", ".join(f"{x:.2f}" for x in lasts) + "); per run, p50 "
          f"{statistics.median([x for t in full for x in t.resumed_s]):.2f} s")
    return out


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--trials", type=int, default=5,
                        help="trials per kind of kill and side (default 5)")
    parser.add_argument("--cap", type=float, default=20.0,
                        help="seconds after which a trial counts as not recovered (default 20)")
    parser.add_argument("--calls", type=int, default=3,
                        help="slow tool calls per request, at least 2 (default 3)")
    parser.add_argument("--tool-sleep", type=float, default=0.5,
                        help="seconds each tool call sleeps (default 0.5)")
    parser.add_argument("--full-runs", type=int, default=100,
                        help="runs in flight in the one process killed whole, 0 to skip "
                             "(default 100)")
    parser.add_argument("--full-trials", type=int, default=3,
                        help="trials of the full-process kill (default 3)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 trials per kind and side, cap 8 s")
    args = parser.parse_args(argv)
    if args.quick:
        args.trials, args.cap, args.full_trials = 2, 8.0, 1
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    if args.cap <= 0:
        parser.error("--cap must be positive")
    if args.calls < 2:
        parser.error("--calls must be at least 2")
    if args.tool_sleep < 0.1:
        parser.error("--tool-sleep must be at least 0.1 (the kill must land mid-tool)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    admin_dsn = os.environ.get(ADMIN_DSN_ENV, DEFAULT_ADMIN_DSN)
    redis_url = os.environ.get(REDIS_ENV, DEFAULT_REDIS)
    tag = uuid.uuid4().hex[:8]
    dbnames = {"ours": f"lfw_bench_{tag}", "plain": f"lfw_bench_{tag}_plain"}
    dsns = {v: database_uri(admin_dsn, n) for v, n in dbnames.items()}
    prefix = f"lfwbench:{tag}:"
    queues = {"ours": f"lfwr-{tag}-ours", "plain": f"lfwr-{tag}-plain"}
    started = time.perf_counter()
    base_env = {
        **{k: v for k, v in os.environ.items()
           if not k.startswith(("LOOMFLOW_WORKER_", "BENCH_PLAIN_", "BENCH_RECOVERY_"))},
        "PYTHONPATH": str(ROOT),
        TOOL_SLEEP_ENV: str(args.tool_sleep),
    }
    ours_env, ours_settings = ours_config(
        dsns["ours"], redis_url, prefix, queues["ours"], agents=AGENTS
    )
    ours_env = {**ours_env, EFFECTS_DSN_ENV: dsns["ours"], **OURS_RECOVERY_ENV}
    plain_config = plain.PlainConfig(
        database_url=dsns["plain"], broker_url=redis_url, result_backend=redis_url,
        redis_key_prefix=prefix, queue=queues["plain"], acks_late=False,
        pool_min_size=ours_settings.pool_min_size, pool_max_size=ours_settings.pool_max_size,
    )
    logs = Path(tempfile.mkdtemp(prefix=f"lfw_bench_recovery_{tag}_"))
    fleet = Fleet(logs, tag, base_env)
    deleted = 0
    try:
        for name in dbnames.values():
            create_database(admin_dsn, name)
        server = anyio.run(migrate, dsns["ours"], dsns["plain"])
        for dsn in dsns.values():
            anyio.run(EffectsLog(dsn).setup)
        print(f"scratch databases {dbnames['ours']} (ours) and {dbnames['plain']} (plain), "
              f"PostgreSQL {server}; redis {redis_url} key prefix {prefix}")
        print(f"python {platform.python_version()}, celery {version('celery')}, "
              f"loomflow {version('loomflow')}, {os.cpu_count()} CPUs; {git_state()}; "
              f"load average {os.getloadavg()[0]:.2f}; worker logs in {logs}")
        print(f"settings: --trials {args.trials} --cap {args.cap:g} --calls {args.calls} "
              f"--tool-sleep {args.tool_sleep:g}; ours: sweep and heartbeat interval 0.5 s; "
              "plain: Celery defaults (acks early, prefetch 4, visibility timeout 1 h)",
              flush=True)
        tasks.configure(ours_settings)
        plain.configure(plain_config)
        sides = {
            "ours": Side("ours", ["ours1", "ours2"], "loomflow_worker.tasks", ours_env,
                         dsns["ours"], tasks.run_agent.delay),
            "plain": Side("plain", ["plain1", "plain2"], PLAIN_APP,
                          {**plain_config.env(), EFFECTS_DSN_ENV: dsns["plain"]},
                          dsns["plain"], plain.run_agent.delay),
        }
        for side in sides.values():
            for name in side.workers:
                fleet.start(name, side.app, 1, side.env)
        fleet.wait_ready([n for s in sides.values() for n in s.workers])
        print(f"4 workers ready after {time.perf_counter() - started:.1f} s; trials "
              "(both sides at once):", flush=True)
        stop = threading.Event()
        threads = [
            threading.Thread(target=run_side, args=(s, fleet, args, tag, stop), daemon=True,
                             name=f"bench-{s.name}")
            for s in sides.values()
        ]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():
                    t.join(timeout=0.5)
        finally:
            stop.set()
        for side in sides.values():
            if side.error is not None:
                raise RuntimeError(f"{side.name}'s trials failed") from side.error
        full: list[FullTrial] = []
        if args.full_runs:
            for name in [n for s in sides.values() for n in s.workers]:
                fleet.stop([name])
            # Every run is still in its second tool call when the process dies.
            full_env = {**ours_env, TOOL_SLEEP_ENV: str(max(args.tool_sleep, 3.0))}
            for index in range(args.full_trials):
                trial = run_full_trial(fleet, full_env, dsns["ours"], args.full_runs,
                                       args.calls, max(args.cap, 30.0), tag, index)
                print(f"   ours  full   #{index + 1}: {args.full_runs} runs, the last resumed "
                      f"{trial.last_s:.2f} s after the kill", flush=True)
                full.append(trial)
        print("\n".join(report(sides, args.cap, full)))
    finally:
        deleted = teardown(fleet, redis_url, prefix, admin_dsn, dbnames.values())
    print(f"\n(dropped {', '.join(dbnames.values())}; deleted {deleted} redis keys under "
          f"{prefix}; total {time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
