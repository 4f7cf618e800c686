"""The sweeper's recovery: what the fleet lost, found in the ledger and sent
again, in seconds, whatever the broker's visibility timeout.

- a running request whose heartbeat is older than the lease (a frozen
  worker) has its lock connection ended: that fences it and frees its scope;
- the oldest unfinished request of every scope whose lock nobody holds,
  running (its worker died) or queued with a dispatch that looks lost, and
  whose message no live worker says it holds, is dispatched again; in
  batches, so the hundreds of runs of a dead process go in one round trip;
- a request Celery revoked while its message waited is ended.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from .. import metrics, tracing
from ..execution import budgets
from ..execution.pending import Pending
from ..execution.statuses import Status
from ..runtime.conns import SyncConn
from ..runtime.sql import query
from ..settings import Settings
from . import ledger_recovery
from .actions import Action, Note

log = logging.getLogger(__name__)

# Orphans are read a page at a time, for up to RECOVER_BUDGET seconds per
# sweep, and each page is dispatched as one batch (one ledger statement, one
# broker connection).
ORPHANS_PAGE = 500
RECOVER_BUDGET = 5.0
# The next dead worker's runs are due DUE_MARGIN past their lease (on the
# database's clock).
DUE_MARGIN = 0.02



_COPY_LOST_WHY = ("it was running with its session free, and the copy published since it "
                  "ran is in no queue: a worker that took it died before it started it")


def confirm_lost(
    orphans: list[tuple[Pending, str]],
    suspects: dict[str, float],
    now: float,
    confirm: float,
) -> tuple[list[tuple[Pending, str]], dict[str, float]]:
    """Which orphans to dispatch again, and the suspects to remember.

    A running orphan (its worker died) goes at once. A queued one whose
    message looks lost, or a running one whose copy does, must have looked
    lost since ``confirm`` seconds ago (``suspects``: request id -> first
    seen): one a worker has just taken from the broker is counted nowhere
    until its attempt starts."""
    chosen: list[tuple[Pending, str]] = []
    still: dict[str, float] = {}
    for pending, status in orphans:
        if status in (Status.QUEUED, ledger_recovery.COPY_LOST):
            since = suspects.get(pending.request_id, now)
            if now - since < confirm:
                still[pending.request_id] = since
                continue
        chosen.append((pending, status))
    return chosen, still


@dataclass(frozen=True)
class Revokes:
    """How the recovery learns of revokes: ``ids()`` the request ids revoked
    (Celery's worker state: a bounded set, old ones forgotten), ``end`` ends
    those of them still unfinished."""

    ids: Callable[[], set[str]]
    end: Callable[[list[str]], None]


class Recovery:
    """The leader's recovery (see the module's docstring): ``dispatch``
    publishes a batch, ``queue_length`` counts each queue's messages in the
    broker, ``revoked`` learns of revokes and ends the requests revoked while
    their message waited, ``note`` records what it did."""

    def __init__(
        self,
        settings: Settings,
        dispatch: Callable[[list[Pending]], None],
        note: Note,
        queue_length: Callable[[list[str]], dict[str, int | None]] | None = None,
        revoked: Revokes | None = None,
    ) -> None:
        self.settings = settings
        self.dispatch = dispatch
        self.note = note
        self.queue_length = queue_length
        self.revokes = revoked
        self._revoked_seen: set[str] = set()
        # Queued requests that looked lost on the last sweep, since when.
        self._suspects: dict[str, float] = {}
        # When the runs of a worker that just died become orphans (monotonic),
        # as the last sweep found.
        self.next_orphan: float | None = None

    def sweep(self, conn: SyncConn) -> int:
        """One sweep: fence frozen workers, then dispatch again every orphan,
        a page of them at a time (for up to RECOVER_BUDGET seconds), each page
        as one batch; returns how many requests it dispatched again."""
        self.fence(conn)
        self.publish_fair(conn)
        self.publish_budget_waiters(conn)
        waiting = self._waiting(sorted(self.backlog(conn)))
        deadline = time.monotonic() + RECOVER_BUDGET
        suspects, self._suspects = self._suspects, {}
        dispatched = 0
        while True:
            orphans = ledger_recovery.orphans(
                conn, waiting=waiting, default_queue=self.settings.queue,
                after=self.settings.redispatch_after, queued_after=self.settings.handoff_grace,
                held_within=self.held_within, dead_after=2 * self.settings.heartbeat_interval,
                limit=ORPHANS_PAGE)
            # A queued request that looks lost must look lost on two sweeps a
            # moment apart: one a worker has just taken from the broker is
            # counted nowhere until its attempt starts, milliseconds later.
            chosen, still = confirm_lost(
                orphans, suspects,
                time.monotonic(), max(2 * self.settings.sweep_interval, 1.0),
            )
            self._suspects.update(still)
            if chosen:
                self.redispatch(conn, chosen)
            dispatched += len(chosen)
            # Those dispatched are orphans no more: the next page comes after them.
            if len(orphans) < ORPHANS_PAGE or not chosen or time.monotonic() > deadline:
                self.next_orphan = self._orphan_due(conn)
                return dispatched

    def publish_fair(self, conn: SyncConn) -> int:
        """Publish the withheld requests whose fair turn came (the fair_queue
        limit has room, or was removed); how many."""
        turn = ledger_recovery.fair_next(conn)
        if turn:
            self.dispatch(turn)
        return len(turn)

    def publish_budget_waiters(self, conn: SyncConn) -> int:
        """Publish the requests parked on a cost budget that has room again (its
        period rolled over, or it was raised or removed); how many."""
        woken = budgets.wake(conn)
        if woken:
            self.dispatch(woken)
            for pending in woken:
                log.info("sweeper: request %s published: its budget has room again",
                         pending.request_id,
                         extra={"action": "budget_wake", "request": pending.request_id})
                self.note(Action("budget", pending.request_id, "its budget has room again"))
        return len(woken)

    def _waiting(self, queues: list[str]) -> dict[str, int | None]:
        """How many messages the broker holds for each of ``queues`` (``None``:
        unknown). Only a queue's queued requests beyond that many can have lost
        their message; the others wait their turn in a backlog."""
        if self.queue_length is None or not queues:
            return dict.fromkeys(queues)
        try:
            return self.queue_length(queues)
        except Exception:
            return dict.fromkeys(queues)

    def backlog(self, conn: SyncConn) -> dict[str, int]:
        """The queued requests of each queue, parked or not (the fleet's
        backlog, reported as a gauge for autoscalers): every queue the
        sweeper counts the messages of."""
        queued = ledger_recovery.queued_by_queue(conn, self.settings.queue)
        metrics.report_backlog(queued)
        return queued

    def _orphan_due(self, conn: SyncConn) -> float | None:
        """When (on this host's monotonic clock) the next running request
        whose lock nobody holds (its worker just died) becomes an orphan."""
        due = ledger_recovery.next_orphan_in(conn, 2 * self.settings.heartbeat_interval)
        return None if due is None else time.monotonic() + due + DUE_MARGIN

    def redispatch(self, conn: SyncConn, batch: list[tuple[Pending, str]]) -> None:
        """Publish a batch of orphans again: one ledger statement marks them
        dispatched, then their messages go over one broker connection (one
        round trip on Redis). A request parked for a signal that its signal's
        sender published meanwhile is not marked, and not published again. A
        broker that refuses the batch leaves all of it for the next sweep
        (some may then go twice: harmless), and its error is raised."""
        marked = ledger_recovery.mark_swept(
            conn, [pending.request_id for pending, _ in batch], self.settings.handoff_grace)
        batch = [(pending, status) for pending, status in batch if pending.request_id in marked]
        if not batch:
            return
        ids = [pending.request_id for pending, _ in batch]
        try:
            self.dispatch([pending for pending, _ in batch])
        except Exception:
            ledger_recovery.mark_unswept(conn, ids)
            raise
        meter = metrics.get()
        if meter is not None:
            meter.sweeper.labels("redispatch").inc(len(batch))
        for pending, status in batch:
            why = (_COPY_LOST_WHY if status == ledger_recovery.COPY_LOST
                   else f"it was {status} with its session free")
            log.warning(
                "sweeper: dispatched request %s again (%s)", pending.request_id, why,
                extra={"action": "sweeper_redispatch", "request": pending.request_id},
            )
            self.note(Action("redispatch", pending.request_id, why))
            tracing.note(pending.routing, "redispatch", pending.request_id, reason=why)

    def fence(self, conn: SyncConn) -> int:
        """End the lock connections of running requests whose heartbeat is
        older than the lease (a frozen worker): one connection carries many
        runs, and is ended once for all of them. Returns how many requests."""
        by_backend = ledger_recovery.frozen(conn, self.settings.lease_timeout)
        meter = metrics.get()
        for pid, request_ids in by_backend.items():
            # Stalled, not crashed: their attempts end "lost" (committed) before
            # the connection ends. A copy of a request waiting for its lock
            # starts the instant the lock is free, and would find the attempt
            # open and count it a crash.
            ledger_recovery.mark_frozen_lost(
                conn, request_ids, pid, self.settings.lease_timeout)
            conn.execute(query("terminate_backend"), {"pid": pid})
            if meter is not None:
                meter.sweeper.labels("fence").inc(len(request_ids))
            log.warning(
                "sweeper: %d running request(s) stopped their heartbeat for over %gs (%s); "
                "ended their worker's lock connection (pid %s)", len(request_ids),
                self.settings.lease_timeout, ", ".join(request_ids[:5]) + (
                    ", ..." if len(request_ids) > 5 else ""), pid,
                extra={"action": "sweeper_fence", "requests": request_ids, "backend": pid},
            )
            for request_id in request_ids:
                self.note(Action(
                    "fence", request_id,
                    f"no heartbeat for over {self.settings.lease_timeout:g}s; ended its worker's "
                    f"lock connection (pid {pid})"))
        return sum(len(request_ids) for request_ids in by_backend.values())

    @property
    def held_within(self) -> float:
        """How long a worker's word that it holds a message lasts: a few of
        its turns (it says so on each), so a worker that died stops counting."""
        return max(3 * self.settings.sweep_interval, 2 * self.settings.heartbeat_interval)

    def sweep_revoked(self, conn: SyncConn) -> int:
        """End the unfinished requests whose ids Celery revoked (workers learn
        of a revoke at once, but discard its message only when it comes, which
        in a backlog may be much later); returns how many."""
        if self.revokes is None:
            return 0
        revoked = self.revokes.ids()
        fresh = list(revoked - self._revoked_seen)
        # Only ids Celery still keeps (it forgets old ones): a bounded set.
        self._revoked_seen = revoked
        if not fresh:
            return 0
        ids = ledger_recovery.unfinished_among(conn, fresh)
        if ids:
            self.revokes.end(ids)
            for request_id in ids:
                self.note(Action("revoked", request_id, "revoked while its message waited"))
        return len(ids)
