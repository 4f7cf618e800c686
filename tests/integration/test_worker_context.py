"""What a pool child says about the agents it builds, and of itself in ``workers``."""

from __future__ import annotations

import logging
import os
from typing import Any

import psycopg
import pytest
import redis.asyncio as aredis
from loomflow import Agent
from loomflow.memory import HashEmbedder
from loomflow.memory.redis import RedisMemory

from loomflow_worker import register_agent
from loomflow_worker.settings import Settings
from loomflow_worker.testing import DeterministicModel
from loomflow_worker.worker.context import WorkerContext
from tests.needs import REDIS_URL
from tests.waiting import wait_until_async

pytestmark = pytest.mark.anyio


@register_agent("test-memory-per-process")
def _per_process(runtime: Any) -> Agent:
    return Agent("a", model=DeterministicModel(), runtime=runtime, auto_extract=False)


@register_agent("test-memory-shared")
def _shared(runtime: Any) -> Agent:
    memory = RedisMemory(
        aredis.Redis.from_url(REDIS_URL), embedder=HashEmbedder()
    )
    return Agent("a", model=DeterministicModel(), runtime=runtime, memory=memory,
                 auto_extract=False)


async def test_an_agent_with_process_local_memory_is_warned_about_once(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    ctx = WorkerContext(Settings(database_url=dsn, events=False))  # type: ignore[arg-type]
    try:
        with caplog.at_level(logging.WARNING, logger="loomflow_worker.worker.agents"):
            await ctx.agent("test-memory-per-process")
            await ctx.agent("test-memory-per-process")
            await ctx.agent("test-memory-shared")
    finally:
        await ctx.aclose()
    warned = [r for r in caplog.records if "keeps its memory in this process" in r.getMessage()]
    assert [r.getMessage().split("'")[1] for r in warned] == ["test-memory-per-process"]


async def _worker_row(dsn: str, worker: str) -> tuple[int, int, bool, bool] | None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT pid, runs, seen_at > now() - interval '5 seconds', stopped_at IS NOT NULL "
            "FROM workers WHERE worker = %s", (worker,))
        row = await cur.fetchone()
    return None if row is None else (row[0], row[1], row[2], row[3])


async def test_an_idle_process_stamps_its_row_and_marks_it_stopped_when_it_closes(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(database_url=dsn, events=False, heartbeat_interval=0.2)  # type: ignore[arg-type]
    ctx = WorkerContext(settings, slots=3, node="n1@host")
    assert ctx.worker == f"n1@host:{os.getpid()}"
    stamps = [0]
    stamp = ctx.heart._stamp

    async def counted(runtime: Any, *, stopped: bool) -> None:
        stamps[0] += 1
        await stamp(runtime, stopped=stopped)

    ctx.heart._stamp = counted  # type: ignore[method-assign]
    try:
        await ctx.runtime()
        row = await wait_until_async(lambda: _worker_row(dsn, ctx.worker), "its first stamp", 10)
        assert row == (os.getpid(), 0, True, False)
        # The table gone (a failing stamp): logged once, and the process goes on.
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute("ALTER TABLE workers RENAME TO workers_away")
        with caplog.at_level(logging.WARNING, logger="loomflow_worker.worker.heart"):
            failing = stamps[0] + 3
            async def stamped() -> int:
                return stamps[0]

            await wait_until_async(stamped, f"stamp {failing + 1} (three failing)", 10,
                                   until=lambda count: count > failing)
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute("ALTER TABLE workers_away RENAME TO workers")
        warned = [r for r in caplog.records if "could not stamp" in r.getMessage()]
        assert len(warned) == 1
        assert ctx.heart._presence is not None and not ctx.heart._presence.done()
    finally:
        await ctx.aclose()
    assert await _worker_row(dsn, ctx.worker) == (os.getpid(), 0, True, True)
