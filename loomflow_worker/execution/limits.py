"""Concurrency limits for the whole fleet: at most N requests in flight per
fairness key, per agent, or per name that agents share.

A limit is a row of ``concurrency_limits`` (``LOOMFLOW_WORKER_LIMITS`` at a
worker's start, ``loomflow-worker limits concurrency`` at run time):

- ``per_key``: each fairness key apart (a request's user; its session when it
  has none), so one tenant's backlog takes at most N runs of the fleet;
- ``agent:NAME``: the runs of one agent;
- any other name: the runs of every agent registered with it
  (``register_agent(..., limits=["anthropic"])``);
- ``fair_queue``: not runs but requests waiting in the broker. With it set, an
  enqueue beyond it records the request held back, and held requests are
  published as room frees in proportion to their fairness keys' weights
  (``loomflow-worker limits weight``, ``FAIRNESS_WEIGHTS``, or a request's
  ``fairness_weight``): a tenant with a few requests starts within a turn
  while another's thousands drain (see ``loomflow_worker_fair_next``).

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

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from ..runtime.errors import InvalidInput
from ..runtime.keys import slot_lock_keys
from ..runtime.sql import query
from ..settings import Settings
from .cached import AsyncCachedRead
from .registry import agent_limits

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
        """Whether requests wait for their fair turn (``fair_queue`` is set)."""
        return FAIR_QUEUE in await self._sizes.get(self._read)

    async def _read(self) -> dict[str, int]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(query("concurrency_limits"))
            rows = await cur.fetchall()
        return {name: max_runs for name, max_runs, _, _ in rows}


async def take(take_slot: Callable[[list[int]], Awaitable[bool]], bounds: list[Bound]
               ) -> Bound | None:
    """Take a slot of each of ``bounds`` with ``take_slot``; the first that is
    full, if any (the slots taken before it are released with the lease)."""
    for bound in bounds:
        if not await take_slot(bound.slots):
            return bound
    return None


async def set_limits(pool: AsyncConnectionPool[Any], settings: Settings) -> None:
    """Write the concurrency limits and fairness weights ``settings`` give
    (``LIMITS``, ``FAIRNESS_WEIGHTS``), as a worker starts: a deploy's sizes
    and weights replace those set at run time."""
    if not settings.limits and not settings.fairness_weights:
        return
    async with pool.connection() as conn:
        for name, max_runs in sorted(settings.limits.items()):
            await conn.execute(query("set_concurrency_limit"),
                               {"name": name, "max_runs": max_runs})
        for key, weight in sorted(settings.fairness_weights.items()):
            await conn.execute(query("set_fairness_weight"),
                               {"fairness_key": key, "weight": weight})


@dataclass(frozen=True)
class LimitRow:
    """A concurrency limit as ``loomflow-worker limits`` lists it."""

    name: str
    max_runs: int
    updated_at: Any
    waiting: int


def read(conn: psycopg.Connection[Any]) -> list[LimitRow]:
    return [LimitRow(*row) for row in conn.execute(query("concurrency_limits")).fetchall()]


def write(conn: psycopg.Connection[Any], name: str, max_runs: int | None) -> None:
    """Set (``None``: remove) the limit ``name`` for the whole fleet; every
    process reads it within :data:`REFRESH` seconds."""
    if max_runs is None:
        if conn.execute(query("drop_concurrency_limit"), {"name": name}).fetchone() is None:
            raise InvalidInput(f"no concurrency limit is named {name!r}; `loomflow-worker "
                               "limits` lists them")
    else:
        conn.execute(query("set_concurrency_limit"), {"name": name, "max_runs": max_runs})


@dataclass(frozen=True)
class WeightRow:
    """A fairness key's weight as ``loomflow-worker limits`` lists it: set for
    the key (``weight``), stated by its requests (``call_weight``), and its
    requests waiting their fair turn."""

    fairness_key: str
    weight: float | None
    call_weight: float | None
    waiting: int


def read_weights(conn: psycopg.Connection[Any]) -> list[WeightRow]:
    return [WeightRow(*row) for row in conn.execute(query("fairness_key_weights")).fetchall()]


def write_weight(conn: psycopg.Connection[Any], key: str, weight: float | None) -> None:
    """Set (``None``: remove) the weight of the fairness key ``key``; the next
    requests published by fair shares use it."""
    conn.execute(query("set_fairness_weight"), {"fairness_key": key, "weight": weight})
