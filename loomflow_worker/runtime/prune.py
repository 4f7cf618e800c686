"""Pruning, with one set of rules for ``runtime.prune()``, ``loomflow-worker
prune`` and the sweeper's retention.

What matches every filter given goes (``before``: written, sent, or
finished, before that moment; ``scope``: of that scope only): journal entries,
streams and checkpoints, undelivered signals, runs made outside Celery
(``direct_runs``), then finished requests (their attempts cascade), and, with no
scope named, fairness keys at rest, whatever their age (nothing withheld, no
weight, not ahead of the fleet's clock: a look would take the key for a new one;
migration 0045). The scopes
of unfinished requests keep their journal: a run parked on a signal for
longer than the cutoff still needs it to resume; and the signals their runs
may take. Unless one scope is named, each scope keeps its epoch bookkeeping,
so a later run never reuses an old epoch. An age is turned into a cutoff on the database's clock
(:func:`cutoff`), the one that stamped what is pruned. The ledger is read and
pruned through the two views its schema defines for this (the scopes with an
unfinished request, the finished requests), so its tables stay its own.

Work goes in batches, each its own short transaction that skips rows a
running step has locked, so a prune never holds up runs for long.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import dict_row

from .conns import SyncConn
from .errors import InvalidInput
from .sql import query

# Each table and its batch query, in the order they are pruned.
_ORDER: tuple[tuple[str, str], ...] = (
    ("journal_steps", "prune_steps"),
    ("journal_streams", "prune_streams"),
    ("checkpoints", "prune_checkpoints"),
    ("signals", "prune_signals"),
    ("direct_runs", "prune_direct_runs"),
    ("runs", "prune_runs"),
    ("fairness_keys", "prune_fairness_keys"),
)
PRUNED_TABLES = tuple(table for table, _ in _ORDER)


def cutoff(conn: SyncConn, older_than: timedelta) -> datetime:
    """The moment ``older_than`` ago on the database's clock (a prune's cutoff:
    a host whose clock is off must not delete what finished a minute ago)."""
    row = conn.cursor(row_factory=dict_row).execute(
        query("prune_cutoff"), {"age": older_than.total_seconds()}
    ).fetchone()
    assert row is not None
    found: datetime = row["cutoff"]
    return found


class Pruner:
    """One prune: what is older than ``before`` (``None``: whatever its age),
    of ``scope`` (``None``: of every scope), ``batch_size`` rows a batch.

    :meth:`run` (a sync connection) and :meth:`arun` (async ones) go on
    until everything is gone; :meth:`run` can stop when a time budget is
    spent, so the sweeper prunes a little on every sweep and carries on
    over the next."""

    def __init__(
        self, before: datetime | None = None, *, scope: str | None = None,
        batch_size: int = 5000,
    ) -> None:
        if batch_size < 1:
            raise InvalidInput(f"batch size must be at least 1, not {batch_size}")
        if before is not None and before.tzinfo is None:
            raise InvalidInput("the prune cutoff must be an aware datetime")
        self.before = before
        self.scope = scope
        self.batch_size = batch_size
        self.totals: dict[str, int] = dict.fromkeys(PRUNED_TABLES, 0)
        self._left = list(_ORDER)

    @property
    def done(self) -> bool:
        return not self._left

    @property
    def total(self) -> int:
        return sum(self.totals.values())

    def params(self, batch: int | None = None) -> dict[str, Any]:
        return {
            "before": None if self.before is None else self.before.timestamp(),
            "cutoff": self.before,
            "scope": self.scope,
            "batch": self.batch_size if batch is None else batch,
        }

    def _deleted(self, table: str, deleted: int) -> tuple[str, int]:
        self.totals[table] += deleted
        if deleted < self.batch_size:
            self._left.pop(0)
        return table, deleted

    def counts(self, conn: SyncConn) -> dict[str, int]:
        """How many rows the prune would delete now, per table."""
        row = conn.cursor(row_factory=dict_row).execute(
            query("prune_counts"), self.params(0)
        ).fetchone()
        assert row is not None
        return {table: int(row[table]) for table in PRUNED_TABLES}

    def step(self, conn: SyncConn) -> tuple[str, int]:
        """Delete one batch; returns ``(table, rows deleted)``."""
        table, name = self._left[0]
        return self._deleted(table, conn.execute(query(name), self.params()).rowcount)

    async def astep(self, conn: AsyncConnection[Any]) -> tuple[str, int]:
        """:meth:`step` on an async connection."""
        table, name = self._left[0]
        cur = await conn.execute(query(name), self.params())
        return self._deleted(table, cur.rowcount)

    def run(
        self,
        conn: SyncConn,
        *,
        budget: float | None = None,
        on_batch: Callable[[str, int], None] | None = None,
    ) -> dict[str, int]:
        """Batches until done, or until ``budget`` seconds were spent; the totals
        so far. ``on_batch(table, rows)`` sees each batch that deleted rows."""
        if not conn.autocommit:
            # Each batch must be its own short transaction.
            raise InvalidInput("prune needs an autocommit connection")
        deadline = None if budget is None else time.monotonic() + budget
        while not self.done:
            table, deleted = self.step(conn)
            if on_batch is not None and deleted:
                on_batch(table, deleted)
            if deadline is not None and time.monotonic() >= deadline:
                break
        return dict(self.totals)

    async def arun(
        self,
        connection: Callable[[], Any],
        *,
        on_batch: Callable[[str, int], None] | None = None,
    ) -> dict[str, int]:
        """:meth:`run` to the end on async connections: ``connection()`` is an
        async context manager lending one (a pool's), each batch taking one in
        turn and in autocommit."""
        while not self.done:
            async with connection() as conn:
                table, deleted = await self.astep(conn)
            if on_batch is not None and deleted:
                on_batch(table, deleted)
        return dict(self.totals)
