"""The fleet's model-call schedule in Postgres, and a paced model against the
local Messages API: bookings, token charges, a provider's pause."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator

import anyio
import pytest
from loomflow.core.types import Message
from loomflow.model.anthropic import AnthropicModel
from psycopg_pool import AsyncConnectionPool

from loomflow_worker.execution.pacing import Budgets, PacedModel
from loomflow_worker.runtime.sql import query

from .messages_api import API_KEY, MODEL, MessagesAPI, serving

pytestmark = pytest.mark.anyio


@pytest.fixture
async def pool(dsn: str) -> AsyncIterator[AsyncConnectionPool]:
    async with AsyncConnectionPool(dsn, min_size=1, max_size=2, open=False,
                                   kwargs={"autocommit": True}) as opened:
        yield opened


async def _limit(pool: AsyncConnectionPool, key: str, rpm: int | None, tpm: int | None,
                 burst: float = 0.0) -> None:
    async with pool.connection() as conn:
        await conn.execute(query("set_model_limits"),
                           {"key": key, "rpm": rpm, "tpm": tpm, "burst": burst})


async def test_calls_of_a_limited_key_are_booked_a_share_of_the_minute_apart(
    pool: AsyncConnectionPool,
) -> None:
    await _limit(pool, "k", 120, None)  # one call each half second
    waits = [await Budgets(pool).take("k", 10) for _ in range(5)]
    for booked, expected in zip(waits, [0.0, 0.5, 1.0, 1.5, 2.0], strict=True):
        assert abs(booked - expected) < 0.2, waits


async def test_a_burst_of_a_keys_budget_goes_at_once_after_a_quiet_spell(
    pool: AsyncConnectionPool,
) -> None:
    await _limit(pool, "k", 120, None, burst=1.0)  # two calls' worth at once
    waits = [await Budgets(pool).take("k", 10) for _ in range(4)]
    for booked, expected in zip(waits, [0.0, 0.0, 0.5, 1.0], strict=True):
        assert abs(booked - expected) < 0.2, waits


async def test_calls_booked_at_once_by_a_new_process_all_wait_their_turn(
    pool: AsyncConnectionPool,
) -> None:
    await _limit(pool, "k", 120, None)
    budgets = Budgets(pool)
    waits: list[float] = []

    async def take() -> None:
        waits.append(await budgets.take("k", 10))

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(take)
    for booked, expected in zip(sorted(waits), [0.0, 0.5, 1.0, 1.5], strict=True):
        assert abs(booked - expected) < 0.2, waits


async def test_a_token_budget_books_each_call_by_its_tokens_and_charges_what_it_used(
    pool: AsyncConnectionPool,
) -> None:
    await _limit(pool, "k", None, 6000)  # 100 tokens a second
    budgets = Budgets(pool)
    assert await budgets.take("k", 100) < 0.1
    assert abs(await budgets.take("k", 100) - 1.0) < 0.2
    # The second call used 300 tokens, not 100: the next waits two seconds more.
    await budgets.charge("k", 200)
    assert abs(await budgets.take("k", 100) - 4.0) < 0.2


async def test_a_key_with_no_limit_books_nothing_until_its_provider_asks_for_a_pause(
    pool: AsyncConnectionPool,
) -> None:
    budgets, other = Budgets(pool), Budgets(pool)
    assert await budgets.take("free", 10) == 0.0
    await budgets.pause("free", 2.0)
    # Every process sees the pause (from the table, once it reads it again).
    assert 1.5 < await other.take("free", 10) <= 2.0
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT rpm, tpm FROM model_budgets WHERE key = 'free'")
        assert await cur.fetchall() == [(None, None)]


@pytest.fixture
def api() -> Iterator[MessagesAPI]:
    with serving() as server:
        yield server


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_paced_model_waits_out_a_529_and_a_429_then_answers(
    pool: AsyncConnectionPool, api: MessagesAPI, monkeypatch: pytest.MonkeyPatch, streamed: bool
) -> None:
    monkeypatch.setenv("ANTHROPIC_BASE_URL", api.url)
    # One 529 (no retry-after: a backoff of 0.5 to 1 s), then the key's one
    # request a second is spent: 429 with retry-after 1.
    api.overloaded, api.per_window, api.window = 1, 1, 1.0
    inner = AnthropicModel(MODEL, api_key=API_KEY, request_timeout_s=10)
    model = PacedModel(inner, "anthropic", Budgets(pool))
    messages = [Message(role="user", content="hello")]
    try:
        started = time.monotonic()
        for _ in range(2):
            if streamed:
                chunks = [chunk async for chunk in model.stream(messages)]
                assert chunks[-1].kind == "finish"
            else:
                text, _, usage, _ = await model.complete(messages)
                assert text.startswith("done")
                assert usage.input_tokens > 0
        assert time.monotonic() - started >= 1.0
    finally:
        await inner._client.close()
    assert api.statuses() == [529, 200, 429, 200]
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT key FROM model_budgets")
        assert await cur.fetchall() == [("anthropic",)]  # the pause was shared
