"""Measure how soon a second tenant's requests start while another tenant's backlog drains.

One threads-pool worker process (``-c --concurrency``) and a bench agent whose model waits
``--latency`` s a call (two calls a run). Tenant ``alice`` (her user id is her fairness key)
sends ``--backlog`` requests at once; then ``bob`` sends ``--second`` requests. Run four
times, side by side:

- ``defaults``: no setting at all: fair shares are on by default, and what waits in the
  broker follows the fleet's free slots;
- ``off``: ``LOOMFLOW_WORKER_LIMITS={"fair_queue": 0}``: the broker's FIFO order: bob's
  requests wait behind all of alice's;
- ``per_key N``: ``LOOMFLOW_WORKER_LIMITS={"per_key": N}`` (``--per-key``, default half the
  concurrency): alice's backlog beyond N waits in the ledger, not the broker;
- ``fair_queue N``: ``LOOMFLOW_WORKER_LIMITS={"fair_queue": N}`` (``--fair-queue``, default
  a fifth of the concurrency) and bob's weight ``--bob-weight`` (1): requests beyond N wait in the
  ledger and start in proportion to their keys' weights, with no cap on either tenant.

Reported for each: bob's start latency (from his enqueue to his attempt's start; median and
max), when the last of alice's ended, and each tenant's share of the runs started while
both had requests waiting. Each side has a scratch database, queue and key prefix of its
own, as in ``bench_celery.py``.

Run it with::

    python bench/bench_fairness.py [--backlog 2000] [--second 10] [--concurrency 50]
"""

from __future__ import annotations

import argparse
import json
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
from importlib.metadata import version
from pathlib import Path

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
from bench.bench_orphans import _migrate  # noqa: E402
from bench.bench_runtime import create_database, database_uri  # noqa: E402
from loomflow_worker import tasks  # noqa: E402
from loomflow_worker.execution import ledger  # noqa: E402
from loomflow_worker.execution import limits as concurrency_limits  # noqa: E402

WAIT_S = 3600.0


@dataclass
class Side:
    label: str
    bob_start: list[float]
    alice_done: float
    bob_share: float
    seconds: float


def run_side(label: str, args: argparse.Namespace, base_env: dict[str, str], admin_dsn: str,
             redis_url: str, limits: dict[str, int] | None = None,
             weights: dict[str, float] | None = None) -> Side:
    tag = uuid.uuid4().hex[:8]
    dbname, prefix = f"lfw_bench_{tag}", f"lfwbench:{tag}:"
    dsn = database_uri(admin_dsn, dbname)
    env, settings = ours_config(dsn, redis_url, prefix, f"lfwf-{tag}")
    if limits:
        env["LOOMFLOW_WORKER_LIMITS"] = json.dumps(limits)
    if weights:
        env["LOOMFLOW_WORKER_FAIRNESS_WEIGHTS"] = json.dumps(weights)
    fleet = Fleet(Path(tempfile.mkdtemp(prefix=f"lfw_bench_fairness_{tag}_")), tag, base_env)
    try:
        create_database(admin_dsn, dbname)
        anyio.run(_migrate, dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            # Written before the first enqueue, which reads them (the worker
            # writes them too, at its start).
            for name, size in (limits or {}).items():
                concurrency_limits.write(conn, name, size)
            for key, weight in (weights or {}).items():
                concurrency_limits.write_weight(conn, key, weight)
        ledger.HOLD_LIMITS.forget()
        tasks.configure(settings)
        fleet.start("w", "loomflow_worker.tasks", args.concurrency, env, pool="threads")
        fleet.wait_ready(["w"])
        started = time.monotonic()
        alice = [tasks.run_agent.delay(f"hello {i}", f"alice-{i}", user_id="alice").id
                 for i in range(args.backlog)]
        bob = [tasks.run_agent.delay(f"hello {i}", f"bob-{i}", user_id="bob").id
               for i in range(args.second)]
        with psycopg.connect(dsn, autocommit=True) as conn:
            while True:
                row = conn.execute("SELECT count(*) FROM runs WHERE status = 'succeeded'"
                                   ).fetchone()
                if row is not None and row[0] == len(alice) + len(bob):
                    break
                if time.monotonic() - started > WAIT_S:
                    raise RuntimeError(f"{label}: not done within {WAIT_S:g}s")
                time.sleep(0.5)
            seconds = time.monotonic() - started
            bob_start = [float(r[0]) for r in conn.execute(
                "SELECT extract(epoch FROM a.started_at - r.enqueued_at) FROM runs r"
                " JOIN run_attempts a USING (request_id) WHERE a.attempt = 1"
                " AND r.request_id = ANY(%s)", (bob,)).fetchall()]
            row = conn.execute(
                "SELECT extract(epoch FROM max(finished_at) - min(enqueued_at)) FROM runs"
                " WHERE request_id = ANY(%s)", (alice,)).fetchone()
            alice_done = float(row[0]) if row is not None else 0.0
            # Runs started from bob's first enqueue until his last start.
            row = conn.execute(
                "WITH w AS (SELECT min(r.enqueued_at) AS lo, max(a.started_at) AS hi"
                "  FROM runs r JOIN run_attempts a USING (request_id)"
                "  WHERE r.request_id = ANY(%s))"
                " SELECT count(*) FILTER (WHERE r.user_id = 'bob'), count(*)"
                " FROM runs r JOIN run_attempts a USING (request_id), w"
                " WHERE a.attempt = 1 AND a.started_at BETWEEN w.lo AND w.hi", (bob,)).fetchone()
            bob_share = row[0] / row[1] if row is not None and row[1] else 0.0
    finally:
        teardown(fleet, redis_url, prefix, admin_dsn, [dbname])
    return Side(label, sorted(bob_start), alice_done, bob_share, seconds)


def report(sides: Sequence[Side]) -> list[str]:
    out = [f"\n{'':<16}{'bob start p50':>14}{'max':>8}{'alice done':>12}"
           f"{'bob share':>11}{'seconds':>9}"]
    for s in sides:
        out.append(f"{s.label:<16}{statistics.median(s.bob_start):>13.2f}s"
                   f"{max(s.bob_start):>7.2f}s{s.alice_done:>11.1f}s{s.bob_share:>10.0%}"
                   f"{s.seconds:>9.1f}")
    out.append("(bob share: of the runs started while bob's requests waited, his)")
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--backlog", type=int, default=2000, help="alice's requests (2000)")
    parser.add_argument("--second", type=int, default=10, help="bob's requests (10)")
    parser.add_argument("--concurrency", type=int, default=50, help="the worker's runs (50)")
    parser.add_argument("--per-key", type=int, default=None,
                        help="the per_key limit (default: half the concurrency)")
    parser.add_argument("--fair-queue", type=int, default=None,
                        help="the fair_queue limit (default: a fifth of the concurrency)")
    parser.add_argument("--bob-weight", type=float, default=1.0,
                        help="bob's fairness weight on the fair shares side (1)")
    parser.add_argument("--latency", type=float, default=0.2,
                        help="seconds each model call waits (0.2)")
    parser.add_argument("--only", default=None,
                        help="run only these sides, comma-separated: defaults, off, per_key, "
                             "fair_queue")
    args = parser.parse_args(argv)
    if min(args.backlog, args.second, args.concurrency) < 1:
        parser.error("--backlog, --second and --concurrency must be at least 1")
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
        "BENCH_MODEL_LATENCY": str(args.latency),
    }
    per_key = args.per_key or max(1, args.concurrency // 2)
    fair_queue = args.fair_queue or max(1, args.concurrency // 5)
    print(f"python {platform.python_version()}, celery {version('celery')}, "
          f"{os.cpu_count()} CPUs; {git_state()}; load average {os.getloadavg()[0]:.2f}")
    print(f"settings: --backlog {args.backlog} --second {args.second} --concurrency "
          f"{args.concurrency} --per-key {per_key} --fair-queue {fair_queue} --bob-weight "
          f"{args.bob_weight:g} --latency {args.latency:g}", flush=True)
    wanted = set(args.only.split(",")) if args.only else None
    plans = [("defaults", "defaults", None, None),
             ("off", "off", {"fair_queue": 0}, None),
             ("per_key", f"per_key {per_key}", {"per_key": per_key}, None),
             ("fair_queue", f"fair_queue {fair_queue}", {"fair_queue": fair_queue},
              {"bob": args.bob_weight})]
    sides = [run_side(label, args, base_env, admin_dsn, redis_url, limits, weights)
             for name, label, limits, weights in plans if wanted is None or name in wanted]
    print("\n".join(report(sides)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
