"""An example agents module for the files in ``deploy/``.

Workers import it with ``LOOMFLOW_WORKER_AGENTS=example_agents`` (the image puts it on
``PYTHONPATH``). It registers the agent ``default`` with two tools.

- Without ``ANTHROPIC_API_KEY`` (unset or empty) the agent runs on
  :class:`loomflow_worker.testing.DeterministicModel`: no network, no cost, and the reply is
  a function of the prompt, one tool turn a line. Try the stack end to end with::

      run_agent.delay('call utc_now {}\\ncall word_count {"text": "a b c"}', "demo-1")

  which calls ``utc_now``, then ``word_count``, then answers ``done: <outputs>``.
- With ``ANTHROPIC_API_KEY`` set it runs on Claude (``claude-sonnet-4-6``, loomflow's model
  string; the image installs the ``anthropic`` SDK).

Your own module looks the same: build the agent inside the factory (workers call it once per
pool child, inside its event loop, with the runtime they own) and open no connections at
import.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from loomflow import Agent, tool
from loomflow.tools import Tool

from loomflow_worker import NoMemory, register_agent
from loomflow_worker.testing import DeterministicModel

CLAUDE_MODEL = "claude-sonnet-4-6"

INSTRUCTIONS = (
    "You are a concise assistant. Use utc_now when the answer depends on the current date or "
    "time, and word_count to count the words of a text."
)


def _utc_now() -> str:
    """The current date and time in UTC, ISO 8601.

    A tool's result is journaled when it completes, so a run that resumes after a crash sees
    the time it saw the first time, not a new one."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def _word_count(text: str) -> str:
    """How many whitespace-separated words ``text`` has."""
    return str(len(text.split()))


def tools() -> list[Tool | Callable[..., object]]:
    return [
        tool(name="utc_now", description="The current date and time in UTC (ISO 8601).")(
            _utc_now
        ),
        tool(name="word_count", description="Count the words of a text.")(_word_count),
    ]


def model() -> Any:
    """Claude when an Anthropic key is configured, else the deterministic stand-in."""
    if os.environ.get("ANTHROPIC_API_KEY", "").strip():
        return CLAUDE_MODEL
    return DeterministicModel()


@register_agent()
def build(runtime: Any) -> Agent:
    return Agent(
        INSTRUCTIONS,
        model=model(),
        tools=tools(),
        runtime=runtime,
        # No history across requests: a run's inputs are the same on every
        # worker. For history, give it a memory every worker shares (loomflow's
        # PostgresMemory or RedisMemory); loomflow's default lives in one process.
        memory=NoMemory(),
        auto_extract=False,
    )
