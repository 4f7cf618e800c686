"""What model calls cost: the settings' prices over genai-prices' table, the
token kinds each bills, and a model of no known price (no services)."""

from __future__ import annotations

from decimal import Decimal

import pytest
from loomflow.core.types import ModelChunk, Usage
from pydantic import ValidationError

from loomflow_worker.admin.usage_report import format_cost, parse_since, usage_params
from loomflow_worker.execution.usage import AttemptUsage, model_of, reply_tokens
from loomflow_worker.pricing import Prices, Tokens, price_by_table, tokens_of_usage
from loomflow_worker.runtime.errors import InvalidInput
from loomflow_worker.settings import ModelPrice, Settings

CALL = Tokens(calls=1, input=1_000, output=200, cache_read=4_000, cache_write=500)


def test_an_override_prices_each_kind_per_million_tokens() -> None:
    prices = Prices({"anthropic": ModelPrice(input=3, output=15, cache_read=0.3,
                                             cache_write=3.75)})
    expected = (Decimal(1_000) * 3 + Decimal(200) * 15 + Decimal(4_000) * Decimal("0.3")
                + Decimal(500) * Decimal("3.75")) / 1_000_000
    assert prices.cost("anthropic", "claude-sonnet-4-5", CALL) == expected


def test_cache_prices_left_out_are_the_input_price() -> None:
    prices = Prices({"k": ModelPrice(input=2, output=10)})
    assert prices.cost("k", "m", CALL) == (Decimal(5_500) * 2 + Decimal(200) * 10) / 1_000_000


def test_an_override_may_name_the_model_instead_of_the_key() -> None:
    prices = Prices({"my-model": ModelPrice(input=1, output=1)})
    assert prices.cost("some-key", "my-model", CALL) == Decimal(5_700) / 1_000_000


def test_the_table_prices_a_known_model_with_its_cache_rates() -> None:
    """claude-sonnet-4-5 at $3 input, $15 output, $0.30 cache read, $3.75
    cache write per million: the table counts cache tokens inside its input,
    loomflow apart, and the price is the same either way."""
    found = Prices({}).cost("anthropic", "claude-sonnet-4-5", CALL)
    assert found == (Decimal(1_000) * 3 + Decimal(200) * 15 + Decimal(4_000) * Decimal("0.3")
                     + Decimal(500) * Decimal("3.75")) / 1_000_000
    assert price_by_table("anthropic:claude-sonnet-4-5", CALL) == found


def test_a_model_the_table_does_not_know_has_no_price() -> None:
    assert Prices({}).cost("offline", "deterministic", CALL) is None
    assert price_by_table("nobody:no-such-model", CALL) is None


def test_usage_is_read_as_loomflow_reports_it() -> None:
    usage = Usage(input_tokens=10, cached_input_tokens=20, cache_write_tokens=30, output_tokens=5)
    assert tokens_of_usage(usage) == Tokens(1, 10, 5, 20, 30)
    assert tokens_of_usage(None) is None


def test_a_model_calls_result_gives_its_tokens_and_any_other_none() -> None:
    usage = Usage(input_tokens=7, output_tokens=3)
    assert reply_tokens(("hi", [], usage, "stop")) == Tokens(1, 7, 3)
    chunks = [ModelChunk(kind="text", text="hi"),
              ModelChunk(kind="finish", finish_reason="stop", usage=usage)]
    assert reply_tokens(chunks) == Tokens(1, 7, 3)
    assert reply_tokens("a tool's answer") is None
    assert reply_tokens(("a", "b", "c", "d")) is None
    assert reply_tokens([ModelChunk(kind="text", text="no usage")]) is None


class _Paced:
    usage_key = "anthropic-main"

    def __init__(self, inner: object) -> None:
        self._inner = inner


class _Retrying:
    def __init__(self, inner: object) -> None:
        self.inner = inner


class _Model:
    name = "claude-sonnet-4-5"


def test_a_call_is_counted_under_its_paced_key_and_priced_by_its_models_name() -> None:
    assert model_of(_Retrying(_Paced(_Model()))) == ("anthropic-main", "claude-sonnet-4-5")
    assert model_of(_Model()) == ("claude-sonnet-4-5", "claude-sonnet-4-5")
    assert model_of(None) == ("model", "model")


def test_an_attempt_splits_executed_from_replayed_and_says_an_unknown_price() -> None:
    usage = AttemptUsage("agent", Prices({"anthropic-main": ModelPrice(input=1, output=1)}))
    model = _Retrying(_Paced(_Model()))
    reply = ("x", [], Usage(input_tokens=100, output_tokens=10), "stop")
    usage(model.inner, reply, False)
    usage(model.inner, reply, True)
    usage(model.inner, reply, True)
    usage(_Model(), ("x", [], Usage(input_tokens=1), "stop"), False)
    usage(model.inner, "not a model call", False)
    params = usage.params()
    assert (params["calls"], params["input"], params["output"]) == (2, 101, 10)
    assert (params["r_calls"], params["r_tokens"]) == (2, 220)
    assert params["r_cost"] == Decimal(220) / 1_000_000
    # claude-sonnet-4-5 under its own name is priced by the table: all known.
    assert not params["price_unknown"]
    record = usage.record()
    assert record["keys"]["anthropic-main"]["replayed"]["calls"] == 2
    unknown = AttemptUsage("agent", Prices({}))
    unknown(None, ("x", [], Usage(input_tokens=1), "stop"), False)
    assert unknown.params()["price_unknown"] and unknown.record()["executed"]["cost"] is None


class _CountedPrices(Prices):
    def __init__(self) -> None:
        super().__init__({})
        self.asked: list[tuple[str, int]] = []

    def cost(self, key: str, model: str, tokens: Tokens) -> Decimal | None:
        self.asked.append((key, tokens.calls))
        return super().cost(key, model, tokens)


def test_an_attempts_end_prices_each_model_once() -> None:
    """A price from genai-prices' table takes about 0.1 ms to compute: the
    ledger's record of an attempt prices each of its models (executed and
    replayed apart) once, not once for each total it is in."""
    prices = _CountedPrices()
    usage = AttemptUsage("agent", prices)
    reply = ("x", [], Usage(input_tokens=100, output_tokens=10), "stop")
    model = _Model()
    for replayed in (False, False, True):
        usage(model, reply, replayed)
    params = usage.params()
    # Two executed calls and one replayed: two prices, one each.
    assert sorted(prices.asked) == [("claude-sonnet-4-5", 1), ("claude-sonnet-4-5", 2)]
    assert params["cost"] > 0 and params["r_cost"] > 0
    assert params["usage"]["keys"]["claude-sonnet-4-5"]["executed"]["calls"] == 2


@pytest.mark.parametrize("prices", [
    '{"k": {"input": "three", "output": 1}}', '{"k": {"input": 1}}',
    '{"k": {"input": -1, "output": 1}}', '{"k": {"input": 1, "output": 1, "cached": 1}}',
    '{"k": 3}', '{"": {"input": 1, "output": 1}}',
])
def test_a_bad_price_is_refused(prices: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOMFLOW_WORKER_PRICES", prices)
    with pytest.raises(ValidationError, match="prices"):
        Settings()


def test_money_is_written_for_people() -> None:
    assert format_cost(Decimal("0.00012345")) == "$0.0001"
    assert format_cost(Decimal("1234.5")) == "$1,234.50"
    assert format_cost(Decimal("0.5"), unknown=True) == "$0.5000 + price unknown"
    assert format_cost(Decimal(0), unknown=True) == "price unknown"
    assert format_cost(None) == "price unknown"


def test_a_report_takes_a_duration_or_a_date_and_a_known_group() -> None:
    assert parse_since("2026-12-01").isoformat() == "2026-12-01T00:00:00+00:00"
    assert (parse_since("7d", now=parse_since("2026-12-08")).isoformat()
            == "2026-12-01T00:00:00+00:00")
    with pytest.raises(InvalidInput, match="neither a duration"):
        parse_since("yesterday")
    with pytest.raises(InvalidInput, match="one of agent, key, user, day"):
        usage_params("tenant", parse_since("1d"))


def test_the_counters_take_a_tenant_label_only_when_asked() -> None:
    from prometheus_client import REGISTRY

    from loomflow_worker import metrics

    metrics.setup()
    reply = ("x", [], Usage(input_tokens=100, output_tokens=10), "stop")
    prices = Prices({"m": ModelPrice(input=1, output=1)})

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    plain = {"agent": "a-unit", "model_key": "m", "kind": "input"}
    by_key = {**plain, "fairness_key": "acme"}
    before = (sample("loomflow_worker_model_tokens_total", **plain),
              sample("loomflow_worker_model_tokens_by_fairness_key_total", **by_key))
    model = _Paced(_Model())
    model.usage_key = "m"
    AttemptUsage("a-unit", prices)(model, reply, False)
    AttemptUsage("a-unit", prices, fairness_key="acme")(model, reply, False)
    AttemptUsage("a-unit", prices, fairness_key="acme")(model, reply, True)
    assert sample("loomflow_worker_model_tokens_total", **plain) - before[0] == 200
    assert sample("loomflow_worker_model_tokens_by_fairness_key_total", **by_key) - before[1] == 100
    assert sample("loomflow_worker_model_tokens_replayed_total", agent="a-unit",
                  model_key="m") == 110
    # m is priced by the override, per million tokens: 100 in and 10 out.
    assert sample("loomflow_worker_model_cost_dollars_by_fairness_key_total", agent="a-unit",
                  model_key="m", fairness_key="acme") == pytest.approx(110 / 1_000_000)
