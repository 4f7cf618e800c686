"""Measure one short request's latency on an idle worker, against a plain Celery task.

Two threads-pool workers on the same Redis (broker and result backend), started side by
side and left idle: ours, running the bench agent (``bench/agents_bench.py``: a run of 2
model calls and 1 tool call, no model latency), and plain Celery's no-op task with a result
(``noop`` in ``bench/plain_celery_app.py``). One request at a time, interleaved (ours, then
plain, ``--requests`` times), each timed from ``.delay()`` to ``.get()`` returning.

Where ours' time goes, from the ledger's and the journal's timestamps and this process's (one
machine's clock): the checks of ``.delay()`` before the ledger insert; the insert, its commit
and the publish (until ``.delay()`` returns); the dispatch and start (the message through
Redis, the worker taking it, the session's lock and the ledger's start); each step, to its
journal row (each committed before the next starts: 2 model calls, the tool call, and
loomflow's ``persist_episode``, whose row goes with the run's finish); and from the finish to
``.get()`` returning (the unlock, the live events sent, the result stored and read back
through Redis).

The CPU each side's worker process used over the measured requests, and the Postgres
backends of ours' database (this process's enqueue connection among them), a request on
average (``/proc``; their idle work is in it: a few milliseconds a second).

For each of ours, a follower (``iter_events``, in a thread, attached before the enqueue)
notes when each live event reached it: reported are the time from the enqueue to the first
event and, for every event, how long after the worker stamped it the follower had it (the
event's delay; the two clocks are one machine's).

Run it with::

    python bench/bench_latency.py [--requests 200]
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
import psycopg  # noqa: E402

from bench import plain_celery_app as plain  # noqa: E402
from bench.agents_bench import calls, expected_output  # noqa: E402
from bench.bench_celery import (  # noqa: E402
    ADMIN_DSN_ENV,
    CLK_TCK,
    DEFAULT_ADMIN_DSN,
    DEFAULT_REDIS,
    REDIS_ENV,
    Fleet,
    _exit_on_sigterm,
    backend_ticks,
    git_state,
    migrate,
    ours_config,
    teardown,
    worker_ticks,
)
from bench.bench_runtime import create_database, database_uri  # noqa: E402
from loomflow_worker import tasks  # noqa: E402
from loomflow_worker.events import iter_events  # noqa: E402

#: Requests of each side sent before measuring (connections, caches, the first build).
WARMUP = 10


def quantiles(values: Sequence[float]) -> tuple[float, float, float]:
    """p50, p90 and p99 of ``values`` (seconds)."""
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(len(ordered) * q))]

    return statistics.median(ordered), at(0.9), at(0.99)


class Follower:
    """Reads one request's live events in a thread; when each arrived."""

    def __init__(self, request_id: str, settings: object) -> None:
        self.arrivals: list[tuple[float, float]] = []  # (arrived, stamped), epoch seconds
        self._thread = threading.Thread(target=self._read, args=(request_id, settings),
                                        daemon=True)
        self._thread.start()

    def _read(self, request_id: str, settings: object) -> None:
        for event in iter_events(request_id, settings=settings,  # type: ignore[arg-type]
                                 follow=True, idle_timeout=10):
            self.arrivals.append((time.time(), event.at))

    def join(self) -> None:
        self._thread.join(timeout=15)


#: The steps a run journals: 2 model calls, 1 tool call, and loomflow's
#: ``persist_episode`` at the run's end (its row written with the finish).
STEPS = 4
#: The parts of a request's time, in order (see :func:`_phases`).
PARTS = (
    "enqueue: before the ledger insert",
    "enqueue: insert, commit, publish",
    "dispatch and start",
    "step 1 (model call)",
    "step 2 (tool)",
    "step 3 (model call)",
    "step 4 and the finish",
    "result (finish to .get())",
)


def _phases(dsn: str, ends: dict[str, tuple[float, float, float]]) -> list[list[float]]:
    """Each of ``ends``' requests' parts (:data:`PARTS`), from the ledger's and
    the journal's timestamps (one machine's clock) and this process's: sent
    to inserted (``.delay()``'s checks), inserted to ``.delay()`` returning
    (the insert's commit and the publish), to the attempt's start (the
    broker, the worker taking the message, the session's lock and the
    ledger's start), to each step's journal row (each committed before the
    next starts), to the run's finish in the ledger, to ``.get()`` returning
    (the result stored and read back through Redis)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT r.request_id, extract(epoch FROM r.enqueued_at)::float8,"
            " extract(epoch FROM a.started_at)::float8, extract(epoch FROM r.finished_at)::float8,"
            " ARRAY(SELECT s.created_at FROM (SELECT step_name, created_at FROM journal_steps"
            "        WHERE session_id = r.scope UNION ALL SELECT step_name, created_at"
            "        FROM journal_streams WHERE session_id = r.scope) s"
            "  WHERE s.step_name NOT LIKE '\\_\\_%%'"
            "    AND s.created_at >= extract(epoch FROM a.started_at)"
            "  ORDER BY s.created_at)"
            " FROM runs r JOIN run_attempts a ON a.request_id = r.request_id AND a.attempt = 1"
            " WHERE r.request_id = ANY(%s)", (list(ends),)).fetchall()
    found = []
    for _, inserted, started, finished, steps in rows:
        sent, delayed, returned = ends[_]
        if len(steps) != STEPS:
            raise AssertionError(f"request {_}: {len(steps)} journaled steps, not {STEPS}")
        # The last step's row goes in the statement that finishes the run, whose
        # finished_at is that statement's start: one part.
        marks = [sent, inserted, delayed, started, *steps[:-1], max(steps[-1], finished),
                 returned]
        found.append([b - a for a, b in itertools.pairwise(marks)])
    return found


def _ticks(fleet: Fleet, dsn: str, dbname: str) -> dict[str, int]:
    """CPU ticks used so far by ours' worker, plain's, and the Postgres backends
    of ours' database (both workers' pools are threads: one process each)."""
    used = {side: sum(worker_ticks({fleet.workers[side].proc.pid}).values())
            for side in ("ours", "plain")}
    with psycopg.connect(dsn, autocommit=True) as conn:
        used["postgres"] = sum(backend_ticks(conn, dbname).values())
    return used


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=200, help="requests a side (200)")
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    admin_dsn = os.environ.get(ADMIN_DSN_ENV, DEFAULT_ADMIN_DSN)
    redis_url = os.environ.get(REDIS_ENV, DEFAULT_REDIS)
    tag = uuid.uuid4().hex[:8]
    dbnames = [f"lfw_bench_{tag}_ours", f"lfw_bench_{tag}_plain"]
    dsns = [database_uri(admin_dsn, n) for n in dbnames]
    prefix = f"lfwbench:{tag}:"
    base_env = {
        **{k: v for k, v in os.environ.items()
           if not k.startswith(("LOOMFLOW_WORKER_", "BENCH_PLAIN_", "BENCH_MODEL_"))},
        "PYTHONPATH": str(ROOT),
    }
    ours_env, ours_settings = ours_config(dsns[0], redis_url, prefix, f"lfwl-{tag}-ours")
    plain_config = plain.PlainConfig(
        database_url=dsns[1], broker_url=redis_url, result_backend=redis_url,
        redis_key_prefix=prefix, queue=f"lfwl-{tag}-plain")
    fleet = Fleet(Path(tempfile.mkdtemp(prefix=f"lfw_bench_latency_{tag}_")), tag, base_env)
    print(f"python {platform.python_version()}, celery {version('celery')}, "
          f"{os.cpu_count()} CPUs; {git_state()}; load average {os.getloadavg()[0]:.2f}; "
          f"{args.requests} requests a side, one at a time, interleaved", flush=True)
    ours: list[float] = []
    plains: list[float] = []
    first_event: list[float] = []
    delays: list[float] = []
    # Ours: when each request was sent, when .delay() returned and when .get()
    # returned (epoch seconds).
    ends: dict[str, tuple[float, float, float]] = {}
    phases: list[list[float]] = []
    ticks: dict[str, int] = {}
    spent: dict[str, float] = {}
    try:
        for name in dbnames:
            create_database(admin_dsn, name)
        anyio.run(migrate, dsns[0], dsns[1])
        tasks.configure(ours_settings)
        plain.configure(plain_config)
        fleet.start("ours", "loomflow_worker.tasks", 100, ours_env, pool="threads")
        fleet.start("plain", "bench.plain_celery_app", 100, plain_config.env(), pool="threads")
        fleet.wait_ready(["ours", "plain"])
        prompt = calls("a")
        for i in range(WARMUP + args.requests):
            request_id = str(uuid.uuid4())
            follower = Follower(request_id, ours_settings)
            time.sleep(0.005)  # the follower's first read is on its way
            sent_at, started = time.time(), time.perf_counter()
            result = tasks.run_agent.apply_async((prompt, f"s{i}"), task_id=request_id)
            delayed = time.perf_counter() - started
            value = result.get(timeout=60)
            took = time.perf_counter() - started
            assert value["output"] == expected_output("a"), value
            follower.join()
            started = time.perf_counter()
            assert plain.noop.delay(prompt, f"s{i}").get(timeout=60)["output"] == \
                expected_output("a")
            plain_took = time.perf_counter() - started
            if i < WARMUP:
                if i == WARMUP - 1:
                    ticks = _ticks(fleet, dsns[0], dbnames[0])
                continue
            ours.append(took)
            plains.append(plain_took)
            ends[request_id] = (sent_at, sent_at + delayed, sent_at + took)
            if follower.arrivals:
                first_event.append(follower.arrivals[0][0] - sent_at)
            delays += [arrived - stamped for arrived, stamped in follower.arrivals]
        spent = {side: (_ticks(fleet, dsns[0], dbnames[0])[side] - ticks[side]) / CLK_TCK
                 for side in ticks}
        phases = _phases(dsns[0], ends)
    finally:
        teardown(fleet, redis_url, prefix, admin_dsn, dbnames)
    ms = 1000.0
    o50, o90, o99 = quantiles(ours)
    p50, p90, p99 = quantiles(plains)
    print(f"\n{'':<30}{'p50':>9}{'p90':>9}{'p99':>9}")
    print(f"{'plain Celery no-op, .delay→.get':<30}{p50 * ms:>7.1f}ms{p90 * ms:>7.1f}ms"
          f"{p99 * ms:>7.1f}ms")
    print(f"{'ours, 2 model calls + 1 tool':<30}{o50 * ms:>7.1f}ms{o90 * ms:>7.1f}ms"
          f"{o99 * ms:>7.1f}ms")
    print(f"{'ratio ours / plain':<30}{o50 / p50:>8.2f}x{o90 / p90:>8.2f}x{o99 / p99:>8.2f}x")
    if spent:
        print(f"CPU a request (the measured ones, idle work included): ours' worker "
              f"{spent['ours'] / args.requests * ms:.2f} ms and its Postgres backends "
              f"{spent['postgres'] / args.requests * ms:.2f} ms; plain's worker "
              f"{spent['plain'] / args.requests * ms:.2f} ms")
    if phases:
        print("where ours' time goes (p50 of each part):")
        for i, part in enumerate(PARTS):
            print(f"  {part:<34}{statistics.median(p[i] for p in phases) * ms:>7.1f}ms")
    if first_event:
        f50, f90, f99 = quantiles(first_event)
        print(f"{'first event after .delay()':<30}{f50 * ms:>7.1f}ms{f90 * ms:>7.1f}ms"
              f"{f99 * ms:>7.1f}ms")
    if delays:
        d50, d90, d99 = quantiles(delays)
        print(f"{'an event after its stamp':<30}{d50 * ms:>7.1f}ms{d90 * ms:>7.1f}ms"
              f"{d99 * ms:>7.1f}ms  ({len(delays)} events)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
