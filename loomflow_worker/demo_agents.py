"""The agent of ``loomflow-worker demo``: a trip planner with side effects.

It uses the offline deterministic test model unless ``ANTHROPIC_API_KEY`` is
set, when it asks a real Claude model. Its one tool records a side effect in
Postgres, so the demo can show that each happened once."""

from __future__ import annotations

import os
from typing import Any

from loomflow import Agent

from .execution.registry import register_agent
from .memory import NoMemory
from .tasks import settings
from .testing import DeterministicModel, EffectsLog

CLAUDE = "claude-sonnet-4-6"


def tool_sleep() -> float:
    return float(os.environ.get("LOOMFLOW_WORKER_DEMO_TOOL_SLEEP", "0.8"))


@register_agent("demo")
def build(runtime: Any) -> Agent:
    effects = EffectsLog(settings().database_url.get_secret_value(), sleep=tool_sleep())
    model: Any = CLAUDE if os.environ.get("ANTHROPIC_API_KEY") else DeterministicModel()
    return Agent(
        "You plan trips. For every step of the plan, call the record tool once with that "
        "step's tag, one call at a time, then say which steps you recorded.",
        model=model,
        tools=[effects.tool()],
        runtime=runtime,
        # Each request carries all it needs: no memory, so a run's inputs are
        # the same on every worker and a resumed run replays its model calls.
        memory=NoMemory(),
        auto_extract=False,
    )
