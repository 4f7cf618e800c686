"""An agent for the CLI tests: its tool waits for a durable signal."""

from __future__ import annotations

import json
from typing import Any

from loomflow import Agent, tool

from loomflow_worker import register_agent
from loomflow_worker.testing import DeterministicModel


@register_agent("waiter")
def build_waiter(runtime: Any) -> Agent:
    async def wait_signal(session: str, name: str) -> str:
        """Wait for the signal ``name`` sent to ``session`` and return its payload."""
        payload = await runtime.wait_for_signal(session, name, timeout_s=60)
        return "got " + json.dumps(payload, sort_keys=True)

    return Agent(
        "an agent that waits for a signal",
        model=DeterministicModel(),
        tools=[tool(name="wait_signal", description="Wait for a signal.")(wait_signal)],
        runtime=runtime,
        auto_extract=False,
    )
