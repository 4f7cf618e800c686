"""An agent's version: the same definition gives the same version in any
process, and any change that could change a replay gives another."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from loomflow import Agent, tool
from pydantic import BaseModel

from loomflow_worker import register_agent
from loomflow_worker.execution.versions import agent_version, check_version, describe_agent
from loomflow_worker.runtime.errors import InvalidInput
from loomflow_worker.testing import DeterministicModel

ROOT = Path(__file__).resolve().parents[2]


@tool(name="charge", description="Charge an order.")
async def charge(order: int) -> str:
    return f"charged {order}"


@tool(name="charge", description="Charge an order.")
async def charge_in_cents(order: int, cents: bool) -> str:
    return f"charged {order}"


class Answer(BaseModel):
    text: str


def build(instructions: str = "charge the orders", *, tools: Any = None,
          model: Any = None, output_schema: Any = None) -> Agent:
    return Agent(instructions, model=model or DeterministicModel(),
                 tools=[charge] if tools is None else tools, output_schema=output_schema,
                 auto_extract=False)


def test_the_same_definition_gives_the_same_version() -> None:
    first, second = build(), build()
    assert agent_version(first) == agent_version(second)
    assert len(agent_version(first)) == 12
    # What a process does with its agent changes nothing: a model that has been
    # called, a latency of the environment's.
    used = DeterministicModel(latency=0.5)
    used.calls = 7
    assert agent_version(build(model=used)) == agent_version(first)


@pytest.mark.parametrize("changed", [
    lambda: build("charge the orders, in cents"),
    lambda: build(tools=[charge_in_cents]),
    lambda: build(tools=[]),
    lambda: build(model=DeterministicModel(name="other-model")),
    lambda: build(output_schema=Answer),
])
def test_any_change_that_could_change_a_replay_gives_another(changed: Any) -> None:
    assert agent_version(changed()) != agent_version(build())


def test_a_sub_agents_change_changes_its_parents_version() -> None:
    def parent(sub_instructions: str) -> Agent:
        sub = build(sub_instructions)

        @tool(name="ask_billing", description="Ask the billing agent.")
        async def ask_billing(question: str) -> str:
            return (await sub.run(question)).output

        return build("route the question", tools=[ask_billing])

    assert agent_version(parent("bill in euros")) == agent_version(parent("bill in euros"))
    assert agent_version(parent("bill in euros")) != agent_version(parent("bill in cents"))
    described = describe_agent(parent("bill in euros"))
    assert described["tools"][0]["agents"][0]["instructions"] == "bill in euros"


def test_a_workflows_version_follows_its_nodes_and_edges() -> None:
    from loomflow import Workflow

    def flow(node_instructions: str, *, checked: bool = True) -> Workflow:
        made = Workflow("orders")
        made.add_node("charge", build(node_instructions))
        made.add_node("check", build("check the charges"))
        made.set_start("charge")
        if checked:
            made.add_edge("charge", "check")
        return made

    assert agent_version(flow("charge the orders")) == agent_version(flow("charge the orders"))
    assert agent_version(flow("charge in cents")) != agent_version(flow("charge the orders"))
    assert agent_version(flow("charge the orders", checked=False)) != agent_version(
        flow("charge the orders"))
    described = describe_agent(flow("charge the orders"))
    assert described["workflow"] == "orders"
    assert described["nodes"]["charge"]["instructions"] == "charge the orders"


def test_a_declared_version_is_the_version() -> None:
    assert agent_version(build(), "2026-12-06.1") == "2026-12-06.1"
    assert agent_version(build("other"), "v3") == "v3"


@pytest.mark.parametrize("bad", ["", " v1", "v1 ", "v" * 65, "a/b", "-v1", 3, None])
def test_a_bad_declared_version_is_refused_in_one_line(bad: Any) -> None:
    with pytest.raises(InvalidInput, match="is not a version") as info:
        check_version(bad)
    assert "\n" not in str(info.value)
    if bad is not None:
        with pytest.raises(InvalidInput, match="is not a version"):
            register_agent("versioned-bad", version=bad)


_IN_ANOTHER_PROCESS = """
import json, sys
sys.path.insert(0, {root!r})
from tests.unit.test_versions import build
from loomflow_worker.execution.versions import agent_version
print(json.dumps(agent_version(build())))
"""


@pytest.mark.slow
def test_two_processes_with_other_environments_agree() -> None:
    # Another host's worth of environment: its name, its time zone, its hash seed.
    env = {**os.environ, "HOSTNAME": "other-host", "TZ": "Asia/Tokyo",
           "PYTHONHASHSEED": "12345", "LOOMFLOW_WORKER_EVENTS": "false"}
    out = subprocess.run(
        [sys.executable, "-c", _IN_ANOTHER_PROCESS.format(root=str(ROOT))],
        capture_output=True, text=True, env=env, cwd="/", timeout=60, check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == agent_version(build())


@pytest.mark.parametrize(("options", "error"), [
    ({"on_version_gone": "sometimes"},
     "on_version_gone must be one of 'wait', 'upgrade', 'cancel', not 'sometimes'"),
    ({"on_version_gone": "upgrade", "grace": 0}, "grace must be positive seconds, not 0"),
    ({"grace": "ten"}, "grace must be positive seconds, not 'ten'"),
])
def test_an_unknown_policy_for_a_gone_version_is_refused(
    options: dict[str, Any], error: str
) -> None:
    with pytest.raises(InvalidInput) as info:
        register_agent("policy-test", **options)
    assert str(info.value) == error


def test_a_version_queue_is_named_after_its_queue_agent_and_version() -> None:
    from loomflow_worker.execution.versions import queue_suffix

    assert "loomflow" + queue_suffix("deploy", "3f2a9c1b0d4e") == "loomflow@deploy@3f2a9c1b0d4e"
