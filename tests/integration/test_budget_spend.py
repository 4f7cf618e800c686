"""Cost budgets on the real Postgres, in process: what an attempt spends is
added to its tenant's and its agent's budgets in the statement that records
its usage, a request whose budget is spent parks at its start with the
reason in the ledger, another tenant's runs, and the request runs once the
budget has room again (raised, or its period rolled over by the clock)."""

from __future__ import annotations

import html
import re
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from loomflow import Agent, tool
from loomflow.core.errors import InvalidRequestError
from loomflow.core.types import Message, Role
from starlette.testclient import TestClient

from loomflow_worker import NoMemory, register_agent
from loomflow_worker.console.app import create_app
from loomflow_worker.execution import budgets, ledger
from loomflow_worker.execution.execute import execute
from loomflow_worker.execution.limits import command_by
from loomflow_worker.execution.request import check_request
from loomflow_worker.execution.request_errors import OverBudget
from loomflow_worker.runtime.errors import InvalidInput
from loomflow_worker.settings import Settings, budget_of
from loomflow_worker.testing import DeterministicModel
from loomflow_worker.worker.context import WorkerContext

pytestmark = pytest.mark.anyio

AGENT = "test-budgets"


@register_agent(AGENT)
def _agent(runtime: Any) -> Agent:
    return Agent("a", model=DeterministicModel(), runtime=runtime, memory=NoMemory(),
                 auto_extract=False)


#: An agent whose model call after a tool call fails once per prompt (a retry).
FLAKY = "test-budgets-flaky"
_failed: set[str] = set()


@tool(name="echo", description="Answers with its tag.")
async def echo(tag: str) -> str:
    return f"ok {tag}"


async def _fail_once_after_a_tool(messages: list[Message]) -> None:
    prompt = next(m.content for m in messages if m.role == Role.USER)
    if messages[-1].role == Role.TOOL and prompt not in _failed:
        _failed.add(prompt)
        raise InvalidRequestError("the model call failed once")


@register_agent(FLAKY)
def _flaky(runtime: Any) -> Agent:
    return Agent("a", model=DeterministicModel(on_call=_fail_once_after_a_tool), runtime=runtime,
                 memory=NoMemory(), tools=[echo], auto_extract=False)


def _args(request_id: str, user: str, agent: str = AGENT) -> dict[str, Any]:
    prompt = (f'call echo {{"tag": "{request_id}"}}' if agent == FLAKY
              else f"hello {request_id}")
    return {"prompt": prompt, "session_id": f"s-{request_id}", "user_id": user,
            "agent": agent, "metadata": None}


def _enqueue(settings: Settings, request_id: str, user: str, agent: str = AGENT) -> None:
    enqueue = ledger.EnqueuePool()
    try:
        enqueue.insert(settings.database_url.get_secret_value(), 5, request_id,
                       check_request(settings, kind="run", **_args(request_id, user, agent)))
    finally:
        enqueue.close()


async def _attempt(ctx: WorkerContext, request_id: str, user: str, agent: str = AGENT) -> str:
    return (await execute(ctx, request_id, _args(request_id, user, agent), "run")).kind


def _set(dsn: str, name: str, amount: Any, unit: str = "tokens", over: str = "wait") -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        budgets.write(conn, name, budget_of(amount, unit, "day", over), command_by())


def _one(dsn: str, sql: str, *params: Any) -> Any:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(sql, params).fetchone()
    assert row is not None
    return row


async def test_a_spent_budget_parks_its_tenants_next_request_until_raised_or_rolled_over(
    dsn: str,
) -> None:
    settings = Settings(database_url=dsn, events=False)  # type: ignore[arg-type]
    _set(dsn, "acme", 1)
    _set(dsn, f"agent:{AGENT}", "1000000")
    ctx = WorkerContext(settings)
    try:
        # acme's first request runs (its budget is not spent yet) and spends it.
        _enqueue(settings, "acme-1", "acme")
        assert await _attempt(ctx, "acme-1", "acme") == "succeeded"
        tokens = _one(dsn, "SELECT input_tokens + output_tokens FROM runs"
                           " WHERE request_id = 'acme-1'")[0]
        assert tokens > 1
        rows = {row.name: row for row in _budgets(dsn)}
        assert rows["acme"].spent == rows[f"agent:{AGENT}"].spent == tokens
        # Its next one parks at its start, saying why; nothing ran.
        _enqueue(settings, "acme-2", "acme")
        assert await _attempt(ctx, "acme-2", "acme") == "parked"
        status, waiting_for, budget, attempts = _one(
            dsn, "SELECT status, waiting_for, waiting_budget, attempts FROM runs"
                 " WHERE request_id = 'acme-2'")
        assert (status, budget, attempts) == ("queued", "acme", 0)
        assert waiting_for.startswith(
            f"for tenant acme's daily budget of 1 tokens (spent {tokens:,}); resets ")
        assert waiting_for.endswith(" 00:00 UTC or when raised"), waiting_for
        assert _budgets(dsn)[0].waiting == 1
        # The console's run page says so too.
        with TestClient(create_app(settings), client=("127.0.0.1", 40000),
                        base_url="http://localhost:8040") as browser:
            page = browser.get("/runs/acme-2")
            fleet = browser.get("/fleet")
        shown = re.search(r'<dd id="waits">([^<]*)</dd>', page.text)
        assert shown is not None and html.unescape(shown[1]) == waiting_for, page.text
        # And its fleet page lists the budget: spent, and one request waiting on it.
        row = re.search(r'<tr data-budget="acme">(.*?)</tr>', fleet.text)
        assert row is not None, fleet.text
        assert f'<td class="num spent">{tokens:,} tokens</td>' in row[1], row[1]
        assert '<td class="num waiting">1</td>' in row[1], row[1]
        # The sweeper's wake leaves it while the budget is spent.
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert budgets.wake(conn) == []
        # Another tenant runs meanwhile (the agent's budget has room).
        _enqueue(settings, "beta-1", "beta")
        assert await _attempt(ctx, "beta-1", "beta") == "succeeded"
        # Raised: woken, and it runs.
        _set(dsn, "acme", 10_000_000)
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert [p.request_id for p in budgets.wake(conn)] == ["acme-2"]
        assert await _attempt(ctx, "acme-2", "acme") == "succeeded"
        # Spent again; the period rolls over (its start set back a day): it
        # has spent nothing in the current one, and its waiter runs.
        _set(dsn, "acme", 1)
        _enqueue(settings, "acme-3", "acme")
        assert await _attempt(ctx, "acme-3", "acme") == "parked"
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("UPDATE cost_budgets SET period_start = period_start - interval '1 day'"
                         " WHERE name = 'acme'")
            assert _budgets(dsn)[0].spent == 0
            assert [p.request_id for p in budgets.wake(conn)] == ["acme-3"]
        assert await _attempt(ctx, "acme-3", "acme") == "succeeded"
        assert _budgets(dsn)[0].spent == _one(
            dsn, "SELECT input_tokens + output_tokens FROM runs WHERE request_id = 'acme-3'")[0]
        # Spent again; the budget is removed: its waiter runs.
        _set(dsn, "acme", 1)
        _enqueue(settings, "acme-4", "acme")
        assert await _attempt(ctx, "acme-4", "acme") == "parked"
        with psycopg.connect(dsn, autocommit=True) as conn:
            budgets.write(conn, "acme", None, command_by())
            assert [p.request_id for p in budgets.wake(conn)] == ["acme-4"]
            with pytest.raises(InvalidInput, match="no budget is named 'acme'"):
                budgets.write(conn, "acme", None, command_by())
        assert await _attempt(ctx, "acme-4", "acme") == "succeeded"
    finally:
        await ctx.aclose()


async def test_a_retried_request_spends_each_model_call_once(dsn: str) -> None:
    """Attempt 1 calls the model, runs its tool, and its second call fails (a
    retry); attempt 2 replays the first call from the journal and makes the
    second. The budget is spent by the two calls billed, the replay not again."""
    settings = Settings(database_url=dsn, events=False,  # type: ignore[arg-type]
                        retry_backoff=0.01)
    _set(dsn, "acme", 10_000_000)
    ctx = WorkerContext(settings)
    try:
        _enqueue(settings, "acme-flaky", "acme", FLAKY)
        assert await _attempt(ctx, "acme-flaky", "acme", FLAKY) == "retry"
        first = _budgets(dsn)[0].spent
        assert first > 0
        assert await _attempt(ctx, "acme-flaky", "acme", FLAKY) == "succeeded"
    finally:
        await ctx.aclose()
    calls, replayed, tokens = _one(
        dsn, "SELECT model_calls, replayed_calls, input_tokens + output_tokens FROM runs"
             " WHERE request_id = 'acme-flaky'")
    assert (calls, replayed) == (2, 1)
    assert _budgets(dsn)[0].spent == tokens > first


async def test_a_budget_in_dollars_spends_the_cost(dsn: str) -> None:
    from loomflow_worker.settings import ModelPrice

    settings = Settings(database_url=dsn, events=False,  # type: ignore[arg-type]
                        prices={"deterministic": ModelPrice(input=3.0, output=15.0)})
    _set(dsn, "acme", "0.5", unit="usd")
    ctx = WorkerContext(settings)
    try:
        _enqueue(settings, "acme-usd", "acme")
        assert await _attempt(ctx, "acme-usd", "acme") == "succeeded"
    finally:
        await ctx.aclose()
    cost = _one(dsn, "SELECT cost FROM runs WHERE request_id = 'acme-usd'")[0]
    row = _budgets(dsn)[0]
    assert cost > 0 and row.spent == cost and (row.unit, row.amount) == ("usd", Decimal("0.5"))


async def test_a_refusing_budget_refuses_the_enqueue_and_writes_nothing(dsn: str) -> None:
    settings = Settings(database_url=dsn, events=False)  # type: ignore[arg-type]
    _set(dsn, "acme", 1, over="refuse")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE cost_budgets SET spent = 5, period_start = now()")
    budgets.REFUSING.forget()
    with pytest.raises(OverBudget) as refused:
        _enqueue(settings, "acme-refused", "acme")
    assert str(refused.value).startswith(
        "refused: tenant acme's daily budget of 1 tokens (spent 5); resets "), refused.value
    assert _one(dsn, "SELECT count(*) FROM runs")[0] == 0
    # Another tenant is accepted.
    _enqueue(settings, "beta-ok", "beta")
    assert _one(dsn, "SELECT count(*) FROM runs")[0] == 1


def _budgets(dsn: str) -> list[budgets.BudgetRow]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return budgets.read(conn)



async def test_a_budget_set_in_another_unit_or_period_says_so_and_counts_no_tokens_as_dollars(
    dsn: str, caplog: pytest.LogCaptureFixture,
) -> None:
    from loomflow_worker.settings import ModelPrice

    settings = Settings(database_url=dsn, events=False,  # type: ignore[arg-type]
                        prices={"deterministic": ModelPrice(input=3.0, output=15.0)})

    def change(amount: Any, unit: str, period: str) -> str | None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            changed = budgets.write(conn, "acme", budget_of(amount, unit, period), command_by())
        assert changed is not None
        return changed.said()

    def spent_by(request_id: str) -> tuple[int, Decimal]:
        return _one(dsn, "SELECT input_tokens + output_tokens, cost FROM runs"
                         " WHERE request_id = %s", request_id)

    assert change(1, "tokens", "day") is None  # new: nothing changed
    ctx = WorkerContext(settings)
    try:
        _enqueue(settings, "acme-1", "acme")
        assert await _attempt(ctx, "acme-1", "acme") == "succeeded"
        tokens, _ = spent_by("acme-1")
        assert tokens > 5
        # Tokens a day to dollars a month: the tokens spent are no dollars.
        with caplog.at_level("INFO", logger=budgets.__name__):
            said = change(5, "usd", "month")
        assert said is not None and re.fullmatch(
            rf"was 1 tokens a day, now \$5\.00 a month; spent so far this month: \$0 \(the "
            rf"{tokens:,} tokens it spent today are not counted: a spend in tokens is none in "
            r"usd\); the period rolls over \d{4}-\d\d-01 00:00 UTC", said), said
        [logged] = [r for r in caplog.records if getattr(r, "action", None) == "budget_changed"]
        assert logged.getMessage() == f"budget 'acme' changed by {command_by()}: {said}"
        # Its tokens are not compared with $5: acme's next request runs, and
        # spends its cost.
        _enqueue(settings, "acme-2", "acme")
        assert await _attempt(ctx, "acme-2", "acme") == "succeeded"
        _, cost = spent_by("acme-2")
        assert cost > 0 and _budgets(dsn)[0].spent == cost
        # Back to tokens a day: the dollars are not counted as tokens.
        said = change(1, "tokens", "day")
        assert said is not None and said.startswith(
            f"was $5.00 a month, now 1 tokens a day; spent so far today: 0 tokens (the "
            f"${cost.normalize()} it spent this month are not counted: a spend in usd is none "
            "in tokens); the period rolls over "), said
        _enqueue(settings, "acme-3", "acme")
        assert await _attempt(ctx, "acme-3", "acme") == "succeeded"
        tokens, _ = spent_by("acme-3")
        assert _budgets(dsn)[0].spent == tokens
        # A day to a month in the same unit: today's spend is kept, said so.
        said = change(1, "tokens", "month")
        assert said is not None and said.startswith(
            f"was 1 tokens a day, now 1 tokens a month; spent so far this month: {tokens:,} "
            "tokens (today's spend only: a daily budget kept no count of the month's other "
            "days); "), said
        _enqueue(settings, "acme-4", "acme")
        assert await _attempt(ctx, "acme-4", "acme") == "parked"
        assert change(1, "tokens", "month") is None  # set again as it was
    finally:
        await ctx.aclose()
