"""What a model call cost: tokens priced by the maintained price table of
``genai-prices`` (pydantic's, updated with each provider's price changes and
shipped with the package: no network at run time), or by the prices settings
give a model key (``LOOMFLOW_WORKER_PRICES``, negotiated prices), which win.

Token kinds follow loomflow's :class:`~loomflow.core.types.Usage`: ``input``
is the prompt billed at the full input rate, ``cache_read`` the prompt served
from the provider's cache, ``cache_write`` the prompt written to it, and
``output`` the completion. A model with no known price has no cost
(``None``): its tokens are counted all the same, and reports say its price
is unknown rather than count it as free."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache
from typing import Any

from .settings import ModelPrice

log = logging.getLogger(__name__)

MILLION = Decimal(1_000_000)


@dataclass(frozen=True)
class Tokens:
    """Tokens of some model calls, by kind, and how many calls."""

    calls: int = 0
    input: int = 0
    output: int = 0
    cache_read: int = 0
    cache_write: int = 0

    @property
    def total(self) -> int:
        return self.input + self.output + self.cache_read + self.cache_write

    def __add__(self, other: Tokens) -> Tokens:
        return Tokens(self.calls + other.calls, self.input + other.input,
                      self.output + other.output, self.cache_read + other.cache_read,
                      self.cache_write + other.cache_write)

    def as_dict(self) -> dict[str, int]:
        return {"calls": self.calls, "input": self.input, "output": self.output,
                "cache_read": self.cache_read, "cache_write": self.cache_write}

    @classmethod
    def of_dict(cls, value: Mapping[str, Any]) -> Tokens:
        return cls(**{name: int(value.get(name) or 0) for name in
                      ("calls", "input", "output", "cache_read", "cache_write")})


def tokens_of_usage(usage: Any) -> Tokens | None:
    """One model call's tokens, from loomflow's ``Usage`` (``None``: none reported)."""
    if usage is None:
        return None
    return Tokens(
        calls=1,
        input=int(getattr(usage, "input_tokens", 0) or 0),
        output=int(getattr(usage, "output_tokens", 0) or 0),
        cache_read=int(getattr(usage, "cached_input_tokens", 0) or 0),
        cache_write=int(getattr(usage, "cache_write_tokens", 0) or 0),
    )


def price_by_override(price: ModelPrice, tokens: Tokens) -> Decimal:
    """What ``tokens`` cost at ``price`` (dollars per million tokens)."""
    cache_read = price.input if price.cache_read is None else price.cache_read
    cache_write = price.input if price.cache_write is None else price.cache_write
    per_million = (Decimal(str(price.input)) * tokens.input
                   + Decimal(str(price.output)) * tokens.output
                   + Decimal(str(cache_read)) * tokens.cache_read
                   + Decimal(str(cache_write)) * tokens.cache_write)
    return per_million / MILLION


def price_by_table(model: str, tokens: Tokens) -> Decimal | None:
    """What ``tokens`` of one call of ``model`` (a model name, optionally
    ``provider:name``) cost by genai-prices' table; ``None`` for a model it
    does not know. The table counts cache reads and writes inside its input
    tokens, loomflow apart: they are added back."""
    if not _known(model):
        return None
    from genai_prices import Usage, calc_price

    provider, ref = _split(model)
    usage = Usage(input_tokens=tokens.input + tokens.cache_read + tokens.cache_write,
                  output_tokens=tokens.output, cache_read_tokens=tokens.cache_read,
                  cache_write_tokens=tokens.cache_write)
    return Decimal(calc_price(usage, model_ref=ref, provider_id=provider).total_price)


@lru_cache(maxsize=256)
def _known(model: str) -> bool:
    from genai_prices import Usage, calc_price

    provider, ref = _split(model)
    try:
        calc_price(Usage(input_tokens=1), model_ref=ref, provider_id=provider)
    except LookupError:
        log.info("no known price for model %r: its tokens are counted, its cost is not "
                 "(give it one in LOOMFLOW_WORKER_PRICES)", model,
                 extra={"action": "price_unknown", "model": model})
        return False
    return True


def _split(model: str) -> tuple[str | None, str]:
    provider, sep, ref = model.partition(":")
    return (provider, ref) if sep and ref else (None, model)


class Prices:
    """Prices of model calls by model key: the settings' override for the key
    (or for the model's name), else genai-prices' table by the model's name."""

    def __init__(self, overrides: Mapping[str, ModelPrice]) -> None:
        self.overrides = dict(overrides)

    def cost(self, key: str, model: str, tokens: Tokens) -> Decimal | None:
        """What ``tokens`` of model key ``key`` (a call of model ``model``)
        cost in US dollars; ``None``: the price is unknown."""
        override = self.overrides.get(key) or self.overrides.get(model)
        if override is not None:
            return price_by_override(override, tokens)
        if tokens.total == 0:
            return Decimal(0)
        return price_by_table(model, tokens)
