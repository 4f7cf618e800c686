"""Measure a fleet against a metered model key: every run succeeds, and the budget keeps
the calls under the provider's limit instead of being told so.

A local stand-in for the Messages API (``tests/integration/messages_api.py``) meters the
key as a provider does: at most ``--rpm`` requests in any 60 s, past that 429 with
``retry-after``. One threads-pool worker process (``-c --concurrency``) runs ``--runs``
requests of one model call each (loomflow's real ``AnthropicModel``), twice, side by side:

- ``provider only``: no budget; the provider's 429s make the calls wait;
- ``budget``: ``LOOMFLOW_WORKER_MODEL_LIMITS`` gives the key ``--rpm`` times ``--share``
  (0.97) requests a minute, booked fleet-wide before each call.

Reported for each: requests succeeded and failed, attempts that gave their slot back for a
long wait (``PARK_AFTER``) and those that ended any other way before their run's end,
model calls answered and refused (429), and model calls a minute after the first minute
(once a full bucket's burst has gone). Each side has a scratch database, queue and key prefix of its
own, as in ``bench_celery.py``.

Run it with::

    python bench/bench_model_limits.py [--runs 1000] [--rpm 300] [--concurrency 200]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
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
from tests.integration.messages_api import API_KEY, MODEL, serving  # noqa: E402

WAIT_S = 3600.0


@dataclass
class Side:
    label: str
    succeeded: int
    failed: int
    paused: int
    other_attempts: int
    answered: int
    refused: int
    per_minute: float
    seconds: float


def run_side(label: str, args: argparse.Namespace, base_env: dict[str, str],
             admin_dsn: str, redis_url: str, budget: int | None) -> Side:
    tag = uuid.uuid4().hex[:8]
    dbname, prefix = f"lfw_bench_{tag}", f"lfwbench:{tag}:"
    dsn = database_uri(admin_dsn, dbname)
    env, settings = ours_config(dsn, redis_url, prefix, f"lfwm-{tag}")
    logs = Path(tempfile.mkdtemp(prefix=f"lfw_bench_limits_{tag}_"))
    fleet = Fleet(logs, tag, base_env)
    with serving() as api:
        api.per_window, api.window = args.rpm, 60.0
        env = {**env, "ANTHROPIC_BASE_URL": api.url, "ANTHROPIC_API_KEY": API_KEY}
        if budget is not None:
            env["LOOMFLOW_WORKER_MODEL_LIMITS"] = json.dumps({MODEL: {"rpm": budget}})
        try:
            create_database(admin_dsn, dbname)
            anyio.run(_migrate, dsn)
            tasks.configure(settings)
            fleet.start("w", "loomflow_worker.tasks", args.concurrency, env, pool="threads")
            fleet.wait_ready(["w"])
            started = time.monotonic()
            ids = [tasks.run_agent.delay(f"hello {i}", f"limits-{tag}-{i}", agent="claude").id
                   for i in range(args.runs)]
            with psycopg.connect(dsn, autocommit=True) as conn:
                while True:
                    row = conn.execute(
                        "SELECT count(*) FILTER (WHERE status = 'succeeded'),"
                        " count(*) FILTER (WHERE status IN ('failed', 'dead'))"
                        " FROM runs WHERE request_id = ANY(%s)", (ids,)).fetchone()
                    assert row is not None
                    if row[0] + row[1] == len(ids):
                        outcomes = dict(conn.execute(
                            "SELECT coalesce(outcome, 'died'), count(*) FROM run_attempts"
                            " WHERE request_id = ANY(%s) AND outcome IS DISTINCT FROM"
                            " 'succeeded' GROUP BY 1", (ids,)).fetchall())
                        break
                    if time.monotonic() - started > WAIT_S:
                        raise RuntimeError(f"{label}: not done within {WAIT_S:g}s")
                    time.sleep(0.5)
            seconds = time.monotonic() - started
        finally:
            teardown(fleet, redis_url, prefix, admin_dsn, [dbname])
        statuses = api.statuses()
        admitted = sorted(api.admitted())
    # The pace after the first minute, once a full bucket's burst has gone.
    later = [t for t in admitted if t >= admitted[0] + 60] if admitted else []
    per_minute = 60 * (len(later) - 1) / (later[-1] - later[0]) if len(later) > 1 else 0.0
    return Side(label, int(row[0]), int(row[1]), outcomes.get("paused", 0),
                sum(n for outcome, n in outcomes.items() if outcome != "paused"),
                statuses.count(200), statuses.count(429), per_minute, seconds)


def report(sides: Sequence[Side], rpm: int) -> list[str]:
    out = [f"\n{'':<16}{'ok':>6}{'failed':>8}{'paused':>8}{'retried':>9}{'calls':>7}"
           f"{'429s':>7}{'calls/min':>11}{'seconds':>9}   (provider's limit: {rpm} a minute)"]
    for s in sides:
        out.append(f"{s.label:<16}{s.succeeded:>6}{s.failed:>8}{s.paused:>8}"
                   f"{s.other_attempts:>9}{s.answered:>7}{s.refused:>7}{s.per_minute:>11.1f}"
                   f"{s.seconds:>9.1f}")
    out.append("paused: attempts that gave their slot back for a long wait (PARK_AFTER); "
               "retried: attempts that ended any other way than their run's end (a retry, a "
               "crash, a lost lock); calls/min: after the first minute")
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=1000, help="requests (default 1000)")
    parser.add_argument("--rpm", type=int, default=300,
                        help="the provider's requests a minute (default 300)")
    parser.add_argument("--share", type=float, default=0.97,
                        help="the budget, as a share of --rpm (default 0.97)")
    parser.add_argument("--concurrency", type=int, default=200,
                        help="runs the worker process carries at once (default 200)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.rpm < 1 or not 0 < args.share <= 1:
        parser.error("--runs and --rpm must be at least 1, --share in (0, 1]")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    admin_dsn = os.environ.get(ADMIN_DSN_ENV, DEFAULT_ADMIN_DSN)
    redis_url = os.environ.get(REDIS_ENV, DEFAULT_REDIS)
    base_env = {
        **{k: v for k, v in os.environ.items()
           if not k.startswith(("LOOMFLOW_WORKER_", "BENCH_", "ANTHROPIC_"))},
        "PYTHONPATH": str(ROOT),
    }
    print(f"python {platform.python_version()}, celery {version('celery')}, "
          f"{os.cpu_count()} CPUs; {git_state()}; load average {os.getloadavg()[0]:.2f}")
    print(f"settings: --runs {args.runs} --rpm {args.rpm} --share {args.share:g} "
          f"--concurrency {args.concurrency}", flush=True)
    budget = max(1, int(args.rpm * args.share))
    sides = [run_side("provider only", args, base_env, admin_dsn, redis_url, None),
             run_side(f"budget {budget}/min", args, base_env, admin_dsn, redis_url, budget)]
    print("\n".join(report(sides, args.rpm)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
