"""Cost budgets as settings and the command read them: the parts of a
budget, and bad input refused in one line with nothing changed (the command
refuses before it connects: no database here)."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from loomflow_worker.cli import main
from loomflow_worker.execution.budgets import amount_said, names_of
from loomflow_worker.settings import Budget, Settings, budget_of, validation_message

#: A database nobody listens on: a command that got past its checks fails otherwise.
NOWHERE = {"LOOMFLOW_WORKER_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none"}


@pytest.mark.parametrize(("given", "budget"), [
    ({"tokens": 1000000}, Budget(amount=Decimal(1000000), unit="tokens")),
    ({"tokens": "1,000,000", "per": "month"},
     Budget(amount=Decimal(1000000), unit="tokens", period="month")),
    ({"usd": 50.5, "per": "month", "over": "refuse"},
     Budget(amount=Decimal("50.5"), unit="usd", period="month", over="refuse")),
    ({"usd": "0.25"}, Budget(amount=Decimal("0.25"), unit="usd")),
])
def test_settings_read_a_budget_in_tokens_or_dollars(given: dict[str, object],
                                                     budget: Budget) -> None:
    settings = Settings(budgets={"acme": given})  # type: ignore[dict-item]
    assert settings.budgets == {"acme": budget}


@pytest.mark.parametrize(("given", "says"), [
    ({"acme": {"tokens": 0}}, "budgets.acme: Value error, a budget is a positive number of "
                              "tokens, not 0"),
    ({"acme": {"usd": -5}}, "a budget is a positive number of usd, not -5"),
    ({"acme": {"usd": "lots"}}, "a budget is a positive number of usd, not 'lots'"),
    ({"acme": {"tokens": 1.5}}, "a budget in tokens is a whole number, not 1.5"),
    ({"acme": {"tokens": 5, "per": "week"}}, "unknown budget period 'week': day or month"),
    ({"acme": {"eur": 5}}, "unknown unit or field 'eur'"),
    ({"acme": {"tokens": 5, "over": "crash"}}, "unknown budget action 'crash'"),
    ({"acme": {"tokens": 5, "usd": 1}}, "give the budget in tokens or in usd (one of them)"),
    ({"acme": {}}, "give the budget in tokens or in usd (one of them)"),
    ({"agent:": {"tokens": 5}}, "an agent name is a non-empty printable name"),
])
def test_bad_budgets_in_settings_are_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, given: dict[str, object], says: str,
) -> None:
    monkeypatch.setenv("LOOMFLOW_WORKER_BUDGETS", json.dumps(given))
    with pytest.raises(ValidationError) as refused:
        Settings()
    message = validation_message(refused.value)
    assert says in message and "\n" not in message, message


@pytest.mark.parametrize(("args", "says"), [
    (["acme", "0"], "a budget is a positive number of tokens, not '0'"),
    (["--unit", "usd", "acme", "--", "-3"], "a budget is a positive number of usd, not '-3'"),
    (["acme", "many"], "a budget is a positive number of tokens, not 'many'"),
    (["acme", "nan"], "a budget is a positive number of tokens, not 'nan'"),
    (["acme", "10", "--per", "week"], "'week' is not one of 'day', 'month'"),
    (["acme", "10", "--unit", "eur"], "'eur' is not one of 'tokens', 'usd'"),
    (["acme", "10", "--over", "crash"], "'crash' is not one of 'wait', 'refuse'"),
    (["acme"], "give AMOUNT (a positive number), or --none"),
    (["acme", "10", "--none"], "give AMOUNT (a positive number), or --none"),
    (["", "10"], "a fairness key is a non-empty printable name"),
    (["agent:" + "x" * 65, "10"], "an agent name is at most 64 bytes"),
])
def test_bad_budgets_on_the_command_are_refused_before_it_connects(
    args: list[str], says: str,
) -> None:
    done = CliRunner().invoke(main, ["limits", "budget", *args], env=NOWHERE)
    assert done.exit_code == 2, done.output
    assert says in done.output, done.output


def test_an_amount_reads_with_separators_and_shows_as_limits_lists_it() -> None:
    assert budget_of("1_000_000", "tokens").amount == Decimal(1000000)
    assert amount_said(Decimal("1000412.0000000000"), "tokens") == "1,000,412 tokens"
    assert amount_said(Decimal("1234.5"), "usd") == "$1,234.50"
    assert amount_said(Decimal("0.000135"), "usd") == "$0.000135"


def test_a_request_spends_from_its_fairness_keys_budget_and_its_agents() -> None:
    assert names_of("acme", "research") == ["acme", "agent:research"]
    assert names_of(None, "research") == ["agent:research"]
