"""What one attempt's model calls used and cost, told by the runtime as each
model call's step is journaled (executed: the provider billed it) or replayed
from the journal (not billed again), and written to the ledger with the
attempt's end: no statement per model call.

A request's totals (``runs``) add each attempt's executed calls, and take the
larger of that and what the attempt replayed plus executed: an attempt whose
process was killed never writes its own, and the calls it journaled come back
in the next attempt's replay, so every journaled call counts once. A call in
flight when the process died was not journaled: it runs again and counts once,
though its provider may have billed the first too."""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from .. import metrics
from ..pricing import Prices, Tokens, tokens_of_usage

KINDS = ("input", "output", "cache_read", "cache_write")


def reply_tokens(value: Any) -> Tokens | None:
    """The tokens of a model call's journaled result: a reply (text, tool
    calls, usage, finish reason) or a stream's chunks (the usage of its last
    chunk that has one); ``None`` for any other step's result."""
    from loomflow.core.types import Usage

    if isinstance(value, tuple) and len(value) == 4 and isinstance(value[2], Usage):
        return tokens_of_usage(value[2])
    if isinstance(value, list) and value and all(hasattr(c, "kind") for c in value):
        found = [c.usage for c in value if isinstance(getattr(c, "usage", None), Usage)]
        return tokens_of_usage(found[-1]) if found else None
    return None


def model_of(owner: Any) -> tuple[str, str]:
    """The model key and model name of the model whose method made a step:
    a paced model's key (see ``pacing.pace``), else its name."""
    current, name = owner, None
    for _ in range(4):
        if current is None:
            break
        key = getattr(current, "usage_key", None)
        name = name or _name(current)
        if isinstance(key, str):
            return key, _name(getattr(current, "_inner", None)) or name or key
        current = getattr(current, "inner", None) or getattr(current, "_inner", None)
    return (name or "model")[:64], name or "model"


def _name(model: Any) -> str | None:
    found = getattr(model, "name", None) if model is not None else None
    return found if isinstance(found, str) and found else None


@dataclass(frozen=True)
class Spent:
    """Tokens and their cost (``None``: a price is unknown for some of them)."""

    tokens: Tokens = field(default_factory=Tokens)
    cost: Decimal | None = field(default_factory=Decimal)

    def __add__(self, other: Spent) -> Spent:
        cost = None if self.cost is None or other.cost is None else self.cost + other.cost
        return Spent(self.tokens + other.tokens, cost)


@dataclass
class AttemptUsage:
    """One attempt's model calls: ``__call__`` is the runtime's ``Lease.usage``."""

    agent: str
    prices: Prices
    fairness_key: str | None = None
    # (model key, model name, replayed) -> tokens
    calls: dict[tuple[str, str, bool], Tokens] = field(default_factory=dict)

    def __call__(self, owner: Any, value: Any, replayed: bool) -> None:
        tokens = reply_tokens(value)
        if tokens is None:
            return
        key, model = model_of(owner)
        slot = (key, model, replayed)
        self.calls[slot] = self.calls.get(slot, Tokens()) + tokens
        _count(self, key, model, tokens, replayed)

    def __bool__(self) -> bool:
        return bool(self.calls)

    def _priced(self) -> dict[tuple[str, str, bool], Spent]:
        """Each (model key, model name, replayed)'s tokens and their cost, each
        priced once (a price from the table costs about 0.1 ms to compute)."""
        return {slot: Spent(tokens, self.prices.cost(slot[0], slot[1], tokens))
                for slot, tokens in sorted(self.calls.items())}

    def record(self) -> dict[str, Any]:
        """The attempt's usage as the ledger keeps it (``run_attempts.usage``)."""
        return _record(self._priced())

    def params(self) -> dict[str, Any]:
        """The parameters of ``record_usage`` (see ``ledger.usage_params``)."""
        priced = self._priced()
        executed, replayed = _total(priced, replayed=False), _total(priced, replayed=True)
        return {
            "usage": _record(priced),
            "calls": executed.tokens.calls, "input": executed.tokens.input,
            "output": executed.tokens.output, "cache_read": executed.tokens.cache_read,
            "cache_write": executed.tokens.cache_write,
            "cost": executed.cost or Decimal(0),
            "price_unknown": executed.cost is None or replayed.cost is None,
            "r_calls": replayed.tokens.calls, "r_input": replayed.tokens.input,
            "r_output": replayed.tokens.output, "r_cache_read": replayed.tokens.cache_read,
            "r_cache_write": replayed.tokens.cache_write,
            "r_tokens": replayed.tokens.total, "r_cost": replayed.cost or Decimal(0),
        }


def _total(priced: dict[tuple[str, str, bool], Spent], *, replayed: bool) -> Spent:
    """The tokens and cost of the calls executed (or replayed, ``replayed``)."""
    total = Spent()
    for (_, _, was_replayed), each in priced.items():
        if was_replayed == replayed:
            total += each
    return total


def _record(priced: dict[tuple[str, str, bool], Spent]) -> dict[str, Any]:
    """An attempt's usage as the ledger keeps it, from its calls priced."""
    def side(spent: Spent) -> dict[str, Any]:
        return {**spent.tokens.as_dict(),
                "cost": None if spent.cost is None else str(spent.cost)}

    keys: dict[str, dict[str, Any]] = {}
    for (key, model, replayed), each in priced.items():
        entry = keys.setdefault(key, {"model": model})
        entry["replayed" if replayed else "executed"] = side(each)
    return {"executed": side(_total(priced, replayed=False)),
            "replayed": side(_total(priced, replayed=True)), "keys": keys}


def _count(usage: AttemptUsage, key: str, model: str, tokens: Tokens, replayed: bool) -> None:
    """One model call in the token and cost counters, when metrics are on."""
    meter = metrics.get()
    if meter is None:
        return
    agent, fairness_key = usage.agent, usage.fairness_key
    if replayed:
        meter.model_tokens_replayed.labels(agent, key).inc(tokens.total)
        return
    for kind in KINDS:
        amount = getattr(tokens, kind)
        if amount:
            meter.model_tokens.labels(agent, key, kind).inc(amount)
            if fairness_key is not None:
                meter.model_tokens_by_key.labels(agent, key, kind, fairness_key).inc(amount)
    cost = usage.prices.cost(key, model, tokens)
    if cost is not None:
        meter.model_cost.labels(agent, key).inc(float(cost))
        if fairness_key is not None:
            meter.model_cost_by_key.labels(agent, key, fairness_key).inc(float(cost))
