"""The agent both sides of ``bench_recovery.py`` run: DeterministicModel and a slow tool.

The tool is :class:`loomflow_worker.testing.EffectsLog`: every execution is recorded in the
side's database (``BENCH_RECOVERY_EFFECTS_DSN``) with the pool child's pid and its start time,
then sleeps ``TEST_TOOL_SLEEP`` seconds. Workers of ours import this module
(``LOOMFLOW_WORKER_AGENTS=bench.agents_recovery``), which registers the agent as ``default``;
the plain app (``bench/plain_recovery_app.py``) builds it with :func:`build_agent`.
"""

from __future__ import annotations

import os
from typing import Any

from loomflow import Agent

from loomflow_worker import register_agent
from loomflow_worker.testing import DeterministicModel, EffectsLog

EFFECTS_DSN_ENV = "BENCH_RECOVERY_EFFECTS_DSN"
TOOL_SLEEP_ENV = "TEST_TOOL_SLEEP"


@register_agent()
def build_agent(runtime: Any) -> Agent:
    effects = EffectsLog(
        os.environ[EFFECTS_DSN_ENV], sleep=float(os.environ.get(TOOL_SLEEP_ENV, "0"))
    )
    return Agent(
        "recovery bench agent",
        model=DeterministicModel(),
        tools=[effects.tool()],
        runtime=runtime,
        auto_extract=False,
    )
