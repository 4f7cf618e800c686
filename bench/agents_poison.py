"""The agent ``bench_poison.py``'s workers run: a slow DeterministicModel and a slow tool.

Every model call waits ``BENCH_MODEL_LATENCY`` seconds (``--latency``) and every tool call
``BENCH_TOOL_SLEEP`` seconds (``--tool-sleep``), so a run of three tool calls takes four model
calls and three tool calls. A tool call whose tag starts with ``poison`` SIGKILLs the process
it runs in, on every attempt, as ``tests/integration/agents_fixture.py``'s does: in a
threads-pool worker that is the worker's main process, with every run it carries; in a process
of quarantine, only the requests that run there.

The tool records nothing: :class:`loomflow_worker.testing.EffectsLog` opens two Postgres
connections per call, and hundreds of runs calling their tool at the same moment would take
more connections than the server allows (and than the workers themselves use). Workers of ours
import this module (``LOOMFLOW_WORKER_AGENTS=bench.agents_poison``), which registers the agent
as ``default``.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import anyio
from loomflow import Agent, tool
from loomflow.tools import Tool

from loomflow_worker import NoMemory, register_agent
from loomflow_worker.testing import DeterministicModel

LATENCY_ENV = "BENCH_MODEL_LATENCY"
TOOL_SLEEP_ENV = "BENCH_TOOL_SLEEP"
POISON = "poison"


def calls(*tags: str) -> str:
    """A prompt asking for one ``record`` call per tag, one after the other."""
    return "\n".join(f"call record {json.dumps({'tag': t})}" for t in tags)


def record_tool(sleep: float) -> Tool:
    async def record(tag: str) -> str:
        """Record a side effect tagged ``tag`` (here: wait, or kill the process)."""
        if tag.startswith(POISON):
            os.kill(os.getpid(), signal.SIGKILL)
        if sleep:
            await anyio.sleep(sleep)
        return f"recorded {tag}"

    return tool(name="record", description="Record a side effect.")(record)


@register_agent()
def build_agent(runtime: Any) -> Agent:
    return Agent(
        "poison bench agent",
        model=DeterministicModel(latency=float(os.environ.get(LATENCY_ENV, "0") or 0)),
        tools=[record_tool(float(os.environ.get(TOOL_SLEEP_ENV, "0") or 0))],
        runtime=runtime,
        memory=NoMemory(),
        auto_extract=False,
    )
