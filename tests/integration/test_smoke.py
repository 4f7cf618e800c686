from __future__ import annotations

import pytest
from loomflow import Agent

from loomflow_worker.runtime import PostgresRuntime
from loomflow_worker.testing import DeterministicModel, EffectsLog

pytestmark = pytest.mark.anyio


async def test_smoke(runtime: PostgresRuntime, dsn: str) -> None:
    effects = EffectsLog(dsn)
    model = DeterministicModel()
    agent = Agent("t", model=model, tools=[effects.tool()], runtime=runtime, auto_extract=False)
    prompt = 'call record {"tag": "a"}\ncall record {"tag": "b"} && record {"tag": "c"}'
    result = await agent.run(prompt, session_id="s1", user_id="u1")
    assert result.output == "done: recorded a, recorded b, recorded c"
    assert await effects.counts() == {"a": 1, "b": 1, "c": 1}
    print(runtime.stats)
