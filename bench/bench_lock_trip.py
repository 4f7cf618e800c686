"""Process CPU per journal write: through a lock connection, against a bare round trip,
and what a write's fencing token costs.

One process, one scratch database. A round makes ``--writes`` (3,000) journal upserts one
after another on each side, taking turns every ``--chunk`` (300):

- ``lock connection``: ``LockConnection.write`` on a lock connection of a ``PostgresRuntime``
  holding one scope's lock, as a run alone on its connection writes (the caller sends the
  statement itself and the socket's reader callback reads the answer), with no fencing token
  (a run outside a worker);
- ``with token``: the same, each row carrying its attempt (request id and attempt number) as a
  worker's runs write, which the database checks is still open in the ledger (migration 0034);
- ``bare``: the same upsert through ``runtime/fastpath.py`` on a connection of its own, its
  socket watched the same way: the floor of a round trip from Python through libpq.

A side's figures for a round are the process CPU (``time.process_time()``) and its Postgres
backend's CPU (``/proc/<pid>/stat``, this machine's server) over its writes, in
microseconds; each ratio is the median of the per-round ratios. Run it with::

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

SIDES = ("lock connection", "with token", "bare")
VALUE = b"LJ1" + b"x" * 300  # about a tool result's size
TICK = os.sysconf("SC_CLK_TCK")


def _backend_cpu(pid: int) -> float:
    """Seconds of CPU a Postgres backend on this machine has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


async def _timed(write: Callable[[], Awaitable[object]], count: int,
                 backend: int) -> tuple[float, float]:
    started, server = time.process_time(), _backend_cpu(backend)
    for _ in range(count):
        await write()
    return time.process_time() - started, _backend_cpu(backend) - server


async def bench(dsn: str, writes: int, rounds: int, chunk: int
                ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    runtime = await PostgresRuntime.connect(dsn, lock_connections=1)
    bare = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    try:
        await runtime.init_schema()
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as setup:
            # An open attempt, as a worker's run has: its token checks against it.
            await setup.execute(
                "INSERT INTO runs (request_id, scope, session_id, agent, prompt, status, "
                "attempts) VALUES ('bench', 'bench-trip', 's', 'default', 'p', 'running', 1)")
            await setup.execute(
                "INSERT INTO run_attempts (request_id, attempt, worker, pid, epoch) "
                "VALUES ('bench', 1, 'bench@host', 1, 0)")
        lease = await runtime.journal.acquire("bench-trip", 0)
        row = [JournalRow("steps", "bench-trip", "k", VALUE)]
        tokened = [JournalRow("steps", "bench-trip", "t", VALUE, ("bench", 1))]
        call = fastpath.journal_call("steps", "bare", "k", VALUE)
        fastpath.watch(bare)
        sides: dict[str, Callable[[], Awaitable[object]]] = {
            "lock connection": lambda: lease.lock_conn.write(row),
            "with token": lambda: lease.lock_conn.write(tokened),
            "bare": lambda: fastpath.pipeline(bare, [call]),
        }
        backends = {"lock connection": lease.backend_pid, "with token": lease.backend_pid,
                    "bare": bare.info.backend_pid}
        for side, write in sides.items():  # warm-up: prepared statements, caches
            await _timed(write, chunk, backends[side])
        per_write: dict[str, list[float]] = {side: [] for side in SIDES}
        per_server: dict[str, list[float]] = {side: [] for side in SIDES}
        for r in range(rounds):
            spent = dict.fromkeys(SIDES, 0.0)
            served = dict.fromkeys(SIDES, 0.0)
            for c, _ in enumerate(range(0, writes, chunk)):
                order = SIDES if (r + c) % 2 == 0 else SIDES[::-1]
                for side in order:
                    client, server = await _timed(sides[side], chunk, backends[side])
                    spent[side] += client
                    served[side] += server
            done = chunk * len(range(0, writes, chunk))
            for side in SIDES:
                per_write[side].append(1e6 * spent[side] / done)
                per_server[side].append(1e6 * served[side] / done)
        await runtime.journal.release(lease)
        return per_write, per_server
    finally:
        fastpath.unwatch(bare)
        await bare.close()
        await runtime.aclose()


def _ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True) if y)


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
        per_write, per_server = anyio.run(bench, dsn, args.writes, args.rounds, args.chunk)
    print("CPU per journal write, us (process / its Postgres backend):")
    print(f"   {'round':<6}" + "".join(f"{side:>22}" for side in SIDES))
    for r in range(args.rounds):
        print(f"   {r + 1:<6}" + "".join(
            f"{per_write[side][r]:>13.1f} / {per_server[side][r]:>6.1f}" for side in SIDES))
    med = {side: (statistics.median(per_write[side]), statistics.median(per_server[side]))
           for side in SIDES}
    print("median: " + ", ".join(f"{side} {c:.1f} / {s:.1f} us" for side, (c, s) in med.items()))
    print(f"lock connection / bare, process CPU: "
          f"{_ratio(per_write['lock connection'], per_write['bare']):.2f}x")
    print(f"with token / without, process CPU: "
          f"{_ratio(per_write['with token'], per_write['lock connection']):.2f}x; "
          f"backend CPU: {_ratio(per_server['with token'], per_server['lock connection']):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
