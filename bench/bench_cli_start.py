"""How long the ``loomflow-worker`` operator commands take, against the libraries they need.

Each command is run as a user runs it (the console script pip made, a fresh process),
against a scratch database it creates, migrates and drops: ``requests``, ``show`` and
``cancel`` of an unknown request, ``signal``, ``limits``, ``migrate`` (nothing to apply),
``prune`` (nothing to prune) and ``--help``. Side by side in the same rounds it runs the
floor: a bare interpreter, and one that only imports psycopg and pydantic-settings (the
driver and the settings library every command that reaches Postgres needs; the floor's
process, unlike a command's, tears their modules down as it exits). The machine
is shared and its speed drifts, so the rounds alternate the commands and the figure of
each is the median of ``--rounds`` (7) wall times, with what it takes above the floor.
Target: each operator command under 0.3 s.

Run it with::

    python bench/bench_cli_start.py [--rounds 7]

The admin connection string defaults to postgresql://postgres@127.0.0.1:5432/postgres
and is overridden by LOOMFLOW_WORKER_BENCH_ADMIN_DSN.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import sysconfig
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from bench_runtime import DEFAULT_ADMIN_DSN, create_database, database_uri, drop_database

SCRIPT = str(Path(sysconfig.get_path("scripts")) / "loomflow-worker")
UNKNOWN = "00000000-0000-0000-0000-000000000000"
TARGET = 0.3

FLOOR: dict[str, list[str]] = {
    "python (bare)": [sys.executable, "-c", "pass"],
    "import psycopg, pydantic_settings": [
        sys.executable, "-c", "import psycopg, pydantic_settings"],
}
COMMANDS: dict[str, tuple[list[str], set[int]]] = {
    "--help": (["--help"], {0}),
    "requests": (["requests"], {0}),
    "show": (["show", UNKNOWN], {4}),
    "cancel": (["cancel", UNKNOWN], {4}),
    "signal": (["signal", "bench-session", "ping", '{"n": 1}'], {0}),
    "limits": (["limits"], {0}),
    "migrate": (["migrate"], {0}),
    "prune": (["prune", "--older-than", "30d", "--yes"], {0}),
}


def timed(argv: list[str], env: dict[str, str], codes: set[int]) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    took = time.perf_counter() - started
    if done.returncode not in codes:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: {done.stderr[-500:]}")
    return took


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    if not Path(SCRIPT).exists():
        raise SystemExit(f"{SCRIPT} is missing: pip install -e '.[test]'")
    admin = os.environ.get("LOOMFLOW_WORKER_BENCH_ADMIN_DSN", DEFAULT_ADMIN_DSN)
    name = f"lfw_bench_cli_{uuid.uuid4().hex[:10]}"
    create_database(admin, name)
    env = {**os.environ, "LOOMFLOW_WORKER_DATABASE_URL": database_uri(admin, name)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as installed: bytecode cached
    try:
        timed([SCRIPT, "migrate"], env, {0})
        times: dict[str, list[float]] = {label: [] for label in [*FLOOR, *COMMANDS]}
        for r in range(args.rounds + 1):  # the first round warms the caches
            order = [*FLOOR.items(), *((k, [SCRIPT, *a]) for k, (a, _) in COMMANDS.items())]
            for label, command in order if r % 2 else order[::-1]:
                took = timed(command, env, COMMANDS[label][1] if label in COMMANDS else {0})
                if r:
                    times[label].append(took)
    finally:
        drop_database(admin, name)
    median = {label: statistics.median(t) for label, t in times.items()}
    floor = median["import psycopg, pydantic_settings"]
    print(f"median wall time of {args.rounds} rounds, a fresh process each; python "
          f"{sys.version.split()[0]}, {os.cpu_count()} CPUs")
    for label in FLOOR:
        print(f"  {label:<36}{median[label]:>7.3f}s  (floor)")
    met = True
    for label in COMMANDS:
        above = median[label] - floor
        note = "" if label == "--help" else f"  {above:+.3f}s against the floor"
        met &= median[label] < TARGET
        print(f"  loomflow-worker {label:<20}{median[label]:>7.3f}s{note}")
    print(f"target: each under {TARGET}s: {'met' if met else 'MISSED'}")


if __name__ == "__main__":
    main()
