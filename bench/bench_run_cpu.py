"""Process CPU per agent run: our ``PostgresRuntime`` against loomflow's in-memory runtime.

In one process, without Celery: the bench agent (``bench/agents_bench.py``) with a model that
answers at once, ``NoMemory``, and a prompt of 2 tool calls (3 model calls, 2 tool calls a
run). A round runs ``--runs`` (300) runs one after another, each on a session of its own,
on each side:

- ``in-memory``: loomflow's ``JournaledRuntime()``, its journal a dict in this process;
- ``ours``: ``loomflow_worker.runtime.PostgresRuntime`` on a scratch database it creates
  and drops (its lock, epoch and journal writes are real round trips to Postgres).

A side's figure for a round is the process CPU (``time.process_time()``: every thread of
this process, user and system) spent on its runs, divided by the runs; the kernel's part
of it is shown too. Postgres' own CPU is not in it. Within a round the sides take turns
every ``--chunk`` (30) runs, so that both see the same moments of a machine whose load
changes; rounds alternate the order of the sides, after a warm-up round. The figures are
medians over rounds and the ratio is the median of the per-round ratios. Target: ours
<= 2.0x the in-memory runtime.

``--profile FILE`` also runs one more round of ours under cProfile (timed in process CPU,
not wall time) and writes its stats
to FILE (read them with ``python -m pstats FILE``).

Run it with::

    python bench/bench_run_cpu.py [--runs 300] [--rounds 7] [--chunk 30] [--profile FILE]

The admin connection string defaults to postgresql://postgres@127.0.0.1:5432/postgres
and is overridden by LOOMFLOW_WORKER_BENCH_ADMIN_DSN.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
from loomflow import Agent  # noqa: E402
from loomflow.runtime.journaled import JournaledRuntime  # noqa: E402

from bench.agents_bench import calls, expected_output, record_tool  # noqa: E402
from bench.bench_runtime import describe, scratch_database  # noqa: E402
from loomflow_worker import NoMemory  # noqa: E402
from loomflow_worker.runtime import PostgresRuntime  # noqa: E402
from loomflow_worker.testing import DeterministicModel  # noqa: E402

TARGET_RATIO = 2.0
SIDES = ("in-memory", "ours")
TAGS = ("a", "b")  # 2 tool calls, 3 model calls


@dataclass
class Result:
    runs: int
    sides: tuple[str, ...] = SIDES
    orders: list[tuple[str, ...]] = field(default_factory=list)
    cpu_ms: dict[str, list[float]] = field(default_factory=dict)
    sys_ms: dict[str, list[float]] = field(default_factory=dict)
    wall_ms: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for figures in (self.cpu_ms, self.sys_ms, self.wall_ms):
            for side in self.sides:
                figures.setdefault(side, [])

    def ratios(self, side: str = "ours", base: str = "in-memory") -> list[float]:
        """``side``'s CPU per run over ``base``'s, round by round."""
        return [o / m for o, m in zip(self.cpu_ms[side], self.cpu_ms[base], strict=True)]


async def _noop_emit(event: Any) -> None:
    return None


def build(runtime: JournaledRuntime) -> Agent:
    return Agent("bench agent", model=DeterministicModel(), tools=[record_tool()],
                 runtime=runtime, memory=NoMemory(), auto_extract=False)


async def plain_run(agent: Agent, prompt: str, session_id: str) -> Any:
    """One run of ``agent``, as :func:`run_batch` makes it unless told otherwise."""
    return await agent.run(prompt, session_id=session_id, emit=_noop_emit)


#: How :func:`run_batch` makes one run: the agent, the prompt and the session.
RunOne = Callable[[Agent, str, str], Awaitable[Any]]


async def run_batch(agent: Agent, tag: str, runs: int,
                    run: RunOne = plain_run) -> tuple[float, float, float]:
    """``runs`` runs one after another, each on a fresh session: process CPU, the
    part of it spent in the kernel, and wall time, in ms per run."""
    prompt, expected = calls(*TAGS), expected_output(*TAGS)
    gc.collect()
    cpu0, sys0, wall0 = time.process_time(), os.times().system, time.perf_counter()
    for i in range(runs):
        result = await run(agent, prompt, f"{tag}-{i}")
        if result.output != expected:
            raise AssertionError(f"{tag}-{i}: the run answered {result.output!r}")
    cpu, kernel = time.process_time() - cpu0, os.times().system - sys0
    wall = time.perf_counter() - wall0
    return 1000 * cpu / runs, 1000 * kernel / runs, 1000 * wall / runs


#: One side's batch of runs: its tag and how many runs; ms per run as :func:`run_batch`.
Batch = Callable[[str, int], Awaitable[tuple[float, float, float]]]


async def take_turns(batches: dict[str, Batch], runs: int, rounds: int, chunk: int,
                     tag: str) -> Result:
    """Each side's ``runs`` runs a round, for ``rounds`` rounds after a warm-up
    round: within a round the sides take turns every ``chunk`` runs, so that
    all see the same moments of a machine whose load changes, and the order
    of the sides turns from round to round (and from chunk to chunk)."""
    sides = tuple(batches)
    for side in sides:  # warm-up: connections, prepared statements, caches
        await batches[side](f"{tag}-warm-{side}", runs)
    result = Result(runs=runs, sides=sides)
    for r in range(rounds):
        shift = r % len(sides)
        order = sides[shift:] + sides[:shift]
        result.orders.append(order)
        totals = {side: [0.0, 0.0, 0.0] for side in sides}
        for c, start in enumerate(range(0, runs, chunk)):
            size = min(chunk, runs - start)
            for side in order if c % 2 == 0 else order[::-1]:
                got = await batches[side](f"{tag}-r{r}-{side}-{c}", size)
                totals[side] = [t + g * size for t, g in zip(totals[side], got, strict=True)]
        for side, (cpu, kernel, wall) in totals.items():
            result.cpu_ms[side].append(cpu / runs)
            result.sys_ms[side].append(kernel / runs)
            result.wall_ms[side].append(wall / runs)
    return result


async def bench(
    dsn: str, runs: int, rounds: int, chunk: int, profile: str | None
) -> Result:
    ours = await PostgresRuntime.connect(dsn)
    try:
        await ours.init_schema()
        agents = {"in-memory": build(JournaledRuntime()), "ours": build(ours)}
        tag = uuid.uuid4().hex[:6]
        result = await take_turns(
            {side: functools.partial(run_batch, agents[side]) for side in SIDES},
            runs, rounds, chunk, tag)
        if profile:
            profiler = cProfile.Profile(time.process_time)
            profiler.enable()
            await run_batch(agents["ours"], f"{tag}-profile", runs)
            profiler.disable()
            profiler.dump_stats(profile)
        steps = ours.stats.steps_executed
        if steps < (rounds + 1) * runs * 5:  # 3 model calls and 2 tool calls a run at least
            raise AssertionError(f"ours journaled only {steps} steps")
    finally:
        await ours.aclose()
    return result


def report(result: Result) -> list[str]:
    out: list[str] = []
    p = out.append
    p(f"process CPU per run, {result.runs} runs per side and round: ms of CPU (of which in "
      "the kernel) and wall ms")
    p(f"   {'round':<6}{'order':<20}{'in-memory':>24}{'ours':>24}{'ours/mem':>10}")
    for r, order in enumerate(result.orders):
        p(f"   {r + 1:<6}{','.join(order):<20}"
          + "".join(f"{result.cpu_ms[s][r]:>7.3f} ({result.sys_ms[s][r]:.2f})"
                    f" {result.wall_ms[s][r]:>6.2f}"
                    for s in SIDES)
          + f"{result.ratios()[r]:>9.2f}x")
    med = {s: statistics.median(result.cpu_ms[s]) for s in SIDES}
    ratio = statistics.median(result.ratios())
    p(f"   {'median':<26}"
      + "".join(f"{med[s]:>7.3f} ({statistics.median(result.sys_ms[s]):.2f}){'':>7}"
                for s in SIDES)
      + f"{ratio:>9.2f}x")
    p("")
    p(f"summary: ours {med['ours']:.2f} ms, loomflow's JournaledRuntime() (in memory) "
      f"{med['in-memory']:.2f} ms of process CPU per run -> {ratio:.2f}x "
      f"(target <= {TARGET_RATIO:g}: {'met' if ratio <= TARGET_RATIO else 'MISSED'}); "
      f"single rounds {min(result.ratios()):.2f}-{max(result.ratios()):.2f}x")
    return out


def turn_arguments(parser: argparse.ArgumentParser, chunk: int = 30) -> None:
    """The options of :func:`take_turns`: ``--runs``, ``--rounds`` and ``--chunk``
    (by default ``chunk``)."""
    parser.add_argument("--runs", type=int, default=300,
                        help="runs per side and round, one after another (default 300)")
    parser.add_argument("--rounds", type=int, default=7,
                        help="measured rounds after the warm-up (default 7)")
    parser.add_argument("--chunk", type=int, default=chunk,
                        help="runs a side makes before the next side's turn within a round "
                             f"(default {chunk})")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    turn_arguments(parser)
    parser.add_argument("--profile", metavar="FILE",
                        help="profile one more round of ours with cProfile into FILE")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.rounds < 1 or args.chunk < 1:
        parser.error("--runs, --rounds and --chunk must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with scratch_database() as dsn:
        print(f"scratch database {describe(dsn)}; python {platform.python_version()}, "
              f"psycopg {version('psycopg')}, loomflow {version('loomflow')}, "
              f"{os.cpu_count()} CPUs; --runs {args.runs} --rounds {args.rounds} "
              f"--chunk {args.chunk}", flush=True)
        result = anyio.run(bench, dsn, args.runs, args.rounds, args.chunk, args.profile)
        print("\n".join(report(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
