"""Agents for the CLI tests: their tool waits for a durable signal."""

from __future__ import annotations

import json
from typing import Any

from loomflow import Agent, tool

from loomflow_worker import register_agent
from loomflow_worker.testing import DeterministicModel


def _signal_agent(runtime: Any, timeout_s: float | None) -> Agent:
    async def wait_signal(session: str, name: str) -> str:
        """Wait for the signal ``name`` sent to ``session`` and return its payload."""
        payload = await runtime.wait_for_signal(session, name, timeout_s=timeout_s)
        return "got " + json.dumps(payload, sort_keys=True)

    return Agent(
        "an agent that waits for a signal",
        model=DeterministicModel(),
        tools=[tool(name="wait_signal", description="Wait for a signal.")(wait_signal)],
        runtime=runtime,
        auto_extract=False,
    )


@register_agent("waiter")
def build_waiter(runtime: Any) -> Agent:
    """Waits a minute at most."""
    return _signal_agent(runtime, 60)


@register_agent("approver")
def build_approver(runtime: Any) -> Agent:
    """Waits for an approval as long as it takes."""
    return _signal_agent(runtime, None)
