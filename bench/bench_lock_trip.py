"""Process CPU per journal write: through a lock connection, against a bare round trip.

One process, one scratch database. A round makes ``--writes`` (3,000) journal upserts one
after another on each side, taking turns every ``--chunk`` (300):

- ``lock connection``: ``LockConnection.write`` on a lock connection of a ``PostgresRuntime``
  holding one scope's lock, as a run alone on its connection writes (the caller sends the
  statement itself and the socket's reader callback reads the answer);
- ``bare``: the same upsert through ``runtime/fastpath.py`` on a connection of its own, its
  socket watched the same way: the floor of a round trip from Python through libpq.

A side's figure for a round is the process CPU (``time.process_time()``) over its writes,
in microseconds; the ratio is the median of the per-round ratios. Run it with::

    python bench/bench_lock_trip.py [--writes 3000] [--rounds 5] [--chunk 300]

The admin connection string defaults to postgresql://postgres@127.0.0.1:5432/postgres
and is overridden by LOOMFLOW_WORKER_BENCH_ADMIN_DSN.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
import psycopg  # noqa: E402

from bench.bench_runtime import describe, scratch_database  # noqa: E402
from loomflow_worker.runtime import PostgresRuntime, fastpath  # noqa: E402
from loomflow_worker.runtime.lockconn import JournalRow  # noqa: E402

SIDES = ("lock connection", "bare")
VALUE = b"LJ1" + b"x" * 300  # about a tool result's size


async def _timed(write: Callable[[], Awaitable[object]], count: int) -> float:
    started = time.process_time()
    for _ in range(count):
        await write()
    return time.process_time() - started


async def bench(dsn: str, writes: int, rounds: int, chunk: int) -> dict[str, list[float]]:
    runtime = await PostgresRuntime.connect(dsn, lock_connections=1)
    bare = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    try:
        await runtime.init_schema()
        lease = await runtime.journal.acquire("bench-trip", 0)
        row = [JournalRow("steps", "bench-trip", "k", VALUE)]
        call = fastpath.journal_call("steps", "bare", "k", VALUE)
        fastpath.watch(bare)
        sides: dict[str, Callable[[], Awaitable[object]]] = {
            "lock connection": lambda: lease.lock_conn.write(row),
            "bare": lambda: fastpath.pipeline(bare, [call]),
        }
        for write in sides.values():  # warm-up: prepared statements, caches
            await _timed(write, chunk)
        per_write: dict[str, list[float]] = {side: [] for side in SIDES}
        for r in range(rounds):
            spent = dict.fromkeys(SIDES, 0.0)
            for c, _ in enumerate(range(0, writes, chunk)):
                order = SIDES if (r + c) % 2 == 0 else SIDES[::-1]
                for side in order:
                    spent[side] += await _timed(sides[side], chunk)
            done = chunk * len(range(0, writes, chunk))
            for side in SIDES:
                per_write[side].append(1e6 * spent[side] / done)
        await runtime.journal.release(lease)
        return per_write
    finally:
        fastpath.unwatch(bare)
        await bare.close()
        await runtime.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--writes", type=int, default=3000, help="writes a side and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--chunk", type=int, default=300,
                        help="writes a side makes before the other side's turn (default 300)")
    args = parser.parse_args(argv)
    if min(args.writes, args.rounds, args.chunk) < 1:
        parser.error("--writes, --rounds and --chunk must be at least 1")
    with scratch_database() as dsn:
        print(f"scratch database {describe(dsn)}; {os.cpu_count()} CPUs; --writes {args.writes}"
              f" --rounds {args.rounds} --chunk {args.chunk}", flush=True)
        per_write = anyio.run(bench, dsn, args.writes, args.rounds, args.chunk)
    ratios = [a / b for a, b in zip(per_write["lock connection"], per_write["bare"],
                                     strict=True)]
    print("process CPU per journal write, us:")
    print(f"   {'round':<6}{'lock connection':>16}{'bare':>8}{'ratio':>8}")
    for r, ratio in enumerate(ratios):
        print(f"   {r + 1:<6}{per_write['lock connection'][r]:>16.1f}"
              f"{per_write['bare'][r]:>8.1f}{ratio:>7.2f}x")
    print(f"median: lock connection {statistics.median(per_write['lock connection']):.1f} us, "
          f"bare {statistics.median(per_write['bare']):.1f} us -> "
          f"{statistics.median(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
