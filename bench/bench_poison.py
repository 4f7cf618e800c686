"""Measure what a poison request costs its neighbours, at scale.

Two threads-pool worker processes of ours (``celery worker -P threads -c 300``) carry
``--runs`` (200) innocent runs, each in a session of its own: three tool calls of
``--tool-sleep`` (1 s) each, between four model calls of ``--latency`` (1.5 s) each, about 9 s
a run (``bench/agents_poison.py``). Once every one of them is running, one poison request is
sent: its first tool call SIGKILLs the process it runs in, on every attempt. Whenever a worker
process dies it is started again under the same name with the same environment, as an
orchestrator would, until the innocents and the poison have all ended (or ``--timeout``).
The workers run with ``MAX_CRASHES=3``, ``HANDOFF_GRACE=2`` (``--handoff-grace``),
``LEASE=5``, a heartbeat and a sweep every 0.5 s; ``REDISPATCH_AFTER`` keeps its default.

Reported per trial:

- the poison's status and crashes (it should end ``dead`` after 3 deaths of its own);
- how many innocents succeeded, how many were charged a crash, how many ended ``dead`` (0);
- the slowest innocent: the last innocent's ``finished_at`` minus the poison's ``enqueued_at``,
  and that over the control's median run time (the target: every other run within 2x a run's
  time);
- the worker restarts, the attempts by outcome (an attempt still open when its process died
  counts as ``died``), and how many innocents ran in quarantine (an attempt ``handed_back``).

First a control phase (``--no-control`` skips it): ``--runs`` innocent runs and no poison on a
fresh pair of workers, their median and max run time (``finished_at - enqueued_at``). Without
it the ratio is to a run's nominal time (4 x latency + 3 x tool sleep). The control and each
trial have a scratch database, queue and key prefix of their own (created and dropped as in
``bench_celery.py``, through ``LOOMFLOW_WORKER_BENCH_ADMIN_DSN`` and
``LOOMFLOW_WORKER_BENCH_REDIS``); a SIGKILLed worker leaves its ``.out`` as ``<name>.out.<n>``
next to the logs.

Run it with::

    python bench/bench_poison.py [--runs 200] [--trials 3] [--latency 1.5] [--tool-sleep 1.0]
                                 [--handoff-grace 2] [--timeout 300] [--no-control]
                                 [--quarantine-group N]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
import psycopg  # noqa: E402

from bench.agents_poison import LATENCY_ENV, POISON, TOOL_SLEEP_ENV, calls  # noqa: E402
from bench.bench_celery import (  # noqa: E402
    ADMIN_DSN_ENV,
    DEFAULT_ADMIN_DSN,
    DEFAULT_REDIS,
    REDIS_ENV,
    Fleet,
    _exit_on_sigterm,
    _proc_stats,
    git_state,
    ours_config,
    teardown,
)
from bench.bench_runtime import create_database, database_uri  # noqa: E402
from loomflow_worker import tasks  # noqa: E402
from loomflow_worker.runtime import PostgresRuntime  # noqa: E402

AGENTS = "bench.agents_poison"
APP = "loomflow_worker.tasks"
WORKERS = ("w1", "w2")
TERMINAL = ("succeeded", "failed", "cancelled", "dead")
POISON_ENDS = ("dead", "failed", "succeeded")
TOOLS = 3  # tool calls per run; a run makes one model call more
WAIT_S = 120.0  # for the innocents to be all running at once
POLL_S = 0.2
TARGET_RATIO = 2.0


# ---- one scratch database, queue and key prefix, with its workers -------------------------------


@dataclass
class Scratch:
    fleet: Fleet
    env: dict[str, str]
    dsn: str
    concurrency: int
    #: Process groups of workers that died: their other processes may live on.
    dead_groups: list[int] = field(default_factory=list)
    deaths: int = 0

    def start(self, names: Sequence[str]) -> None:
        for name in names:
            self.fleet.start(name, APP, self.concurrency, self.env, pool="threads")
        self.fleet.wait_ready(names)

    def restart_dead(self) -> list[str]:
        """Start again, under its name, every worker whose main process ended."""
        restarted = []
        for name in list(self.fleet.workers):
            worker = self.fleet.workers[name]
            if worker.proc.poll() is None:
                continue
            self.deaths += 1
            self.dead_groups.append(worker.proc.pid)
            out = self.fleet.logs / f"{name}.out"
            if out.exists():  # Fleet.start truncates it
                out.rename(self.fleet.logs / f"{name}.out.{self.deaths}")
            del self.fleet.workers[name]
            self.fleet.start(name, APP, self.concurrency, self.env, pool="threads")
            restarted.append(name)
        return restarted

    def leftovers(self) -> list[int]:
        """Processes still alive in the process groups of dead workers (forked from them, so
        with this scratch queue in their environment)."""
        groups = set(self.dead_groups)
        marker = f"LOOMFLOW_WORKER_QUEUE={self.env['LOOMFLOW_WORKER_QUEUE']}\0".encode()
        found = []
        for pid, pgrp, _ in _proc_stats():
            if pgrp in groups:
                with contextlib.suppress(OSError):
                    if marker in Path(f"/proc/{pid}/environ").read_bytes():
                        found.append(pid)
        return found

    def kill_leftovers(self) -> None:
        for pid in self.leftovers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def scratch(label: str, base_env: dict[str, str], worker_env: dict[str, str], admin_dsn: str,
            redis_url: str, concurrency: int) -> Iterator[Scratch]:
    tag = uuid.uuid4().hex[:8]
    dbname, prefix = f"lfw_bench_{tag}", f"lfwbench:{tag}:"
    dsn = database_uri(admin_dsn, dbname)
    env, settings = ours_config(dsn, redis_url, prefix, f"lfwp-{tag}", agents=AGENTS)
    logs = Path(tempfile.mkdtemp(prefix=f"lfw_bench_poison_{label}_{tag}_"))
    fleet = Fleet(logs, tag, base_env)
    box = Scratch(fleet, {**env, **worker_env}, dsn, concurrency)
    try:
        create_database(admin_dsn, dbname)
        anyio.run(_migrate, dsn)
        tasks.configure(settings)
        yield box
    finally:
        box.kill_leftovers()
        teardown(fleet, redis_url, prefix, admin_dsn, [dbname])


async def _migrate(dsn: str) -> None:
    rt = await PostgresRuntime.connect(dsn)
    try:
        await rt.init_schema()
    finally:
        await rt.aclose()


# ---- ledger queries ----------------------------------------------------------------------------


def _statuses(conn: psycopg.Connection[Any], ids: list[str]) -> dict[str, int]:
    rows = conn.execute("SELECT status, count(*) FROM runs WHERE request_id = ANY(%s) "
                        "GROUP BY 1", (ids,)).fetchall()
    return {str(r[0]): int(r[1]) for r in rows}


def _ended(counts: dict[str, int]) -> int:
    return sum(n for status, n in counts.items() if status in TERMINAL)


def _held(conn: psycopg.Connection[Any], ids: list[str]) -> dict[str, int]:
    """Running innocents per worker (``holder`` is ``name.tag@host:pid``)."""
    rows = conn.execute("SELECT split_part(holder, '.', 1), count(*) FROM runs "
                        "WHERE request_id = ANY(%s) AND status = 'running' GROUP BY 1 "
                        "ORDER BY 1", (ids,)).fetchall()
    return {str(r[0]): int(r[1]) for r in rows}


def _innocents_running(conn: psycopg.Connection[Any], ids: list[str]) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:
        counts = _statuses(conn, ids)
        if counts.get("running", 0) == len(ids):
            return
        if _ended(counts):
            raise RuntimeError(f"innocents ended before all {len(ids)} ran at once ({counts}): "
                               "raise --latency or --tool-sleep")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {len(ids)} innocents not all running within "
                               f"{WAIT_S:g} s: {counts}")
        time.sleep(POLL_S / 4)


# ---- control: no poison ------------------------------------------------------------------------


@dataclass
class Control:
    runs: int
    succeeded: int
    median_s: float
    max_s: float
    outcomes: dict[str, int]


def run_control(box: Scratch, runs: int, timeout: float) -> Control:
    box.start(WORKERS)
    ids = [tasks.run_agent.delay(calls(*(f"c{i}-{k}" for k in range(TOOLS))),
                                 f"control-{i}").id for i in range(runs)]
    deadline = time.monotonic() + timeout
    with psycopg.connect(box.dsn, autocommit=True) as conn:
        while _ended(counts := _statuses(conn, ids)) < runs:
            if time.monotonic() > deadline:
                raise RuntimeError(f"control runs not all ended within {timeout:g} s: {counts}")
            if any(w.proc.poll() is not None for w in box.fleet.workers.values()):
                raise RuntimeError(f"a worker died in the control phase (logs in "
                                   f"{box.fleet.logs})")
            time.sleep(POLL_S)
        times = [float(r[0]) for r in conn.execute(
            "SELECT extract(epoch FROM finished_at - enqueued_at) FROM runs "
            "WHERE request_id = ANY(%s)", (ids,)).fetchall()]
        outcomes = _outcomes(conn)
    return Control(runs, counts.get("succeeded", 0), statistics.median(times), max(times),
                   outcomes)


# ---- one trial with a poison -------------------------------------------------------------------


@dataclass
class Trial:
    index: int
    runs: int
    held: dict[str, int]  # running innocents per worker when the poison was sent
    poison_status: str
    poison_crashes: int
    poison_attempts: int
    poison_error: str | None
    poison_s: float | None  # the poison's end, after it was sent
    succeeded: int
    not_succeeded: dict[str, int]
    charged: int  # innocents with crashes > 0
    dead: int
    slowest_s: float | None  # None: some innocent had not ended
    restarts: list[tuple[float, str]]  # (s after the poison was sent, worker)
    outcomes: dict[str, int]
    quarantined: int
    leftovers: int
    timed_out: bool
    took_s: float


def _outcomes(conn: psycopg.Connection[Any]) -> dict[str, int]:
    rows = conn.execute("SELECT coalesce(outcome, 'died'), count(*) FROM run_attempts "
                        "GROUP BY 1 ORDER BY 2 DESC").fetchall()
    return {str(r[0]): int(r[1]) for r in rows}


def run_trial(box: Scratch, runs: int, timeout: float, index: int) -> Trial:
    box.start(WORKERS)
    ids = [tasks.run_agent.delay(calls(*(f"t{index}-{i}-{k}" for k in range(TOOLS))),
                                 f"innocent-{index}-{i}").id for i in range(runs)]
    with psycopg.connect(box.dsn, autocommit=True) as conn:
        _innocents_running(conn, ids)
        held = _held(conn, ids)
        poison = tasks.run_agent.delay(
            calls(f"{POISON}-{index}", *(f"after-{index}-{k}" for k in range(1, TOOLS))),
            f"poison-{index}").id
        sent = time.monotonic()
        print(f"  trial {index + 1}: {runs} innocents running ("
              + ", ".join(f"{w} {n}" for w, n in held.items()) + "); poison sent", flush=True)
        restarts: list[tuple[float, str]] = []
        deadline = sent + timeout
        timed_out = False
        while True:
            counts = _statuses(conn, ids)
            row = conn.execute("SELECT status FROM runs WHERE request_id = %s",
                               (poison,)).fetchone()
            if _ended(counts) == runs and row is not None and row[0] in POISON_ENDS:
                break
            if time.monotonic() > deadline:
                timed_out = True
                print(f"    timed out after {timeout:g} s: innocents {counts}, poison "
                      f"{row[0] if row else '?'}", flush=True)
                break
            for name in box.restart_dead():
                at = time.monotonic() - sent
                restarts.append((at, name))
                print(f"    +{at:6.2f} s: {name} died, restarted", flush=True)
            time.sleep(POLL_S)
        took = time.monotonic() - sent
        row = conn.execute(
            "SELECT status, crashes, attempts, error, "
            "extract(epoch FROM finished_at - enqueued_at), enqueued_at "
            "FROM runs WHERE request_id = %s", (poison,)).fetchone()
        assert row is not None
        p_status, p_crashes, p_attempts, p_error, p_took, p_sent = row
        inn = conn.execute(
            "SELECT count(*) FILTER (WHERE status = 'succeeded'), "
            "count(*) FILTER (WHERE crashes > 0), count(*) FILTER (WHERE status = 'dead'), "
            "count(*) FILTER (WHERE finished_at IS NULL), "
            "extract(epoch FROM max(finished_at) - %s) "
            "FROM runs WHERE request_id = ANY(%s)", (p_sent, ids)).fetchone()
        assert inn is not None
        succeeded, charged, dead, unfinished, slowest = inn
        quarantined = conn.execute(
            "SELECT count(DISTINCT request_id) FROM run_attempts "
            "WHERE outcome = 'handed_back' AND request_id = ANY(%s)", (ids,)).fetchone()
        outcomes = _outcomes(conn)
    not_succeeded = {s: n for s, n in counts.items() if s != "succeeded"}
    return Trial(
        index=index, runs=runs, held=held, poison_status=str(p_status),
        poison_crashes=int(p_crashes), poison_attempts=int(p_attempts),
        poison_error=p_error, poison_s=float(p_took) if p_took is not None else None,
        succeeded=int(succeeded), not_succeeded=not_succeeded, charged=int(charged),
        dead=int(dead), slowest_s=float(slowest) if slowest is not None and not unfinished
        else None, restarts=restarts, outcomes=outcomes,
        quarantined=int(quarantined[0]) if quarantined else 0,
        leftovers=len(box.leftovers()),
        timed_out=timed_out, took_s=took,
    )


# ---- report ------------------------------------------------------------------------------------


def _s(value: float | None, timeout: float) -> str:
    return f"{value:.2f}" if value is not None else f">{timeout:g}"


def trial_lines(t: Trial, base: float, timeout: float) -> list[str]:
    ratio = (f"= {t.slowest_s / base:.2f}x a run's time" if t.slowest_s is not None
             else "(some innocents had not ended)")
    error = f" ({t.poison_error})" if t.poison_error else ""
    others = ", ".join(f"{n} {s}" for s, n in t.not_succeeded.items()) or "none"
    return [
        f"    poison: {t.poison_status}, crashes {t.poison_crashes}, attempts "
        f"{t.poison_attempts}, ended {_s(t.poison_s, timeout)} s after it was sent{error}",
        f"    innocents: {t.succeeded}/{t.runs} succeeded (not: {others}); charged a crash "
        f"{t.charged}; dead {t.dead}; ran in quarantine {t.quarantined}",
        f"    slowest innocent {_s(t.slowest_s, timeout)} s after the poison was sent "
        f"{ratio}; {len(t.restarts)} worker restarts; attempts by outcome "
        f"{t.outcomes}",
        f"    processes left alive of dead workers: {t.leftovers}"
        + ("; TIMED OUT" if t.timed_out else ""),
    ] + ([f"    !! the poison was not contained: {t.charged} innocents charged a crash, "
          f"{t.dead} dead"] if t.charged or t.dead else [])


def report(trials: Sequence[Trial], control: Control | None, base: float, nominal: float,
           timeout: float) -> list[str]:
    out = [""]
    p = out.append
    if control is not None:
        p(f"control: {control.runs} runs, no poison: {control.succeeded} succeeded; run time "
          f"median {control.median_s:.2f} s, max {control.max_s:.2f} s (nominal "
          f"{nominal:.2f} s)")
    else:
        p(f"no control phase: ratios are to a run's nominal time, {nominal:.2f} s")
    p(f"\none poison among {trials[0].runs} innocents; 'slowest' = the last innocent's end "
      "after the poison was sent")
    p(f"{'trial':>5} {'poison':>8} {'crashes':>7} {'ok':>9} {'charged':>7} {'dead':>4} "
      f"{'quarant.':>8} {'restarts':>8} {'slowest s':>9} {'ratio':>6}")
    for t in trials:
        ratio = f"{t.slowest_s / base:.2f}" if t.slowest_s is not None else "-"
        p(f"{t.index + 1:>5} {t.poison_status:>8} {t.poison_crashes:>7} "
          f"{f'{t.succeeded}/{t.runs}':>9} {t.charged:>7} {t.dead:>4} {t.quarantined:>8} "
          f"{len(t.restarts):>8} {_s(t.slowest_s, timeout):>9} {ratio:>6}")
    ratios = [t.slowest_s / base for t in trials if t.slowest_s is not None]
    if ratios:
        p(f"\nslowest innocent / {'control median' if control else 'nominal'} run time "
          f"({base:.2f} s): min {min(ratios):.2f}, median {statistics.median(ratios):.2f}, "
          f"max {max(ratios):.2f} over {len(ratios)} trial(s) (target <= {TARGET_RATIO:g})")
    unfinished = len(trials) - len(ratios)
    if unfinished:
        p(f"{unfinished} trial(s) had innocents still unfinished after {timeout:g} s")
    return out


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=200,
                        help="innocent runs in flight when the poison comes (default 200)")
    parser.add_argument("--trials", type=int, default=3, help="trials (default 3)")
    parser.add_argument("--latency", type=float, default=1.5,
                        help="seconds each model call waits (default 1.5)")
    parser.add_argument("--tool-sleep", type=float, default=1.0,
                        help="seconds each tool call sleeps (default 1.0)")
    parser.add_argument("--handoff-grace", type=float, default=2.0,
                        help="LOOMFLOW_WORKER_HANDOFF_GRACE of the workers (default 2)")
    parser.add_argument("--quarantine-group", type=int, default=None,
                        help="LOOMFLOW_WORKER_QUARANTINE_GROUP of the workers (default: the "
                             "package's; 1 runs every suspect alone)")
    parser.add_argument("--concurrency", type=int, default=300,
                        help="-c of each worker process (default 300)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds after the poison was sent before a trial gives up "
                             "(default 300)")
    parser.add_argument("--no-control", action="store_true",
                        help="skip the control phase (ratios to the nominal run time)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.trials < 1:
        parser.error("--runs and --trials must be at least 1")
    if args.latency <= 0 or args.tool_sleep < 0 or args.handoff_grace <= 0 or args.timeout <= 0:
        parser.error("--latency, --handoff-grace and --timeout must be positive, "
                     "--tool-sleep not negative")
    if args.quarantine_group is not None and args.quarantine_group < 1:
        parser.error("--quarantine-group must be at least 1")
    if args.concurrency < args.runs:
        parser.error("--concurrency must be at least --runs (all innocents run at once)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    admin_dsn = os.environ.get(ADMIN_DSN_ENV, DEFAULT_ADMIN_DSN)
    redis_url = os.environ.get(REDIS_ENV, DEFAULT_REDIS)
    base_env = {
        **{k: v for k, v in os.environ.items()
           if not k.startswith(("LOOMFLOW_WORKER_", "BENCH_"))},
        "PYTHONPATH": str(ROOT),
    }
    worker_env = {
        LATENCY_ENV: str(args.latency),
        TOOL_SLEEP_ENV: str(args.tool_sleep),
        "LOOMFLOW_WORKER_MAX_CRASHES": "3",
        "LOOMFLOW_WORKER_HANDOFF_GRACE": str(args.handoff_grace),
        "LOOMFLOW_WORKER_LEASE": "5",
        "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "0.5",
        "LOOMFLOW_WORKER_SWEEP_INTERVAL": "0.5",
    }
    if args.quarantine_group is not None:
        worker_env["LOOMFLOW_WORKER_QUARANTINE_GROUP"] = str(args.quarantine_group)
    group = ("" if args.quarantine_group is None
             else f" --quarantine-group {args.quarantine_group}")
    nominal = (TOOLS + 1) * args.latency + TOOLS * args.tool_sleep
    started = time.perf_counter()
    print(f"python {platform.python_version()}, celery {version('celery')}, "
          f"{os.cpu_count()} CPUs; {git_state()}; load average {os.getloadavg()[0]:.2f}")
    print(f"settings: --runs {args.runs} --trials {args.trials} --latency {args.latency:g} "
          f"--tool-sleep {args.tool_sleep:g} --handoff-grace {args.handoff_grace:g} "
          f"--concurrency {args.concurrency} --timeout {args.timeout:g}{group}; 2 workers, "
          "MAX_CRASHES 3, LEASE 5 s, heartbeat and sweep 0.5 s", flush=True)
    control: Control | None = None
    if not args.no_control:
        with scratch("control", base_env, worker_env, admin_dsn, redis_url,
                     args.concurrency) as box:
            control = run_control(box, args.runs, args.timeout)
        print(f"  control: {control.succeeded}/{control.runs} succeeded, run time median "
              f"{control.median_s:.2f} s, max {control.max_s:.2f} s; attempts by outcome "
              f"{control.outcomes} (worker logs in {box.fleet.logs})", flush=True)
    base = control.median_s if control is not None else nominal
    trials: list[Trial] = []
    for index in range(args.trials):
        with scratch(f"trial{index + 1}", base_env, worker_env, admin_dsn, redis_url,
                     args.concurrency) as box:
            trial = run_trial(box, args.runs, args.timeout, index)
        trials.append(trial)
        print("\n".join(trial_lines(trial, base, args.timeout)))
        print(f"    (trial took {trial.took_s:.1f} s after the poison; worker logs in "
              f"{box.fleet.logs})", flush=True)
    print("\n".join(report(trials, control, base, nominal, args.timeout)))
    print(f"\n(total {time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
