"""Cost budgets on real Celery workers: a tenant that spent its budget has
its next request wait in the ledger (no slot, no retry) with the reason in
`show`, `requests`, `limits` and the log, while another tenant's runs; the
request starts when the budget is raised or its period rolls over; a budget
that refuses makes `.delay()` raise and writes nothing."""

from __future__ import annotations

import html
import json
import re

import psycopg
import pytest
from starlette.testclient import TestClient

from loomflow_worker.console.app import create_app
from loomflow_worker.execution import budgets
from loomflow_worker.execution.request_errors import OverBudget
from loomflow_worker.settings import Settings
from loomflow_worker.tasks import run_agent

from .celery_harness import Fleet
from .helpers import calls, cell, cli, tool_executions, wait_until

pytestmark = pytest.mark.slow

FAST = {"LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "0.5", "LOOMFLOW_WORKER_SWEEP_INTERVAL": "0.5",
        "LOOMFLOW_WORKER_HANDOFF_GRACE": "1"}
#: How a parked request's wait reads, its spend and reset date aside.
REASON = re.compile(r"for tenant acme's daily budget of 1 tokens \(spent ([\d,]+)\); resets "
                    r"\d{4}-\d\d-\d\d 00:00 UTC or when raised")


def _row(dsn: str, request_id: str) -> tuple[str, str | None, int, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT status, waiting_budget, attempts, failures FROM runs"
                           " WHERE request_id = %s", (request_id,)).fetchone()
    assert row is not None
    return row


def _spent_for(fleet: Fleet, first: str, second: str) -> str:
    """Wait until ``second`` parks on acme's budget, which ``first`` spent;
    what its reason says acme spent (the tokens ``first`` used)."""
    wait_until(lambda: _row(fleet.dsn, second)[1] == "acme", "the request never parked")
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT input_tokens + output_tokens FROM runs WHERE request_id = %s",
                           (first,)).fetchone()
    assert row is not None and row[0] > 1
    return f"{row[0]:,}"


def test_a_spent_budget_parks_a_tenants_request_while_another_runs_until_raised(
    fleet: Fleet,
) -> None:
    assert cli(fleet, "limits", "budget", "acme", "1").returncode == 0
    fleet.start("w1", concurrency=2, pool="threads", **FAST)
    first = run_agent.delay(calls("a1"), "a1", user_id="acme")
    assert first.get(timeout=60)["output"] == "done: recorded a1"  # not spent yet: it runs
    second = run_agent.delay(calls("a2"), "a2", user_id="acme")
    other = run_agent.delay(calls("b1"), "b1", user_id="beta")
    assert other.get(timeout=60)["output"] == "done: recorded b1"
    spent = _spent_for(fleet, first.id, second.id)
    # Parked: queued, no attempt, no failure; and said everywhere.
    assert _row(fleet.dsn, second.id) == ("queued", "acme", 0, 0)
    shown = cli(fleet, "show", second.id).stdout
    waits = next(line for line in shown.splitlines() if line.startswith("waits"))
    said = REASON.search(waits)
    assert said is not None and said[1] == spent, shown
    listed = cli(fleet, "requests", "--user", "acme", "--status", "queued").stdout
    header, row = listed.splitlines()[:2]
    assert REASON.fullmatch(cell(header, row, "WAITS")), listed
    limits = cli(fleet, "limits").stdout
    header, row = next((h, r) for h, r in zip(limits.splitlines(), limits.splitlines()[1:],
                                              strict=False) if h.startswith("BUDGET"))
    assert (cell(header, row, "BUDGET"), cell(header, row, "AMOUNT"), cell(header, row, "SPENT"),
            cell(header, row, "WAITING")) == ("acme", "1 tokens", f"{spent} tokens", "1"), limits
    assert cell(header, row, "SOURCE").startswith("command"), limits
    [budget] = [json.loads(line) for line in cli(fleet, "limits", "--json").stdout.splitlines()
                if json.loads(line)["kind"] == "budget"]
    assert (budget["name"], budget["unit"], budget["period"], budget["waiting"]) == (
        "acme", "tokens", "day", 1), budget
    assert f"request {second.id} waits for tenant acme's daily budget" in fleet.log_text()
    # Raised: the command publishes it at once, and it runs.
    raised = cli(fleet, "limits", "budget", "acme", "1000000")
    assert f"request {second.id}, which waited for it, published" in raised.stdout, raised
    assert second.get(timeout=60)["output"] == "done: recorded a2"
    assert _row(fleet.dsn, second.id) == ("succeeded", None, 1, 0)


def test_a_parked_request_starts_when_its_budgets_period_rolls_over(fleet: Fleet) -> None:
    # The budget comes from the workers' settings; the period rolls over when
    # its start lies before the current day's (set back here, as midnight UTC
    # would): the sweeper's leader publishes the request that waited.
    fleet.start("w1", concurrency=2, pool="threads", **FAST,
                LOOMFLOW_WORKER_BUDGETS=json.dumps({"acme": {"tokens": 1, "per": "day"}}))
    first = run_agent.delay(calls("a1"), "a1", user_id="acme")
    first.get(timeout=60)
    second = run_agent.delay(calls("a2"), "a2", user_id="acme")
    _spent_for(fleet, first.id, second.id)
    limits = cli(fleet, "limits").stdout
    assert "settings" in next(line for line in limits.splitlines() if line.startswith("acme"))
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        conn.execute("UPDATE cost_budgets SET period_start = period_start - interval '1 day'")
    assert second.get(timeout=60)["output"] == "done: recorded a2"
    assert f"sweeper: request {second.id} published: its budget has room again" in \
        fleet.log_text()


def test_a_refusing_budget_makes_delay_raise_and_writes_nothing(fleet: Fleet) -> None:
    assert cli(fleet, "limits", "budget", "acme", "1", "--over", "refuse").returncode == 0
    fleet.start("w1", concurrency=2, pool="threads", **FAST)
    first = run_agent.delay(calls("a1"), "a1", user_id="acme")
    first.get(timeout=60)
    budgets.REFUSING.forget()  # as an enqueue a few seconds later would read it
    with pytest.raises(OverBudget, match=r"^refused: tenant acme's daily budget of 1 tokens "
                                         r"\(spent [\d,]+\); resets .* UTC or when raised"):
        run_agent.delay(calls("a2"), "a2", user_id="acme")
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM runs WHERE session_id = 'a2'").fetchone()
    assert row == (0,)
    assert run_agent.delay(calls("b1"), "b1", user_id="beta").get(timeout=60)["output"] == \
        "done: recorded b1"


def test_a_resumed_request_parked_on_its_budget_says_it_waits_for_it(fleet: Fleet) -> None:
    # acme's first request is in its tool (30 s on w1) when its second, which
    # calls no tool, ends and spends acme's budget; w1 is killed: w2 resumes
    # the first, whose attempt parks on the spent budget before it starts. Its
    # row still says `running` (its last attempt died), yet it waits for its
    # budget, and `show`, `requests` and the console's run page say so.
    assert cli(fleet, "limits", "budget", "acme", "1").returncode == 0
    env = {**FAST, "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "2"}
    fleet.start("w1", concurrency=2, pool="threads", **env, TEST_TOOL_SLEEP="30")
    first = run_agent.delay(calls("first"), "a0", user_id="acme")
    wait_until(lambda: any(tag == "first" for tag, *_ in tool_executions(fleet.dsn)),
               "the first request never ran its tool")
    spender = run_agent.delay("hello", "a1", user_id="acme")
    spender.get(timeout=60)
    fleet.start("w2", concurrency=2, pool="threads", **env)
    fleet.kill("w1")
    wait_until(lambda: _row(fleet.dsn, first.id)[1] == "acme",
               "the resumed request never parked on its budget")
    assert _row(fleet.dsn, first.id)[0] == "running"
    shown = cli(fleet, "show", first.id).stdout
    waits = next((line for line in shown.splitlines() if line.startswith("waits")), None)
    assert waits is not None and REASON.search(waits) is not None, shown
    listed = cli(fleet, "requests", "--user", "acme", "--status", "running").stdout
    header, row = listed.splitlines()[:2]
    assert REASON.fullmatch(cell(header, row, "WAITS")), listed
    settings = Settings(database_url=fleet.dsn, events=False)  # type: ignore[arg-type]
    with TestClient(create_app(settings), client=("127.0.0.1", 40000),
                    base_url="http://localhost:8040") as browser:
        page = browser.get(f"/runs/{first.id}")
    said = re.search(r'<dd id="waits">([^<]*)</dd>', page.text)
    assert said is not None and REASON.fullmatch(html.unescape(said[1])), page.text
    # Raised (the command says the change): it runs to its end on w2.
    raised = cli(fleet, "limits", "budget", "acme", "1000000").stdout
    assert re.search(r"^changed: was 1 tokens a day, now 1,000,000 tokens a day; spent so far "
                     r"today: [\d,]+ tokens; the period rolls over \d{4}-\d\d-\d\d 00:00 UTC$",
                     raised, re.MULTILINE), raised
    assert first.get(timeout=60)["output"] == "done: recorded first"
    assert _row(fleet.dsn, first.id)[:2] == ("succeeded", None)
    assert "waits" not in [line[:5] for line in cli(fleet, "show", first.id).stdout.splitlines()]
