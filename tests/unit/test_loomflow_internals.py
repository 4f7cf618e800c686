"""The loomflow internals the runtime relies on. When loomflow moves one of
these, this file fails first and says which."""

from __future__ import annotations

import inspect

import loomflow
from loomflow.runtime import _codec, journaled
from loomflow.runtime.journal import journal_scope


def test_loomflow_is_the_pinned_series() -> None:
    assert loomflow.__version__.startswith("0.20."), loomflow.__version__


def test_private_names_the_runtime_uses_are_still_there() -> None:
    for name in (
        "_current_session_var",
        "_open_run_var",
        "_OpenRun",
        "_resume_last_run_var",
        "_step_key",
        "EPOCH_KEY",
        "LAST_RUN_KEY",
    ):
        assert hasattr(journaled, name), f"loomflow.runtime.journaled.{name} is gone"
    assert journaled.EPOCH_KEY == "__run_epoch__"
    assert journaled.LAST_RUN_KEY == "__last_run_epoch__"
    for method in ("_enter", "_run", "_run_key", "session", "step", "stream_step"):
        assert hasattr(journaled.JournaledRuntime, method), method


def test_open_run_keeps_its_shape() -> None:
    params = inspect.signature(journaled._OpenRun.__init__).parameters
    assert list(params)[:5] == ["self", "scope", "session_id", "ns", "parent"]
    assert {"epoch", "next_epoch", "container"} <= set(params)
    run = journaled._OpenRun("scope", "s", "3", None, epoch=3, next_epoch=3)
    assert (run.touched, run.children, run.container) == (False, {}, False)


def test_step_keys_keep_their_layout() -> None:
    assert journaled._step_key("n", (), {}, "tool_call_1_0:abc") == "idem:tool_call_1_0:abc"
    key = journaled._step_key("model_call_1", (1,), {"a": 2})
    name, _, digest = key.partition("@")
    assert name == "model_call_1" and len(digest) == 16


def test_codec_and_scope_layout() -> None:
    assert _codec.dumps(3) == b"LJ13"
    assert _codec.loads(_codec.dumps({"a": (1, 2)})) == {"a": (1, 2)}
    assert journal_scope("s", None) == "s"
    assert journal_scope("s", "u") == "user:1:u:s"


def test_an_agent_keeps_its_memory_where_the_worker_looks_for_it() -> None:
    # The worker warns about process-local memory by looking at Agent._memory.
    from loomflow import Agent
    from loomflow.memory.inmemory import InMemoryMemory

    from loomflow_worker.testing import DeterministicModel

    agent = Agent("a", model=DeterministicModel(), auto_extract=False)
    assert isinstance(agent._memory, InMemoryMemory)


def test_an_agents_definition_is_where_its_version_reads_it() -> None:
    """The attributes ``execution.versions`` digests: gone, every version
    would be the same and a changed agent would replay as the old one."""
    from loomflow import Agent

    from loomflow_worker.testing import DeterministicModel

    agent = Agent("instructions", model=DeterministicModel(), effort="low", auto_extract=False)
    assert agent._instructions == "instructions"
    assert isinstance(agent._model, DeterministicModel)
    assert isinstance(agent._tool_host._tools, dict)
    for name in ("_architecture", "_default_output_schema", "_strict_effort", "_max_turns"):
        assert hasattr(agent, name), f"Agent.{name} is gone"
    assert agent._default_effort == "low"


def test_a_workflow_keeps_its_nodes_and_takes_no_emit() -> None:
    """The worker finds a Workflow's agent nodes in ``_raw_nodes`` (to pace
    them and version the workflow) and runs it without ``emit``, inside the
    request's own run, under which its container nests."""
    from loomflow import Agent, Workflow

    from loomflow_worker.testing import DeterministicModel

    node = Agent("a node", model=DeterministicModel(), auto_extract=False)
    flow = Workflow("w").add_node("n", node)
    assert flow._raw_nodes == {"n": node}
    assert "emit" not in inspect.signature(Workflow.run).parameters
    assert {"user_id", "session_id", "metadata"} <= set(
        inspect.signature(Workflow.run).parameters)
    assert "parent = _open_run_var.get()" in inspect.getsource(journaled.journal_container)
