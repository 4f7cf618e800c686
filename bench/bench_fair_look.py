"""Time a fair look (``loomflow_worker_fair_next``) against how many tenants wait.

For each ``--tenants`` count, a scratch database migrated by this code holds that many
tenants with requests withheld for their fair turn (``--requests`` each), fair_queue 0
(a look's room is its page). A look of ``--page`` requests runs ``--looks`` times, each in
a transaction rolled back, so that every look meets the same ledger; printed are its p50
and fastest time (round trip included) and the pages it read (shared buffers hit or read,
from ``pg_stat_database``). A look that walks every waiting tenant grows with them; one
that reads their marks (migration 0044) grows far slower.

Run it with::

    python bench/bench_fair_look.py [--tenants 200 2000 20000] [--requests 1]

The admin connection string defaults to postgresql://postgres@127.0.0.1:5432/postgres
and is overridden by LOOMFLOW_WORKER_BENCH_ADMIN_DSN.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
import psycopg  # noqa: E402

from bench.bench_orphans import _migrate  # noqa: E402
from bench.bench_runtime import scratch_database  # noqa: E402
from loomflow_worker.runtime.sql import query  # noqa: E402


def _pages(conn: psycopg.Connection[Any]) -> int:
    conn.execute("SELECT pg_stat_force_next_flush()")
    row = conn.execute("SELECT blks_hit + blks_read FROM pg_stat_database"
                       " WHERE datname = current_database()").fetchone()
    assert row is not None
    return int(row[0])


def measure(tenants: int, requests: int, page: int, looks: int) -> str:
    with scratch_database() as dsn:
        anyio.run(_migrate, dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SET jit = off")
            conn.execute("INSERT INTO concurrency_limits (name, max_runs)"
                         " VALUES ('fair_queue', 0)")
            conn.execute(
                "INSERT INTO runs (request_id, scope, session_id, agent, prompt, status,"
                " fairness_key, waiting_for, waiting_slots, dispatched_at, received_at,"
                " enqueued_at)"
                " SELECT 'r-' || i, 's-' || i, 's-' || i, 'a', 'p', 'queued', 'k-' || (i %% %s),"
                " 'limit fair_queue', '{}', now(), now(), now() - i * interval '1 second'"
                " FROM generate_series(1, %s) AS i", (tenants, tenants * requests))
            conn.execute("VACUUM ANALYZE")
            times: list[float] = []
            pages: list[int] = []
            for _ in range(looks):
                before = _pages(conn)
                began = time.perf_counter()
                with conn.transaction(force_rollback=True):
                    sent = conn.execute(query("fair_next"), {"wait": True, "page": page})
                    assert len(sent.fetchall()) == page
                times.append(time.perf_counter() - began)
                pages.append(_pages(conn) - before)
    return (f"{tenants:>8} {statistics.median(times) * 1000:>9.2f} "
            f"{min(times) * 1000:>9.2f} {statistics.median(pages):>8.0f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, nargs="+", default=[200, 2000, 20000])
    parser.add_argument("--requests", type=int, default=1, help="withheld a tenant")
    parser.add_argument("--page", type=int, default=7, help="requests a look sends")
    parser.add_argument("--looks", type=int, default=30)
    args = parser.parse_args()
    if min(*args.tenants, args.requests, args.page, args.looks) < 1:
        parser.error("--tenants, --requests, --page and --looks must be at least 1")
    if args.page > min(args.tenants) * args.requests:
        parser.error("--page must be at most the requests withheld (--tenants x --requests)")
    print(f"a look of {args.page}, {args.looks} times; {args.requests} request(s) withheld"
          " a tenant", flush=True)
    print(f"{'tenants':>8} {'p50 ms':>9} {'min ms':>9} {'pages':>8}", flush=True)
    for tenants in args.tenants:
        print(measure(tenants, args.requests, args.page, args.looks), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
