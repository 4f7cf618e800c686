"""What a request's model calls used and cost, as the ledger keeps it: each
attempt's own, and the request's totals split into executed (billed) and
replayed (answered from the journal, not billed again). In process, on the
real Postgres, with the offline model (which reports its usage)."""

from __future__ import annotations

import json
import re
from datetime import UTC
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from loomflow import Agent, tool
from loomflow.core.errors import InvalidRequestError
from loomflow.core.types import Message, Role
from psycopg.rows import dict_row
from starlette.testclient import TestClient

from loomflow_worker import NoMemory, register_agent
from loomflow_worker.cli import main
from loomflow_worker.console.app import create_app
from loomflow_worker.execution import ledger
from loomflow_worker.execution.execute import execute
from loomflow_worker.execution.request import check_request
from loomflow_worker.settings import ModelPrice, Settings
from loomflow_worker.testing import DeterministicModel
from loomflow_worker.worker.context import WorkerContext

pytestmark = pytest.mark.anyio

PROMPT = 'call echo {{"tag": "{}"}}'
#: The offline model's price, per million tokens, as a deployment would set it.
PRICE = ModelPrice(input=3.0, output=15.0)
#: Prompts whose model call after a tool call failed once already (each test its own).
_failed: set[str] = set()


@tool(name="echo", description="Answers with its tag.")
async def echo(tag: str) -> str:
    return f"ok {tag}"


async def _fail_once_after_a_tool(messages: list[Message]) -> None:
    """The model call that follows a tool result fails the first time (the
    run fails: a retry), and answers on the next attempt."""
    prompt = next(m.content for m in messages if m.role == Role.USER)
    if messages[-1].role == Role.TOOL and prompt not in _failed:
        _failed.add(prompt)
        raise InvalidRequestError("the model call failed once")


@register_agent("test-usage")
def _agent(runtime: Any) -> Agent:
    return Agent("a", model=DeterministicModel(on_call=_fail_once_after_a_tool), runtime=runtime,
                 memory=NoMemory(), tools=[echo], auto_extract=False)


async def _attempt(settings: Settings, request_id: str, prompt: str) -> str:
    args = {"prompt": prompt, "session_id": f"s-{request_id}", "user_id": "u",
            "agent": "test-usage", "metadata": None}
    enqueue = ledger.EnqueuePool()
    ctx = WorkerContext(settings)
    try:
        enqueue.insert(settings.database_url.get_secret_value(), 5, request_id,
                       check_request(settings, kind="run", **args))
        return (await execute(ctx, request_id, args, "run")).kind
    finally:
        enqueue.close()
        await ctx.aclose()


async def _retried(settings: Settings, request_id: str) -> None:
    """Attempt 1 of ``request_id`` ends in a retry (its second model call
    fails), attempt 2 succeeds."""
    assert await _attempt(settings, request_id, PROMPT.format(request_id)) == "retry"
    assert await _attempt(settings, request_id, PROMPT.format(request_id)) == "succeeded"


async def _ledger(dsn: str, request_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    async with await psycopg.AsyncConnection.connect(dsn, row_factory=dict_row) as conn:
        cur = await conn.execute("SELECT * FROM runs WHERE request_id = %s", (request_id,))
        run = await cur.fetchone()
        cur = await conn.execute("SELECT attempt, usage FROM run_attempts WHERE request_id = %s "
                                 "ORDER BY attempt", (request_id,))
        attempts = await cur.fetchall()
    assert run is not None
    return run, attempts


def _cost(side: dict[str, Any]) -> Decimal:
    return (Decimal(side["input"]) * 3 + Decimal(side["output"]) * 15) / 1_000_000


async def test_a_retried_request_counts_each_model_call_once_and_its_replay_apart(
    dsn: str,
) -> None:
    """Attempt 1 calls the model, runs its tool, and its second model call
    fails (a retry); attempt 2 replays the first call and the tool from the
    journal and makes the second call. The request was
    billed for two calls; the replayed one is counted apart, at its price."""
    settings = Settings(database_url=dsn, events=False,  # type: ignore[arg-type]
                        prices={"deterministic": PRICE}, retry_backoff=0.01)
    await _retried(settings, "req-usage-retry")
    run, attempts = await _ledger(dsn, "req-usage-retry")
    first, second = (a["usage"] for a in attempts)
    assert first["executed"]["calls"] == 1 and first["replayed"]["calls"] == 0
    assert second["executed"]["calls"] == 1 and second["replayed"]["calls"] == 1
    # The call attempt 2 replayed is the one attempt 1 made.
    assert {k: v for k, v in second["replayed"].items() if k != "cost"} == {
        k: v for k, v in first["executed"].items() if k != "cost"}
    billed = [first["executed"], second["executed"]]
    assert run["model_calls"] == 2 and run["replayed_calls"] == 1
    assert run["input_tokens"] == sum(side["input"] for side in billed) > 0
    assert run["output_tokens"] == sum(side["output"] for side in billed) > 0
    assert run["replayed_tokens"] == first["executed"]["input"] + first["executed"]["output"]
    assert run["cost"] == sum(_cost(side) for side in billed) > 0
    assert run["replayed_cost"] == _cost(first["executed"])
    assert Decimal(second["executed"]["cost"]) == _cost(second["executed"])
    assert not run["price_unknown"]
    assert second["keys"]["deterministic"]["model"] == "deterministic"


async def test_a_model_with_no_known_price_counts_its_tokens_and_says_so(dsn: str) -> None:
    settings = Settings(database_url=dsn, events=False)  # type: ignore[arg-type]
    assert await _attempt(settings, "req-usage-unpriced", "hello") == "succeeded"
    run, attempts = await _ledger(dsn, "req-usage-unpriced")
    assert run["model_calls"] == 1 and run["input_tokens"] > 0 and run["output_tokens"] > 0
    assert run["price_unknown"] and run["cost"] == 0
    assert attempts[0]["usage"]["executed"]["cost"] is None



def _cli(dsn: str, *args: str, **env: str) -> Any:
    done = CliRunner().invoke(main, list(args),
                              env={"LOOMFLOW_WORKER_DATABASE_URL": dsn, **env})
    return done


async def test_show_requests_and_usage_report_tokens_cost_and_replays(dsn: str) -> None:
    """`show` gives the request's tokens, cost and replay savings, and each
    attempt's; `requests --sort cost --min-cost` lists the costly ones first;
    `usage --by key` adds them up per fairness key."""
    settings = Settings(database_url=dsn, events=False,  # type: ignore[arg-type]
                        prices={"deterministic": PRICE}, retry_backoff=0.01)
    await _retried(settings, "req-usage-cli")
    assert await _attempt(settings, "req-usage-small", "hi") == "succeeded"
    run, _ = await _ledger(dsn, "req-usage-cli")
    small, _ = await _ledger(dsn, "req-usage-small")
    env = {"LOOMFLOW_WORKER_PRICES": '{"deterministic": {"input": 3, "output": 15}}'}

    shown = _cli(dsn, "show", "req-usage-cli", **env)
    assert shown.exit_code == 0, shown.output
    assert (f"tokens    {run['input_tokens']:,} in, {run['output_tokens']:,} out, 0 cache read, "
            "0 cache write (2 model calls executed)") in shown.output
    assert f"cost      ${run['cost']:.4f}" in shown.output
    assert (f"replayed  1 model calls from the journal, not billed again: "
            f"{run['replayed_tokens']:,} tokens, ${run['replayed_cost']:.4f} saved"
            ) in shown.output
    attempt_lines = [line.split() for line in shown.output.splitlines()
                     if line.startswith("  1 ") or line.startswith("  2 ")]
    assert [line[-1] for line in attempt_lines] == ["calls)", "calls)"]
    assert "(0 calls)" in " ".join(attempt_lines[0]) and "(1 calls)" in " ".join(
        attempt_lines[1])

    listed = _cli(dsn, "requests", "--sort", "cost", "--json", **env)
    assert listed.exit_code == 0, listed.output
    order = [json.loads(line)["request_id"] for line in listed.output.splitlines()]
    assert order == ["req-usage-cli", "req-usage-small"]
    costly = _cli(dsn, "requests", "--min-cost", str(run["cost"]), "--json", **env)
    assert [json.loads(line)["request_id"] for line in costly.output.splitlines()] == [
        "req-usage-cli"]

    report = _cli(dsn, "usage", "--by", "key", "--json", **env)
    assert report.exit_code == 0, report.output
    [row] = [json.loads(line) for line in report.output.splitlines()]
    assert row["group"] == "u" and row["requests"] == 2
    assert row["model_calls"] == run["model_calls"] + small["model_calls"] == 3
    assert Decimal(row["cost"]) == run["cost"] + small["cost"]
    assert row["replayed_calls"] == 1 and Decimal(row["replayed_cost"]) == run["replayed_cost"]
    by_day = _cli(dsn, "usage", "--by", "day", "--since", "1d", "--json", **env)
    [day] = [json.loads(line) for line in by_day.output.splitlines()]
    assert day["group"] == run["enqueued_at"].astimezone(UTC).date().isoformat()
    assert day["requests"] == 2 and day["model_calls"] == 3
    table = _cli(dsn, "usage", "--by", "key", **env)
    assert table.exit_code == 0, table.output
    head, first, total, note = table.output.splitlines()
    assert head.split()[:3] == ["KEY", "REQUESTS", "CALLS"]
    assert first.split()[:3] == ["u", "2", "3"] and total.split()[:3] == ["total", "2", "3"]
    assert note.endswith("cost in US dollars")


@pytest.mark.parametrize(("prices", "said"), [
    ('{"claude": {"input": "three", "output": 15}}', "prices.claude.input"),
    ('{"claude": {"input": 3}}', "prices.claude.output"),
    ('{"claude": {"input": -1, "output": 15}}', "prices.claude.input"),
    ('{"claude": {"input": 3, "output": 15, "cache": 1}}', "prices.claude.cache"),
])
def test_a_bad_price_override_is_refused_naming_it(dsn: str, prices: str, said: str) -> None:
    done = _cli(dsn, "usage", LOOMFLOW_WORKER_PRICES=prices)
    assert done.exit_code == 2
    assert said in done.output and "LOOMFLOW_WORKER_" in done.output


def test_a_bad_since_is_refused_saying_what_it_takes(dsn: str) -> None:
    done = _cli(dsn, "usage", "--since", "last week")
    assert done.exit_code == 2
    assert "neither a duration (e.g. 7d, 12h) nor a date" in done.output


async def test_the_console_shows_a_runs_usage_and_the_usage_page_adds_it_up(dsn: str) -> None:
    settings = Settings(database_url=dsn, events=False,  # type: ignore[arg-type]
                        prices={"deterministic": PRICE}, retry_backoff=0.01)
    await _retried(settings, "req-usage-page")
    run, _ = await _ledger(dsn, "req-usage-page")
    with TestClient(create_app(settings), client=("127.0.0.1", 40000),
                    base_url="http://localhost:8040") as browser:
        page = browser.get("/runs/req-usage-page")
        assert page.status_code == 200
        executed = re.search(r'<dd class="executed">([^<]*)</dd>', page.text)
        assert executed is not None and executed[1] == (
            f"2 model calls, billed: {run['input_tokens']} in, {run['output_tokens']} out, "
            f"0 cache read, 0 cache write; ${run['cost']:.4f}")
        assert "1 model calls from the journal, not billed again" in page.text
        attempts = re.findall(r'data-attempt="(\d)">executed (\d) calls', page.text)
        assert attempts == [("1", "1"), ("2", "1")]

        report = browser.get("/usage", params={"by": "key", "since": "1d"})
        assert report.status_code == 200
        row = re.search(r'<tr data-group="u">(.*?)</tr>', report.text, re.S)
        assert row is not None
        assert re.search(r'class="num requests">1<', row[1])
        assert re.search(r'class="num calls">2<', row[1])
        assert f"${run['cost']:.4f}" in row[1] and f"${run['replayed_cost']:.4f}" in row[1]
        assert browser.get("/usage", params={"by": "tenant"}).status_code == 400
        empty = browser.get("/usage", params={"since": "2100-01-01"})
        assert "No model call recorded in this window." in empty.text
