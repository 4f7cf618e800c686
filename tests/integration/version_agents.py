"""An agent a deploy changes, for the tests of agent versions: which
deploy a worker runs is its environment's.

- ``TEST_AGENT_VERSION``: "1" (before the deploy) or "2" (after it).
- ``TEST_AGENT_CHANGE``: what version 2 changes: "tool" (its instructions
  say "in cents" and every tool call it asks for carries other arguments,
  as a tool that gained an argument would) or "instructions" (its
  instructions only).
- ``TEST_MODEL_CALLS``: a file each model call appends a line to (the
  version, then the first line of the request's prompt), before it answers.
- ``TEST_TOOL_SLEEP``, ``TEST_ENTRIES_FILE``: as in agents_fixture (the
  tool is the effects log's ``record``, the orders' charge).
"""

from __future__ import annotations

import os
from typing import Any

from loomflow import Agent
from loomflow.core.types import Role

from loomflow_worker import NoMemory, register_agent
from loomflow_worker.tasks import settings
from loomflow_worker.testing import DeterministicModel, EffectsLog

VERSION = os.environ.get("TEST_AGENT_VERSION", "1")
CHANGE = os.environ.get("TEST_AGENT_CHANGE", "tool")


class CentsModel(DeterministicModel):
    """Version 2's model: each tool call it asks for carries other arguments."""

    def reply(self, messages: list[Any]) -> tuple[str, list[Any]]:
        text, tool_calls = super().reply(messages)
        return text, [c.model_copy(update={"args": {**c.args, "tag": f"{c.args['tag']}-cents"}})
                      for c in tool_calls]


async def _count_call(messages: list[Any]) -> None:
    path = os.environ.get("TEST_MODEL_CALLS")
    if path is None:
        return
    prompt = next((m.content for m in messages if m.role == Role.USER), "")
    with open(path, "a") as f:
        f.write(f"{VERSION}\t{prompt.splitlines()[0] if prompt else ''}\n")


@register_agent("deploy", version=os.environ.get("TEST_DECLARED_VERSION"),
                fairness_key=os.environ.get("TEST_FAIRNESS_KEY"),
                on_version_gone=os.environ.get("TEST_ON_VERSION_GONE", "wait"),
                grace=float(os.environ.get("TEST_GRACE", "600")))
def build(runtime: Any) -> Agent:
    changed = VERSION == "2"
    model_class = CentsModel if changed and CHANGE == "tool" else DeterministicModel
    return Agent(
        "charge each order in cents" if changed else "charge each order",
        model=model_class(on_call=_count_call),
        tools=[EffectsLog(settings().database_url.get_secret_value(),
                          sleep=float(os.environ.get("TEST_TOOL_SLEEP", "0")),
                          entries=os.environ.get("TEST_ENTRIES_FILE")).tool()],
        runtime=runtime,
        memory=NoMemory(),
        auto_extract=False,
    )
