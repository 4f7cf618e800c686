"""Concurrency limits for the whole fleet: at most N requests in flight per
fairness key, per agent, or per name that agents share.

A limit is a row of ``concurrency_limits`` (``LOOMFLOW_WORKER_LIMITS`` at a
worker's start, ``loomflow-worker limits concurrency`` at run time):

- ``per_key``: each fairness key apart (a request's user; its session when it
  has none), so one tenant's backlog takes at most N runs of the fleet;
- ``agent:NAME``: the runs of one agent;
- any other name: the runs of every agent registered with it
  (``register_agent(..., limits=["anthropic"])``);
- ``fair_queue``: not runs but requests waiting in the broker. Beyond it an
  enqueue records the request withheld, and withheld requests are published
  as room frees in proportion to their fairness keys' weights
  (``loomflow-worker limits weight``, ``FAIRNESS_WEIGHTS``, or a request's
  ``fairness_weight``): a tenant with a few requests starts within a turn
  while another's thousands drain (see ``loomflow_worker_fair_next``). With
  no such limit set the bound is the fleet's free slots, never under a floor
  (``loomflow_worker_fair_depth``): fair shares hold by default; ``0`` turns
  them off.

An instance of a limit (``per_key:alice``, ``agent:research``, ``anthropic``)
has N slots, advisory locks in Postgres: a run takes one of each of its
limits on its lock connection before it starts, and holds it until it ends,
so a crash frees it at once and no count can drift. A request whose limit is
full parks (its message acked: it holds no worker slot and counts no retry),
and the run that frees a slot publishes the oldest request parked there; the
sweeper publishes a parked request whose limit has a free slot when that
handoff was lost.
"""

from __future__ import annotations

import getpass
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from psycopg_pool import AsyncConnectionPool

from ..runtime.conns import SyncConn
from ..runtime.errors import InvalidInput
from ..runtime.keys import slot_lock_keys
from ..runtime.sql import query
from ..settings import Settings
from .budgets import amount_said
from .budgets import params as budget_params
from .cached import AsyncCachedRead
from .registry import agent_limits

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .request import RunRequest

#: How often a process reads the limits again.
REFRESH = 2.0
#: The limit that applies to each fairness key apart.
PER_KEY = "per_key"
#: The limit of requests waiting in the broker, beyond which they wait their
#: fair turn in the ledger.
FAIR_QUEUE = "fair_queue"


@dataclass(frozen=True)
class Bound:
    """One limit instance a request runs under: its name and its slots."""

    instance: str
    slots: list[int]

    @property
    def reason(self) -> str:
        return f"limit {self.instance}"


class Limits:
    """The fleet's concurrency limits as one process reads them."""

    def __init__(self, pool: AsyncConnectionPool[Any],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        # Each limit's slots by its name: read every REFRESH seconds.
        self._sizes: AsyncCachedRead[dict[str, int]] = AsyncCachedRead({}, REFRESH, clock)

    async def bounds(self, req: RunRequest, key: str | None = None) -> list[Bound]:
        """The limit instances ``req`` runs under now (none: no limit applies);
        ``key``: its fairness key as recorded at enqueue (else its default)."""
        sizes = await self._sizes.get(self._read)
        if not sizes:
            return []
        names = [(PER_KEY, f"{PER_KEY}:{key or req.fairness_key}"), (f"agent:{req.agent}", None)]
        names += [(name, None) for name in agent_limits(req.agent)]
        found = []
        for name, instance in names:
            size = sizes.get(name)
            if size is not None:
                found.append(Bound(instance or name, slot_lock_keys(instance or name, size)))
        return found

    async def fair(self) -> bool:
        """Whether requests may wait for their fair turn (unless ``fair_queue``
        is 0): a run's end then publishes the next, if any waits. Looked for
        at every end, not from a cached answer: with no sweeper, a request
        held while a stale answer said none was would wait for ever."""
        return (await self._sizes.get(self._read)).get(FAIR_QUEUE) != 0

    async def _read(self) -> dict[str, int]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(query("concurrency_limits"))
            rows = await cur.fetchall()
        return {row[0]: row[1] for row in rows}


async def take(take_slot: Callable[[list[int]], Awaitable[bool]], bounds: list[Bound]
               ) -> Bound | None:
    """Take a slot of each of ``bounds`` with ``take_slot``; the first that is
    full, if any (the slots taken before it are released with the lease)."""
    for bound in bounds:
        if not await take_slot(bound.slots):
            return bound
    return None


# Which source wins, for a concurrency limit, a fairness weight or a cost
# budget: one set with `loomflow-worker limits` (source "command") holds until
# the command changes it; settings (LIMITS, FAIRNESS_WEIGHTS, BUDGETS) are
# written by every process that has
# them, a worker at its start and any process at its first enqueue, so they
# hold from the first request, and the newest settings win over older ones,
# never over the command. A process whose settings change or lose to what the
# fleet enforces says so in a WARNING; `loomflow-worker limits` shows each
# one's source and who set it.


@dataclass(frozen=True)
class Declared:
    """What one declaration of a process's settings met in the fleet: its
    value and the fleet's, in words (a budget's with its unit and period)."""

    what: str
    mine: str
    was: str | None
    set_by: str | None
    wrote: bool


def _declarations(settings: Settings, by: str) -> list[tuple[str, str, dict[str, Any]]]:
    """Each limit and weight ``settings`` declare: what it is, its query and
    parameters."""
    found: list[tuple[str, str, dict[str, Any]]] = [
        (f"limit {name!r}", "declare_concurrency_limit",
         {"name": name, "max_runs": max_runs, "by": by})
        for name, max_runs in sorted(settings.limits.items())]
    found += [(f"the weight of fairness key {key!r}", "declare_fairness_weight",
               {"fairness_key": key, "weight": weight, "by": by})
              for key, weight in sorted(settings.fairness_weights.items())]
    found += [(f"the budget of {name!r}", "declare_cost_budget",
               {**budget_params(name, budget), "by": by})
              for name, budget in sorted(settings.budgets.items())]
    return found


def _declared(what: str, params: dict[str, Any], row: Any) -> Declared:
    was, set_by, wrote, *unit_period = row if row is not None else (None, None, False)
    if "unit" in params:  # a budget: a change of unit or period is one too
        mine = f"{amount_said(params['amount'], params['unit'])} a {params['period']}"
        if was is not None:
            was = f"{amount_said(was, unit_period[0])} a {unit_period[1]}"
        return Declared(what, mine, was, set_by, bool(wrote))
    mine = next(params[name] for name in ("max_runs", "weight") if name in params)
    return Declared(what, f"{float(mine):g}", None if was is None else f"{float(was):g}",
                    set_by, bool(wrote))


def _say(found: list[Declared], by: str) -> None:
    for d in found:
        if d.was is None or d.was == d.mine:
            continue
        if d.wrote:
            log.warning(
                "%s is now %s, as this process's settings say (%s); it was %s, as the "
                "settings of %s said: the newest settings win", d.what, d.mine, by, d.was,
                d.set_by or "an earlier process", extra={"action": "limit_changed"})
        else:
            log.warning(
                "%s stays %s, set with `loomflow-worker limits` (%s), which holds over "
                "settings; this process's settings say %s: change it with the command, or "
                "remove it there (--none) for settings to apply", d.what, d.was,
                d.set_by or "by the command", d.mine, extra={"action": "limit_kept"})


async def set_limits(pool: AsyncConnectionPool[Any], settings: Settings, by: str) -> None:
    """Declare the concurrency limits and fairness weights ``settings`` give
    (``LIMITS``, ``FAIRNESS_WEIGHTS``), as a worker starts (``by``: the
    process), under the rule above."""
    declarations = _declarations(settings, by)
    if not declarations:
        return
    found = []
    async with pool.connection() as conn:
        for what, name, params in declarations:
            cur = await conn.execute(query(name), params)
            found.append(_declared(what, params, await cur.fetchone()))
    _say(found, by)


def declare(conn: SyncConn, settings: Settings, by: str) -> None:
    """:func:`set_limits` on a sync connection: a process's first enqueue."""
    found = [_declared(what, params, conn.execute(query(name), params).fetchone())
             for what, name, params in _declarations(settings, by)]
    _say(found, by)


@dataclass(frozen=True)
class LimitRow:
    """A concurrency limit as ``loomflow-worker limits`` lists it."""

    name: str
    max_runs: int
    updated_at: Any
    #: "command" (`loomflow-worker limits`) or "settings", and who set it.
    source: str
    set_by: str | None
    waiting: int


def read(conn: SyncConn) -> list[LimitRow]:
    return [LimitRow(*row) for row in conn.execute(query("concurrency_limits")).fetchall()]


def fair_depth(conn: SyncConn) -> int | None:
    """How many requests may wait in the broker now (``None``: fair shares off)."""
    row = conn.execute(query("fair_depth")).fetchone()
    return None if row is None else row[0]


def write(conn: SyncConn, name: str, max_runs: int | None) -> None:
    """Set (``None``: remove) the limit ``name`` for the whole fleet; every
    process reads it within :data:`REFRESH` seconds."""
    if max_runs is None:
        if conn.execute(query("drop_concurrency_limit"), {"name": name}).fetchone() is None:
            raise InvalidInput(f"no concurrency limit is named {name!r}; `loomflow-worker "
                               "limits` lists them")
    else:
        conn.execute(query("set_concurrency_limit"),
                     {"name": name, "max_runs": max_runs, "by": command_by()})


@dataclass(frozen=True)
class WeightRow:
    """A fairness key's weight as ``loomflow-worker limits`` lists it: set for
    the key (``weight``), stated by its requests (``call_weight``), and its
    requests waiting their fair turn."""

    fairness_key: str
    weight: float | None
    call_weight: float | None
    waiting: int
    #: Where ``weight`` came from, as for a limit (``None``: no weight set).
    source: str | None
    set_by: str | None


def read_weights(conn: SyncConn) -> list[WeightRow]:
    return [WeightRow(*row) for row in conn.execute(query("fairness_key_weights")).fetchall()]


def write_weight(conn: SyncConn, key: str, weight: float | None) -> None:
    """Set (``None``: remove) the weight of the fairness key ``key``; the next
    requests published by fair shares use it."""
    conn.execute(query("set_fairness_weight"),
                 {"fairness_key": key, "weight": weight, "by": command_by()})


def command_by() -> str:
    """Who sets a limit with the command: the user and host it runs as."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "?"
    return f"{user}@{socket.gethostname()}"
