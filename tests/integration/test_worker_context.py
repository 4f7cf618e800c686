"""What a pool child says about the agents it builds."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import redis.asyncio as aredis
from loomflow import Agent
from loomflow.memory import HashEmbedder
from loomflow.memory.redis import RedisMemory

from loomflow_worker import register_agent
from loomflow_worker.execution.execute import WorkerContext
from loomflow_worker.settings import Settings
from loomflow_worker.testing import DeterministicModel

pytestmark = pytest.mark.anyio


@register_agent("test-memory-per-process")
def _per_process(runtime: Any) -> Agent:
    return Agent("a", model=DeterministicModel(), runtime=runtime, auto_extract=False)


@register_agent("test-memory-shared")
def _shared(runtime: Any) -> Agent:
    memory = RedisMemory(
        aredis.Redis.from_url("redis://127.0.0.1:6379/0"), embedder=HashEmbedder()
    )
    return Agent("a", model=DeterministicModel(), runtime=runtime, memory=memory,
                 auto_extract=False)


async def test_an_agent_with_process_local_memory_is_warned_about_once(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    ctx = WorkerContext(Settings(database_url=dsn, events=False))  # type: ignore[arg-type]
    try:
        with caplog.at_level(logging.WARNING, logger="loomflow_worker.tasks"):
            await ctx.agent("test-memory-per-process")
            await ctx.agent("test-memory-per-process")
            await ctx.agent("test-memory-shared")
    finally:
        await ctx.aclose()
    warned = [r for r in caplog.records if "keeps its memory in this process" in r.getMessage()]
    assert [r.getMessage().split("'")[1] for r in warned] == ["test-memory-per-process"]
