"""The agent both sides of ``bench_celery.py`` run: DeterministicModel and one pure tool.

Workers of ours import this module (``LOOMFLOW_WORKER_AGENTS=bench.agents_bench``), which
registers the agent as ``default``; the plain Celery app (``bench/plain_celery_app.py``)
calls :func:`build_agent` itself. The tool does no I/O and does not sleep, so what is measured
is the cost of the framework around the run: the broker, the journal, the ledger.

With ``BENCH_MODEL_LATENCY`` set (seconds), every model call first waits that long, as a
real model does (``bench_concurrency.py``): the run is then IO-bound, not CPU-bound.
"""

from __future__ import annotations

import json
import os
from typing import Any

from loomflow import Agent, tool
from loomflow.tools import Tool

from loomflow_worker import NoMemory, register_agent
from loomflow_worker.testing import DeterministicModel


def calls(*tags: str) -> str:
    """A prompt asking for one ``record`` call per tag, one after the other."""
    return "\n".join(f"call record {json.dumps({'tag': t})}" for t in tags)


def expected_output(*tags: str) -> str:
    return "done: " + ", ".join(f"recorded {t}" for t in tags)


def record_tool() -> Tool:
    async def record(tag: str) -> str:
        """Record a side effect tagged ``tag`` (here: nothing, at once)."""
        return f"recorded {tag}"

    return tool(name="record", description="Record a side effect.")(record)


def bench_model() -> DeterministicModel:
    latency = float(os.environ.get("BENCH_MODEL_LATENCY", "0") or 0)
    return DeterministicModel(latency=latency)


@register_agent()
def build_agent(runtime: Any) -> Agent:
    # NoMemory: loomflow's default memory keeps every episode of the process and
    # each recall scans them all, so its cost per run would grow with the runs a
    # benchmark has made (and a fleet needs a memory its workers share anyway).
    return Agent(
        "bench agent",
        model=bench_model(),
        tools=[record_tool()],
        runtime=runtime,
        memory=NoMemory(),
        auto_extract=False,
    )


@register_agent("claude")
def build_claude(runtime: Any) -> Agent:
    """loomflow's real AnthropicModel, pointed by ANTHROPIC_BASE_URL at a local
    Messages API (``bench_model_limits.py``)."""
    from loomflow.model.anthropic import AnthropicModel

    return Agent(
        "bench agent",
        model=AnthropicModel("claude-sonnet-4-6", api_key=os.environ.get("ANTHROPIC_API_KEY"),
                             request_timeout_s=30),
        tools=[record_tool()],
        runtime=runtime,
        memory=NoMemory(),
        auto_extract=False,
    )
