"""One loomflow agent in a process of its own, for the multi-process tests.

Run from the project root::

    python -m tests.integration.proc_agent --dsn DSN --session S --user U \
        --prompt P [--prompt P2 ...] [--sleep 0.2] [--crash-tag t3] [--wait-go]

It connects a :class:`PostgresRuntime`, builds an agent with a
:class:`DeterministicModel` and the :class:`EffectsLog` tool, and runs each
``--prompt`` in turn on the same session and user. It reports on stdout,
one line per event, each ``EVENT_PREFIX`` followed by a JSON object:

- ``{"event": "ready", "pid": ...}`` once connected; with ``--wait-go`` it
  then waits for a line on stdin before the first run (a start barrier);
- ``{"event": "run", ...}`` after each run: its output, the epoch the run
  opened at, the model calls it made, the steps it executed and replayed,
  and when it was asked for and when it returned (``time.time()``);
- ``{"event": "killing", "tag": ..., "at": ...}`` right before the process
  sends itself SIGKILL, when the tool starts on ``--crash-tag``;
- ``{"event": "done"}`` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

import anyio
import anyio.to_thread
from loomflow import Agent

from loomflow_worker.runtime import Lease, PostgresRuntime, run_options
from loomflow_worker.testing import DeterministicModel, EffectsLog

EVENT_PREFIX = "LFW-EVENT "


def emit(event: str, **fields: Any) -> None:
    print(EVENT_PREFIX + json.dumps({"event": event, **fields}), flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="proc_agent")
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--session", required=True)
    parser.add_argument("--user", required=True)
    parser.add_argument("--prompt", action="append", required=True)
    parser.add_argument("--sleep", type=float, default=0.0, help="tool duration, seconds")
    parser.add_argument("--crash-tag", default=None, help="SIGKILL self when this tag starts")
    parser.add_argument("--lock-wait", type=float, default=60.0)
    parser.add_argument("--wait-go", action="store_true", help="wait for a stdin line first")
    return parser.parse_args(argv)


async def main(args: argparse.Namespace) -> None:
    crash_tag: str | None = args.crash_tag

    async def on_start(tag: str) -> None:
        if tag == crash_tag:
            emit("killing", tag=tag, at=time.time())
            os.kill(os.getpid(), signal.SIGKILL)

    effects = EffectsLog(args.dsn, sleep=args.sleep, on_start=on_start)
    model = DeterministicModel()
    runtime = await PostgresRuntime.connect(args.dsn, lock_wait_timeout=args.lock_wait)
    try:
        agent = Agent(
            "proc", model=model, tools=[effects.tool()], runtime=runtime, auto_extract=False
        )
        emit("ready", pid=os.getpid())
        if args.wait_go:
            await anyio.to_thread.run_sync(sys.stdin.readline)
        for index, prompt in enumerate(args.prompt):
            opened: list[int] = []

            async def on_open(attempt: Lease, epoch: int, opened: list[int] = opened) -> None:
                opened.append(epoch)

            calls, executed, replayed = (
                model.calls,
                runtime.stats.steps_executed,
                runtime.stats.steps_replayed,
            )
            asked = time.time()
            with run_options(on_open=on_open):
                result = await agent.run(prompt, session_id=args.session, user_id=args.user)
            emit(
                "run",
                index=index,
                output=result.output,
                epochs=opened,
                model_calls=model.calls - calls,
                steps_executed=runtime.stats.steps_executed - executed,
                steps_replayed=runtime.stats.steps_replayed - replayed,
                asked=asked,
                returned=time.time(),
            )
        emit("done")
    finally:
        await runtime.aclose()


if __name__ == "__main__":
    anyio.run(main, parse_args())
