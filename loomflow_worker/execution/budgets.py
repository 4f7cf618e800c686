"""Cost budgets for the whole fleet: a fairness key's (a tenant's) or an
agent's tokens or US dollars per UTC calendar day or month.

A budget is a row of ``cost_budgets`` (``LOOMFLOW_WORKER_BUDGETS`` at a
worker's start and a process's first enqueue, ``loomflow-worker limits
budget`` at run time), named by the fairness key, or ``agent:NAME``.

- Spending: the statement that records an attempt's usage as it ends
  (``record_usage``) adds what the request's totals grew by to its key's and
  its agent's budgets: no statement per model call, and a replayed call is
  not spent twice. A run under way is never stopped: it finishes, even past
  its budget.
- At an attempt's start a request whose key or agent has budgets looks at
  them in one statement (``park_on_budget``), which parks it when one is
  spent: its message acked, it holds no worker slot and counts no retry, and
  ``show`` says what it waits for. A process knows which keys and agents have
  budgets from a read made every :data:`REFRESH` seconds, so a request of
  one without costs no statement at all.
- Waking: a budget has room again when its period rolls over (by the
  clock: ``loomflow_worker_budget_spent`` counts the current period only) or
  it is raised or removed. The sweeper's leader publishes the requests parked
  on such a budget each sweep, and the command at once.
- Refusing: a budget with ``over: refuse`` makes an enqueue of its key or
  agent raise :class:`~.errors.OverBudget` while it is spent, before anything
  is written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from psycopg.rows import class_row, dict_row
from psycopg_pool import AsyncConnectionPool

from ..runtime.conns import Conn, SyncConn
from ..runtime.errors import InvalidInput
from ..runtime.sql import query
from ..settings import Budget
from .cached import AsyncCachedRead, CachedRead
from .pending import Pending
from .request_errors import OverBudget

log = logging.getLogger(__name__)

#: How often a process reads which keys and agents have budgets.
REFRESH = 2.0
#: The most parked requests one wake publishes.
WAKE_PAGE = 500


def names_of(fairness_key: str | None, agent: str) -> list[str]:
    """The names of the budgets a request of ``fairness_key`` and ``agent`` spends from."""
    return ([fairness_key] if fairness_key else []) + [f"agent:{agent}"]


class CostBudgets:
    """The fleet's cost budgets as one worker process reads them."""

    def __init__(self, pool: AsyncConnectionPool[Any],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        # Each budget's name, and what an enqueue does when it is spent.
        self._names: AsyncCachedRead[dict[str, str]] = AsyncCachedRead({}, REFRESH, clock)

    async def applying(self, fairness_key: str | None, agent: str) -> list[str]:
        """The budgets a request of ``fairness_key`` and ``agent`` spends from
        (none: no statement at its start)."""
        names = await self._names.get(self._read)
        return [name for name in names_of(fairness_key, agent) if name in names]

    async def _read(self) -> dict[str, str]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(query("budget_names"))
            return {str(name): str(over) for name, over in await cur.fetchall()}


@dataclass(frozen=True)
class Spent:
    """The budget a request parked on, in words."""

    budget: str
    said: str


async def park_if_spent(conn: Conn, request_id: str, names: list[str],
                        options: dict[str, Any] | None) -> Spent | None:
    """Park the request when one of the budgets ``names`` is spent for its
    period (see ``park_on_budget``); which one, or ``None``: it may run."""
    from psycopg.types.json import Jsonb

    cur = await conn.execute(query("park_on_budget"), {
        "request_id": request_id, "names": names,
        "options": Jsonb(options) if options is not None else None})
    row = await cur.fetchone()
    return None if row is None else Spent(str(row[0]), str(row[1]))


def wake(conn: SyncConn, names: list[str] | None = None) -> list[Pending]:
    """The requests parked on a budget with room now (among ``names``; ``None``:
    any), marked published: the caller publishes them."""
    rows = conn.cursor(row_factory=dict_row).execute(
        query("wake_budget_waiters"), {"names": names, "limit": WAKE_PAGE}).fetchall()
    return [Pending.of(row) for row in rows]


#: Which budgets refuse requests while spent, as enqueues read them (every few
#: seconds; ``forget()``: at the next enqueue).
REFUSING: CachedRead[frozenset[str]] = CachedRead(frozenset())


def refuse_if_spent(conn: SyncConn, fairness_key: str, agent: str) -> None:
    """Raise :class:`OverBudget` when a budget of ``fairness_key`` or ``agent``
    that refuses requests is spent (one statement, only when such a budget
    exists)."""
    refusing = REFUSING.get(lambda: frozenset(
        str(name) for name, over in conn.execute(query("budget_names")).fetchall()
        if over == "refuse"))
    names = [name for name in names_of(fairness_key, agent) if name in refusing]
    if not names:
        return
    row = conn.execute(query("budget_refusal"), {"names": names}).fetchone()
    if row is not None:
        raise OverBudget(str(row[0]), str(row[1]))


@dataclass(frozen=True)
class BudgetRow:
    """A budget as ``loomflow-worker limits`` lists it."""

    name: str
    amount: Decimal
    unit: str
    period: str
    over: str
    #: What it spent in the current period, and when that period ends.
    spent: Decimal
    resets_at: datetime
    updated_at: datetime
    #: "command" (`loomflow-worker limits budget`) or "settings", and who set it.
    source: str
    set_by: str | None
    waiting: int


    @property
    def amount_text(self) -> str:
        return amount_said(self.amount, self.unit)

    @property
    def spent_text(self) -> str:
        return amount_said(self.spent, self.unit)


def read(conn: SyncConn) -> list[BudgetRow]:
    """Every budget, as ``limits`` lists it."""
    return conn.cursor(row_factory=class_row(BudgetRow)).execute(query("cost_budgets")).fetchall()


async def read_async(conn: Conn) -> list[BudgetRow]:
    """:func:`read` on an async connection: the console's fleet page."""
    cur = conn.cursor(row_factory=class_row(BudgetRow))
    await cur.execute(query("cost_budgets"))
    return await cur.fetchall()


@dataclass(frozen=True)
class Change:
    """A budget as ``limits budget`` set it, beside what it was (``was_*``:
    ``None`` when it was not set): :meth:`said` puts it in words."""

    name: str
    budget: Budget
    was_amount: Decimal | None
    was_unit: str | None
    was_period: str | None
    was_over: str | None
    #: What it had spent in its period as it was, and in its period now.
    was_spent: Decimal | None
    spent: Decimal
    resets_at: datetime

    @property
    def changed(self) -> bool:
        """Whether a budget was set and this changed its amount, unit, period or action."""
        return self.was_amount is not None and (
            self.was_amount, self.was_unit, self.was_period, self.was_over) != (
            self.budget.amount, self.budget.unit, self.budget.period, self.budget.over)

    def said(self) -> str | None:
        """The change in words (``None``: nothing changed): ``was 1,000 tokens a
        day, now $5.00 a month; spent so far this month: $0 (...); the period
        rolls over ...``.
        A spend is said in its own unit only: one in tokens is not one in dollars."""
        if not self.changed:
            return None
        assert self.was_unit is not None and self.was_amount is not None
        assert self.was_period is not None and self.was_spent is not None
        new = self.budget
        was = f"{amount_said(self.was_amount, self.was_unit)} a {self.was_period}"
        if self.was_over != new.over:
            was += f" ({_over_said(self.was_over)})"
        now = f"{amount_said(new.amount, new.unit)} a {new.period}"
        if self.was_over != new.over:
            now += f" ({_over_said(new.over)})"
        why = ""
        spent_before = amount_said(self.was_spent, self.was_unit)
        if self.was_unit != new.unit:
            why = (f" (the {spent_before} it spent {_this(self.was_period)} are not counted: "
                   f"a spend in {self.was_unit} is none in {new.unit})")
        elif self.was_period != new.period and self.spent != self.was_spent:
            why = (f" (the {spent_before} it spent {_this(self.was_period)} are not split "
                   "by day)")
        elif self.was_period == "day" and new.period == "month" and self.spent:
            why = " (today's spend only: a daily budget kept no count of the month's other days)"
        return (f"was {was}, now {now}; spent so far {_this(new.period)}: "
                f"{amount_said(self.spent, new.unit)}{why}; the period rolls over "
                f"{self.resets_at:%Y-%m-%d %H:%M} UTC")


def _this(period: str) -> str:
    return "today" if period == "day" else "this month"


def _over_said(over: str | None) -> str:
    return "requests wait while spent" if over == "wait" else "enqueues refused while spent"


def write(conn: SyncConn, name: str, budget: Budget | None, by: str) -> Change | None:
    """Set (``None``: remove) the budget ``name`` for the whole fleet; every
    process applies it within :data:`REFRESH` seconds. A set budget comes back
    beside what it was; a change is logged (action ``budget_changed``)."""
    if budget is None:
        if conn.execute(query("drop_cost_budget"), {"name": name}).fetchone() is None:
            raise InvalidInput(f"no budget is named {name!r}; `loomflow-worker limits` "
                               "lists them")
        return None
    row = conn.cursor(row_factory=dict_row).execute(
        query("set_cost_budget"), {**params(name, budget), "by": by}).fetchone()
    assert row is not None
    change = Change(name=name, budget=budget, **row)
    said = change.said()
    if said is not None:
        log.info("budget %r changed by %s: %s", name, by, said,
                 extra={"action": "budget_changed", "budget": name})
    return change


def params(name: str, budget: Budget) -> dict[str, Any]:
    """A budget's columns, for ``set_cost_budget`` and ``declare_cost_budget``."""
    return {"name": name, "amount": budget.amount, "unit": budget.unit,
            "period": budget.period, "when_over": budget.over}


def amount_said(amount: Decimal, unit: str) -> str:
    """An amount as ``limits`` shows it: ``1,000,000 tokens``, ``$50.00``."""
    if unit == "tokens":
        return f"{int(amount):,} tokens"
    return f"${amount.quantize(Decimal('0.01')) if amount >= 1 else amount.normalize():,}"
