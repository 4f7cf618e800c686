"""What tracing off costs an agent run: the OpenTelemetry API installed with nothing
exported, against the same code with the API hidden.

In one process, without Celery, as ``bench/bench_run_cpu.py`` runs "ours": the bench agent
(``bench/agents_bench.py``: 3 model calls and 2 tool calls a run) on ``PostgresRuntime`` on
a scratch database it creates and drops. Each run is wrapped in exactly the tracing hooks a
request meets: ``tracing.enqueue_span`` once (the enqueue, in the caller's process) with the
headers it gives its message, then what a worker's attempt calls
(``tasks/perform.py``: ``attempt_span``, ``attempt_started``, ``attempt_ended``); the runtime
calls ``executed_step`` / ``replayed_step`` around each step itself. The sides:

- ``hidden``: ``loomflow_worker.tracing`` with the API taken for not installed
  (``tracing._api = None``): what a worker without the ``otel`` extra does;
- ``api``: the API importable, no tracer provider set (the API's default proxy): tracing
  off for a user who installed the extra and exports nothing;
- ``sdk0`` (unless ``--no-sdk``): the SDK's ``TracerProvider`` with a
  ``ParentBased(TraceIdRatioBased(0))`` sampler, exporting nothing: every span decided and
  dropped.

A side's figure for a round is the process CPU (``time.process_time()``) its runs spent,
divided by the runs. The sides take turns every ``--chunk`` (3) runs within a round (every
30, single rounds spread over 0.95-1.13x on a shared machine; every 3, 0.97-1.03x), their order
turning from round to round, after a warm-up round; the figures are medians over rounds and
each ratio the median of the per-round ratios. Target: ``api`` within 1% of ``hidden``,
said met by the whole runs' median ratio; when it is above 1% but single rounds fall on
both sides of it (a shared machine's noise is larger than 1%), by what the hooks alone
cost more, as a share of ``hidden``'s run.

A microbenchmark times the hooks alone (no agent run), for one run's worth of them (the
enqueue span, the attempt's hooks and one ``executed_step`` per step the run journals),
``--reps`` (20,000) times per side, and says them as a share of ``hidden``'s CPU per run.

Run it with::

    python bench/bench_tracing_off.py [--runs 300] [--rounds 7] [--chunk 3] [--reps 20000]
                                      [--no-sdk] [--profile FILE]

``--profile FILE`` profiles one more batch of the ``api`` side (cProfile, process CPU). The
admin connection string defaults to postgresql://postgres@127.0.0.1:5432/postgres and is
overridden by LOOMFLOW_WORKER_BENCH_ADMIN_DSN.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
from loomflow import Agent  # noqa: E402
from opentelemetry import trace as otel_trace  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased  # noqa: E402

from bench.bench_run_cpu import (  # noqa: E402
    Result,
    build,
    plain_run,
    run_batch,
    take_turns,
    turn_arguments,
)
from bench.bench_runtime import describe, scratch_database  # noqa: E402
from loomflow_worker import tracing  # noqa: E402
from loomflow_worker.runtime import PostgresRuntime  # noqa: E402

TARGET = 0.01
TASK = "loomflow_worker.run_agent"
AGENT = "default"
WORKER = "bench@host"
DESCRIBED = {"hidden": "(i) API hidden", "api": "(ii) API, no SDK",
             "sdk0": "(iii) SDK, sampled 0"}
_SDK0 = TracerProvider(sampler=ParentBased(TraceIdRatioBased(0)))


def use(side: str) -> None:
    """Make ``loomflow_worker.tracing`` see ``side``'s OpenTelemetry: none, the API
    alone (no provider: its proxy), or the SDK's provider sampling nothing. The
    global provider is swapped in place (the API sets it once per process
    otherwise): a benchmark's shortcut, not something a worker does."""
    otel_trace._TRACER_PROVIDER = _SDK0 if side == "sdk0" else None  # type: ignore[attr-defined]
    tracing._api = None if side == "hidden" else otel_trace
    tracing.forget_provider()  # its look at the provider, kept once it found one


async def traced_run(agent: Agent, prompt: str, session_id: str) -> Any:
    """One run inside the hooks a request meets: its enqueue's span, then its
    attempt's span and marks (as ``tasks/perform.py`` and ``execute.py`` call them)."""
    request_id = session_id
    with tracing.enqueue_span(TASK, request_id, AGENT, session_id) as trace:
        options = tracing.with_headers({}, trace)
    with tracing.attempt_span(options.get("headers"), request_id, AGENT, session_id, WORKER):
        tracing.attempt_started(1, 0, None)
        result = await plain_run(agent, prompt, session_id)
        tracing.attempt_ended("succeeded", None)
    return result


def hooks_alone(steps: int) -> None:
    """One run's hooks with no run: ``steps`` executed steps inside the attempt."""
    with tracing.enqueue_span(TASK, "r", AGENT, "s") as trace:
        options = tracing.with_headers({}, trace)
    with tracing.attempt_span(options.get("headers"), "r", AGENT, "s", WORKER):
        tracing.attempt_started(1, 0, None)
        for _ in range(steps):
            with tracing.executed_step("model_call"):
                pass
        tracing.attempt_ended("succeeded", None)


def time_hooks(sides: Sequence[str], steps: int, reps: int,
               rounds: int = 5) -> dict[str, float]:
    """µs of process CPU one run's hooks take, per side (median over rounds,
    the sides taking turns)."""
    found: dict[str, list[float]] = {side: [] for side in sides}
    for r in range(rounds + 1):  # the first: a warm-up
        for side in sides if r % 2 == 0 else sides[::-1]:
            use(side)
            start = time.process_time()
            for _ in range(reps):
                hooks_alone(steps)
            if r:
                found[side].append(1e6 * (time.process_time() - start) / reps)
    return {side: statistics.median(times) for side, times in found.items()}


async def bench(dsn: str, args: argparse.Namespace) -> tuple[Result, float, dict[str, float]]:
    sides = ("hidden", "api") if args.no_sdk else ("hidden", "api", "sdk0")
    ours = await PostgresRuntime.connect(dsn)
    try:
        await ours.init_schema()
        agent = build(ours)

        async def batch(side: str, tag: str, runs: int) -> tuple[float, float, float]:
            use(side)
            return await run_batch(agent, tag, runs, traced_run)

        result = await take_turns({side: functools.partial(batch, side) for side in sides},
                                  args.runs, args.rounds, args.chunk, uuid.uuid4().hex[:6])
        steps = ours.stats.steps_executed / ((args.rounds + 1) * args.runs * len(sides))
        if steps < 5:  # 3 model calls and 2 tool calls a run at least
            raise AssertionError(f"the runs journaled only {steps:.1f} steps each")
        if args.profile:
            use("api")
            profiler = cProfile.Profile(time.process_time)
            profiler.enable()
            await run_batch(agent, "profile", args.runs, traced_run)
            profiler.disable()
            profiler.dump_stats(args.profile)
    finally:
        await ours.aclose()
        use("api")
    return result, steps, time_hooks(sides, round(steps), args.reps)


def report(result: Result, steps: float, hooks: dict[str, float], reps: int) -> list[str]:
    out: list[str] = []
    p = out.append
    sides, base = result.sides, result.sides[0]
    others = sides[1:]
    p(f"process CPU per run, {result.runs} runs per side and round, in ms "
      f"({steps:.0f} journaled steps a run)")
    p(f"   {'round':<6}{'order':<20}" + "".join(f"{side:>10}" for side in sides)
      + "".join(f"{side + '/' + base:>14}" for side in others))
    for r, order in enumerate(result.orders):
        p(f"   {r + 1:<6}{','.join(order):<20}"
          + "".join(f"{result.cpu_ms[side][r]:>10.3f}" for side in sides)
          + "".join(f"{result.ratios(side, base)[r]:>13.4f}x" for side in others))
    med = {side: statistics.median(result.cpu_ms[side]) for side in sides}
    ratio = {side: statistics.median(result.ratios(side, base)) for side in others}
    p(f"   {'median':<26}" + "".join(f"{med[side]:>10.3f}" for side in sides)
      + "".join(f"{ratio[side]:>13.4f}x" for side in others))
    p("")
    p(f"hooks alone, one run's worth ({steps:.0f} executed steps), {reps:,} repetitions: "
      f"µs of CPU per run, and as a share of {base}'s {med[base]:.3f} ms a run")
    for side in sides:
        extra = hooks[side] - hooks[base]
        p(f"   {DESCRIBED[side]:<22}{hooks[side]:>8.2f} µs  {hooks[side] / med[base] / 10:>6.2f}%"
          + ("" if side == base else
             f"   (+{extra:.2f} µs over {base}: {extra / med[base] / 10:.2f}%)"))
    p("")
    for side in others:
        single = result.ratios(side, base)
        p(f"summary: {DESCRIBED[side]} {med[side]:.3f} ms against {DESCRIBED[base]} "
          f"{med[base]:.3f} ms of CPU per run -> {ratio[side]:.4f}x (single rounds "
          f"{min(single):.4f}-{max(single):.4f}x)")
    if "api" in others:
        p("target: (ii) within 1% of (i): " + verdict(
            ratio["api"], result.ratios("api", base),
            (hooks["api"] - hooks[base]) / med[base] / 1000))
    return out


def verdict(ratio: float, single: list[float], hooks_share: float) -> str:
    """Whether (ii) is within :data:`TARGET` of (i): by the whole runs when
    their median says so; else, when single rounds fall on both sides of the
    target (the machine's noise is larger than what is measured), by what the
    hooks alone cost more, as a share of a run."""
    if ratio - 1 <= TARGET:
        return f"met by the whole runs ({ratio:.4f}x)"
    hooks = f"the hooks alone cost {hooks_share:+.2%} of a run"
    if min(single) - 1 <= TARGET:
        return (f"{'met' if hooks_share <= TARGET else 'MISSED'}: {hooks}; the whole runs' "
                f"{ratio:.4f}x is within their noise (single rounds {min(single):.4f}-"
                f"{max(single):.4f}x)")
    return f"MISSED: every round above it ({min(single):.4f}-{max(single):.4f}x); {hooks}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    turn_arguments(parser, chunk=3)  # finer turns: a tighter spread than 30's
    parser.add_argument("--reps", type=int, default=20_000,
                        help="repetitions of the hooks alone per side and round (default 20000)")
    parser.add_argument("--no-sdk", action="store_true",
                        help="leave out the side with the SDK sampling nothing")
    parser.add_argument("--profile", metavar="FILE",
                        help="profile one more batch of the API side with cProfile into FILE")
    args = parser.parse_args(argv)
    if min(args.runs, args.rounds, args.chunk, args.reps) < 1:
        parser.error("--runs, --rounds, --chunk and --reps must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    printed: Callable[..., None] = functools.partial(print, flush=True)
    with scratch_database() as dsn:
        printed(f"scratch database {describe(dsn)}; python {platform.python_version()}, "
                f"opentelemetry-api {version('opentelemetry-api')}, opentelemetry-sdk "
                f"{version('opentelemetry-sdk')}, loomflow {version('loomflow')}, "
                f"{os.cpu_count()} CPUs; --runs {args.runs} --rounds {args.rounds} "
                f"--chunk {args.chunk} --reps {args.reps}")
        result, steps, hooks = anyio.run(bench, dsn, args)
        printed("\n".join(report(result, steps, hooks, args.reps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
