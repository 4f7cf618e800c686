"""Tokens, cost, requests and replay savings per agent, fairness key (tenant),
user or day, from the ledger (``loomflow-worker usage``, the console's usage
page), and how money and tokens are written for people."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from ..durations import parse_duration
from ..execution import ledger_reads
from ..runtime.conns import SyncConn
from ..runtime.errors import InvalidInput, translated

#: What a report groups by: agent, fairness key (tenant), user, day (UTC).
GROUPS = ("agent", "key", "user", "day")
#: The window of a report when none is given.
DEFAULT_SINCE = timedelta(days=30)
#: The most groups a report lists (the costliest).
MAX_GROUPS = 10_000


@dataclass(frozen=True)
class UsageRow:
    """One group of a usage report (``grp`` None: requests with no such value,
    e.g. no user)."""

    grp: str | None
    requests: int
    model_calls: int
    input_tokens: int
    output_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int
    cost: Decimal
    price_unknown: bool
    replayed_calls: int
    replayed_tokens: int
    replayed_cost: Decimal

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens + self.cache_read_tokens + \
            self.cache_write_tokens


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """The start of a report's window: a duration back from now (``7d``,
    ``12h``) or a date or time in UTC (``2026-12-01``, ``2026-12-01T08:00``)."""
    now = now or datetime.now(UTC)
    try:
        return now - parse_duration(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidInput(
            f"--since {text!r} is neither a duration (e.g. 7d, 12h) nor a date "
            "(e.g. 2026-12-01, in UTC)") from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def usage_params(by: str, since: datetime, limit: int = MAX_GROUPS) -> dict[str, Any]:
    """The ``usage_report`` query's parameters; a bad group or limit is refused."""
    if by not in GROUPS:
        raise InvalidInput(f"usage is grouped by one of {', '.join(GROUPS)}, not {by!r}")
    if not 1 <= limit <= MAX_GROUPS:
        raise InvalidInput(f"limit must be from 1 to {MAX_GROUPS}, not {limit}")
    return {"by": by, "since": since, "limit": limit}


def usage_report(conn: SyncConn, by: str = "agent", since: datetime | None = None,
                 limit: int = MAX_GROUPS) -> list[UsageRow]:
    """The requests enqueued since ``since`` (default the last 30 days) that
    called a model, grouped ``by`` agent, key, user or day: costliest first,
    days in order."""
    params = usage_params(by, since or datetime.now(UTC) - DEFAULT_SINCE, limit)
    with translated("query"):
        rows = ledger_reads.usage_report(conn, params)
    return ordered(by, [UsageRow(**row) for row in rows])


def ordered(by: str, rows: list[UsageRow]) -> list[UsageRow]:
    """A report's groups in the order people read them: days in order, any
    other group costliest first (as the query gives them)."""
    return sorted(rows, key=lambda r: r.grp or "") if by == "day" else rows


def totals(rows: list[UsageRow]) -> UsageRow:
    """A report's groups added up."""
    def add(name: str) -> Any:
        return sum((getattr(r, name) for r in rows), Decimal(0) if "cost" in name else 0)

    return UsageRow(
        grp=None, requests=add("requests"), model_calls=add("model_calls"),
        input_tokens=add("input_tokens"), output_tokens=add("output_tokens"),
        cache_read_tokens=add("cache_read_tokens"), cache_write_tokens=add("cache_write_tokens"),
        cost=add("cost"), price_unknown=any(r.price_unknown for r in rows),
        replayed_calls=add("replayed_calls"), replayed_tokens=add("replayed_tokens"),
        replayed_cost=add("replayed_cost"))


def format_cost(cost: Decimal | str | None, unknown: bool = False) -> str:
    """Dollars for people: ``$0.0123``, ``$12.40``; with ``unknown`` (some
    call's model has no known price) said so: ``$0.0123 + unknown``, or
    ``unknown`` alone when nothing was priced."""
    if cost is None:
        return "price unknown"
    amount = Decimal(cost)
    if unknown and amount == 0:
        return "price unknown"
    text = f"${amount:,.2f}" if amount >= 1 else f"${amount:.4f}"
    return f"{text} + price unknown" if unknown else text


def format_tokens(count: int) -> str:
    """``1,234,567``."""
    return f"{count:,}"


def usage_said(side: Mapping[str, Any] | None) -> str:
    """An attempt's executed or replayed side (``run_attempts.usage``) for
    people: ``3 calls, 1,234 in / 56 out / 0 cache read / 0 cache write,
    $0.0012``."""
    if not side or not side.get("calls"):
        return "none"
    return (f"{side['calls']} calls, {format_tokens(side['input'])} in / "
            f"{format_tokens(side['output'])} out / {format_tokens(side['cache_read'])} "
            f"cache read / {format_tokens(side['cache_write'])} cache write, "
            f"{format_cost(side.get('cost'))}")
