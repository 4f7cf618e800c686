"""A Workflow and a Team built by register_agent factories (workers started
with LOOMFLOW_WORKER_AGENTS=tests.integration.flow_agents): each runs as a
request, its nested agent runs journaled under it."""

from __future__ import annotations

import os
import re
from typing import Any

from loomflow import Agent, Workflow
from loomflow.team import Team
from loomflow.workflow import END, START

from loomflow_worker import NoMemory, register_agent
from loomflow_worker.tasks import settings
from loomflow_worker.testing import DeterministicModel, EffectsLog


def _agent(runtime: Any, instructions: str) -> Agent:
    effects = EffectsLog(settings().database_url.get_secret_value(),
                         sleep=float(os.environ.get("TEST_TOOL_SLEEP", "0")))
    return Agent(instructions, model=DeterministicModel(), tools=[effects.tool()],
                 runtime=runtime, memory=NoMemory(), auto_extract=False)


def checks_of(output: str) -> str:
    """The second node's prompt: check each tag the first recorded."""
    return "\n".join(f'call record {{"tag": "{tag}-checked"}}'
                     for tag in re.findall(r"recorded (\S+?)(?:,|$)", output))


@register_agent("flow")
def build_flow(runtime: Any) -> Workflow:
    flow = Workflow("record-then-check")
    flow.add_node("record", _agent(runtime, "records"))
    flow.add_node("plan_checks", checks_of)
    flow.add_node("check", _agent(runtime, "checks"))
    flow.add_edge(START, "record").add_edge("record", "plan_checks")
    flow.add_edge("plan_checks", "check").add_edge("check", END)
    return flow


@register_agent("team")
def build_team(runtime: Any) -> Agent:
    return Team.supervisor({"scribe": _agent(runtime, "records what it is told")},
                           instructions="delegates the recording", model=DeterministicModel(),
                           runtime=runtime, memory=NoMemory(), auto_extract=False)
