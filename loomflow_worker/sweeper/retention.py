"""The sweeper's forgetting: with ``retention`` set, the leader prunes journal
entries, checkpoints and finished requests older than it (right after taking
the lead, then every few minutes, a short batch at a time and for a bounded
time per sweep, so recovery keeps its pace while a large backlog goes); and
it deletes the rows of worker processes long gone."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import psycopg

from ..durations import format_duration
from ..runtime.conns import SyncConn
from ..runtime.prune import Pruner, cutoff
from ..runtime.sql import query
from ..settings import Settings
from .actions import Action, Note

log = logging.getLogger(__name__)

# How often the leader starts a prune, how long it may prune per sweep, and
# how many rows each batch (one short transaction) deletes.
PRUNE_EVERY = 300.0
PRUNE_BUDGET = 0.5
PRUNE_BATCH = 1000
# How long a worker process's row (``workers``) outlives its last beat.
FORGET_WORKERS_AFTER = 86400.0



class Retention:
    """The leader's pruning and forgetting; ``note`` records what it did."""

    def __init__(self, settings: Settings, note: Note) -> None:
        self.settings = settings
        self.note = note
        self._pruner: Pruner | None = None
        self._next_prune = 0.0
        self._next_forget = 0.0

    def lead(self) -> None:
        """A new leader prunes and forgets at once: the last one may have
        stopped midway."""
        self._pruner = None
        self._next_prune = 0.0
        self._next_forget = 0.0

    def retain(self, conn: SyncConn, *, budget: float = PRUNE_BUDGET) -> int:
        """Prune what is older than ``retention`` for up to ``budget`` seconds;
        returns the rows deleted. A prune started is carried on over the next
        sweeps until done; the next one starts ``PRUNE_EVERY`` seconds later."""
        retention = self.settings.retention
        if retention <= 0:
            return 0
        if self._pruner is None:
            if time.monotonic() < self._next_prune:
                return 0
            # On the database's clock, whatever this host's says.
            before = cutoff(conn, timedelta(seconds=retention))
            self._pruner = Pruner(before, batch_size=PRUNE_BATCH)
        pruner = self._pruner
        already = pruner.total
        pruner.run(conn, budget=budget)
        if pruner.done:
            self._pruner = None
            self._next_prune = time.monotonic() + PRUNE_EVERY
            if pruner.total:
                self._pruned(pruner, retention)
        return pruner.total - already

    def _pruned(self, pruner: Pruner, retention: float) -> None:
        totals = ", ".join(f"{n} {table}" for table, n in pruner.totals.items() if n)
        log.info("sweeper: pruned what is older than %s: %s", format_duration(retention),
                 totals, extra={"action": "sweeper_prune", **pruner.totals})
        self.note(Action("pruned", detail=f"older than {format_duration(retention)}: {totals}"))

    def forget_workers(self, conn: SyncConn) -> int:
        """Delete the ``workers`` rows of processes not seen for
        FORGET_WORKERS_AFTER (right after taking the lead, then every
        PRUNE_EVERY seconds); returns how many. A failure is only logged."""
        if time.monotonic() < self._next_forget:
            return 0
        self._next_forget = time.monotonic() + PRUNE_EVERY
        try:
            row = conn.execute(query("forget_workers"), {"after": FORGET_WORKERS_AFTER}).fetchone()
            forgot = int(row[0]) if row is not None else 0
        except psycopg.Error as exc:
            log.warning("sweeper: could not forget long-gone workers: %s", exc,
                        extra={"action": "sweeper_forget"})
            return 0
        if forgot > 0:
            self.note(Action(
                "forgot_workers",
                detail=f"{forgot} worker process(es) not seen for "
                       f"{format_duration(FORGET_WORKERS_AFTER)}"))
        return max(forgot, 0)
