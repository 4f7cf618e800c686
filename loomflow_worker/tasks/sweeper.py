"""The sweeper: recovery in seconds, whatever the broker's visibility timeout.

Every worker runs one in its main process; one leads the fleet at a time
(a session advisory lock elects it, and a leader whose lease runs out, a
frozen worker, has its connection ended so another can take over). Each
sweep:

- ends the lock connection of a running request whose heartbeat is older
  than the lease (a frozen worker): that fences it and frees its session;
- dispatches again the oldest unfinished request of every session whose
  lock nobody holds: running (its worker died) or queued with a dispatch
  that looks lost, and whose message no live worker says it holds; in
  batches, so the hundreds of runs of a dead process go in one round trip;
- stores, from the ledger, the results the result backend lacks: refused
  while it was down, left unstored by a worker that died, or lost by the
  backend since (see :mod:`.results`);
- with ``retention`` set, prunes journal entries, checkpoints and finished
  requests older than it: right after taking the lead, then every few
  minutes, a short batch at a time and for a bounded time per sweep, so
  recovery keeps its pace while a large backlog goes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg

from .. import metrics
from ..durations import format_duration
from ..execution import recovery, results_ledger
from ..execution.ledger import Pending
from ..execution.statuses import Status
from ..runtime.prune import Pruner, cutoff
from ..runtime.sql import query
from ..settings import Settings
from .repair import ResultRepair, ResultWatch, store_from_ledger

log = logging.getLogger("loomflow_worker.sweeper")

LEADER_KEY = 0x6C66_7773_7765_6570  # "lfwsweep"

# Retention: how often the leader starts a prune, how long it may prune per
# sweep, and how many rows each batch (one short transaction) deletes.
PRUNE_EVERY = 300.0
PRUNE_BUDGET = 0.5
PRUNE_BATCH = 1000

# What the sweeper keeps of its own actions (``sweeper_actions``, for the
# console): the last KEEP_ACTIONS, none older than KEEP_ACTIONS_FOR seconds;
# and how long a worker process's row (``workers``) outlives its last beat.
KEEP_ACTIONS = 1000
KEEP_ACTIONS_FOR = 86400.0
FORGET_WORKERS_AFTER = 86400.0

# Recovery: orphans are read a page at a time, for up to RECOVER_BUDGET
# seconds per sweep, and each page is dispatched as one batch (one ledger
# statement, one broker connection).
ORPHANS_PAGE = 500
RECOVER_BUDGET = 5.0
# The leader sweeps again when the next dead worker's runs become orphans
# (DUE_MARGIN past their lease, on the database's clock), waiting at least
# MIN_PAUSE, and no longer than the sweep interval.
DUE_MARGIN = 0.02
MIN_PAUSE = 0.05

# A finished request whose worker process still lives stores its own result,
# late when the process is busy: the sweeper checks it only after this long
# (one whose worker is gone, after HANDOFF_GRACE).
RESULT_WAIT_ALIVE = 60.0
# Results are repaired this many at a time, for requests that ended within
# RESULTS_WITHIN seconds.
RESULTS_BATCH = 200
RESULTS_WITHIN = 3600.0


@dataclass(frozen=True)
class Action:
    """One thing the sweeper did, as ``sweeper_actions`` records it."""

    action: str
    request_id: str | None = None
    detail: str = ""


def confirm_lost(
    orphans: list[tuple[Pending, str]],
    suspects: dict[str, float],
    now: float,
    confirm: float,
) -> tuple[list[tuple[Pending, str]], dict[str, float]]:
    """Which orphans to dispatch again, and the suspects to remember.

    A running orphan (its worker died) goes at once. A queued one whose
    message looks lost must have looked lost since ``confirm`` seconds ago
    (``suspects``: request id -> first seen): one a worker has just taken
    from the broker is counted nowhere until its attempt starts."""
    chosen: list[tuple[Pending, str]] = []
    still: dict[str, float] = {}
    for pending, status in orphans:
        if status == Status.QUEUED:
            since = suspects.get(pending.request_id, now)
            if now - since < confirm:
                still[pending.request_id] = since
                continue
        chosen.append((pending, status))
    return chosen, still


class Sweeper:
    def __init__(
        self,
        settings: Settings,
        dispatch: Callable[[list[Pending]], None],
        queue_length: Callable[[list[str]], dict[str, int | None]] | None = None,
        results: ResultRepair | None = None,
        revoked: Callable[[list[str]], None] | None = None,
        held: Callable[[psycopg.Connection[Any]], int] | None = None,
    ) -> None:
        self.settings = settings
        # Stamps the requests this worker holds unstarted (a rate limit, an
        # eta, a prefetch) on every turn, leader or not; returns how many.
        self.held = held
        # Ends requests revoked while their message waits in the broker.
        self.end_revoked = revoked
        self._revoked_seen: set[str] = set()
        self.dispatch = dispatch
        self.results = results
        self.queue_length = queue_length
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: psycopg.Connection[Any] | None = None
        self.leader = False
        self._pruner: Pruner | None = None
        self._next_prune = 0.0
        # Queued requests that looked lost on the last sweep, since when.
        self._suspects: dict[str, float] = {}
        # The result backend refused the last store: said once per outage.
        self._backend_down = False
        # This sweep's actions, recorded at its end (record_actions).
        self.actions: list[Action] = []
        self._next_forget = 0.0
        # When the runs of a worker that just died become orphans (monotonic).
        self._next_orphan: float | None = None
        self._watch = (ResultWatch(results, lambda action, detail: self.actions.append(
            Action(action, detail=detail))) if results is not None else None)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="loomflow-worker sweeper",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._close()

    def _connect(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(
            self.settings.database_url.get_secret_value(),
            autocommit=True,
            connect_timeout=self.settings.connect_timeout,
            keepalives=1, keepalives_idle=5, keepalives_interval=2, keepalives_count=3,
            tcp_user_timeout=15_000,
            application_name="loomflow-worker sweeper",
        )
        self.leader = False
        return conn

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        self.leader = False
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()

    def _loop(self) -> None:
        backoff = self.settings.sweep_interval
        while not self._stop.wait(self._pause(backoff)):
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = self._connect()
                conn = self._conn
                self.stamp_held(conn)
                try:
                    if self._lead(conn):
                        self.sweep_revoked(conn)
                        self.sweep(conn)
                        self.repair_results(conn)
                        self.recheck_results(conn)
                        self.retain(conn)
                        self.forget_workers(conn)
                    else:
                        metrics.report_backlog({})  # the leader reports it
                finally:
                    self.record_actions(conn)
                backoff = self.settings.sweep_interval
            except psycopg.Error as exc:
                log.warning("sweeper: %s; reconnecting", exc, extra={"action": "sweeper_error"})
                self._close()
                backoff = min(backoff * 2, 10.0)
            except Exception:
                log.exception("sweeper failed", extra={"action": "sweeper_error"})
                backoff = min(backoff * 2, 10.0)

    def _pause(self, backoff: float) -> float:
        """How long to wait before the next sweep: ``backoff``, or less when
        the runs of a worker that just died are about to be orphans (the
        leader sweeps the moment their lease runs out, not up to a sweep
        interval later)."""
        due, self._next_orphan = self._next_orphan, None
        if due is None:
            return backoff
        return min(backoff, max(due - time.monotonic(), MIN_PAUSE))

    def _lead(self, conn: psycopg.Connection[Any]) -> bool:
        if not self.leader:
            row = conn.execute(query("leader_lock"), {"key": LEADER_KEY}).fetchone()
            self.leader = bool(row and row[0])
            if not self.leader:
                stale = conn.execute(
                    query("leader_stale"), {"lease": self.settings.lease}
                ).fetchone()
                if stale is not None:
                    # The leader stopped stamping its lease (a frozen worker).
                    conn.execute(query("terminate_backend"), {"pid": stale[0]})
                    log.warning("sweeper: ended a frozen leader's connection (pid %s)",
                                stale[0], extra={"action": "sweeper_takeover"})
                    self.actions.append(Action(
                        "takeover", detail=f"ended a frozen leader's connection (pid {stale[0]})"))
                return False
            log.info("sweeper: leading the fleet from %s", self.holder,
                     extra={"action": "sweeper_leader"})
            self.actions.append(Action("lead", detail=f"leading the fleet from {self.holder}"))
            # A new leader prunes at once: the last one may have stopped midway.
            self._pruner = None
            self._next_prune = 0.0
            self._next_forget = 0.0
            if self._watch is not None:
                self._watch.forget()
        conn.execute(query("leader_claim"), {"holder": self.holder})
        return True

    def stamp_held(self, conn: psycopg.Connection[Any]) -> int:
        """Say, in one statement, which requests this worker holds received and
        not started (a rate limit, an eta, a prefetch): their messages are in
        no queue the broker counts, and the sweeper must not take them for
        lost. Nothing when it holds none; returns how many. A failure other
        than the database's is logged, and the sweep goes on."""
        if self.held is None:
            return 0
        try:
            return self.held(conn)
        except psycopg.Error:
            raise
        except Exception:
            log.exception("sweeper: could not say which messages this worker holds",
                          extra={"action": "sweeper_held"})
            return 0

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

    def backlog(self, conn: psycopg.Connection[Any]) -> dict[str, int]:
        """The queued requests of each queue, parked or not (the fleet's
        backlog, reported as a gauge for autoscalers): every queue the
        sweeper counts the messages of."""
        queued = recovery.queued_by_queue(conn, self.settings.queue)
        metrics.report_backlog(queued)
        return queued

    def repair_results(self, conn: psycopg.Connection[Any]) -> int:
        """Store, from the ledger, the results of finished requests that are not
        in the result backend: those the backend refused (it was down), and
        those whose worker died between its commit and storing it; returns how
        many. While the backend is down, they wait for a later sweep. Never
        those whose caller wants no result (``ignore_result``), nor those
        their worker stored (a caller may have forgotten them since)."""
        if self.results is None:
            return 0
        # A worker that stored a result says so with its next stamp, within a
        # heartbeat interval: only a result still unchecked after that is looked for.
        after = max(self.settings.handoff_grace, 2 * self.settings.heartbeat_interval)
        batches: list[tuple[Callable[[], list[str]], bool, Callable[[list[str]], None]]] = [
            (lambda: results_ledger.unstored(conn, RESULTS_BATCH), False,
             lambda ids: results_ledger.mark_stored(conn, ids)),
            (lambda: results_ledger.unchecked(
                conn, after=after, alive_after=max(after, RESULT_WAIT_ALIVE),
                within=RESULTS_WITHIN, limit=RESULTS_BATCH), True,
             lambda ids: results_ledger.mark_checked(conn, ids, RESULTS_WITHIN)),
        ]
        repaired = 0
        for read, check, mark in batches:
            ids = read()
            if not ids:
                continue
            repaired += self._repair(conn, ids, check, mark)
            if self._backend_down:
                break
        return repaired

    def _repair(self, conn: psycopg.Connection[Any], ids: list[str], check: bool,
                mark: Callable[[list[str]], None]) -> int:
        """Store those of ``ids`` the backend lacks (all of them unless
        ``check``), then ``mark`` those done; returns how many it stored."""
        assert self.results is not None
        try:
            missing = self.results.missing(ids) if check else set(ids)
        except Exception as exc:
            self._backend_unreachable(exc)
            return 0
        stored: list[tuple[str, str]] = []
        try:
            store_from_ledger(conn, self.results, [i for i in ids if i in missing], stored)
            # The rest were there already, their request is gone, or its
            # result's lifetime is over.
            checked = ids
            self._backend_down = False
        except psycopg.Error:
            raise
        except Exception as exc:
            checked = [request_id for request_id, _ in stored]
            self._backend_unreachable(exc)
        for request_id, status in stored:
            log.warning(
                "sweeper: stored the %s result of request %s, which its worker "
                "could not store", status, request_id,
                extra={"action": "sweeper_result", "request": request_id},
            )
            self.actions.append(Action(
                "result_stored", request_id,
                f"stored its {status} result, which its worker could not store"))
        if checked:
            mark(checked)
        return len(stored)

    def recheck_results(self, conn: psycopg.Connection[Any]) -> int:
        """Store again, from the ledger, the results the backend lost after
        they were stored (it restarted empty, say; see :mod:`.results`), for a
        bounded time per sweep; returns how many. While the backend is down,
        they wait for a later sweep."""
        if self._watch is None:
            return 0
        try:
            restored = self._watch.look(conn)
        except psycopg.Error:
            raise
        except Exception as exc:
            self._backend_unreachable(exc)
            return 0
        self._backend_down = False
        return restored

    def _backend_unreachable(self, exc: Exception) -> None:
        """Results wait in the ledger while the backend is down: said once per outage."""
        if not self._backend_down:
            log.warning("sweeper: the result backend is unreachable (%s); "
                        "results wait in the ledger", exc,
                        extra={"action": "sweeper_result_wait"})
        self._backend_down = True

    def sweep_revoked(self, conn: psycopg.Connection[Any]) -> int:
        """End the unfinished requests whose ids Celery revoked (workers learn
        of a revoke at once, but discard its message only when it comes, which
        in a backlog may be much later); returns how many."""
        if self.end_revoked is None:
            return 0
        from celery.worker import state

        revoked = set(state.revoked)
        fresh = list(revoked - self._revoked_seen)
        # Only ids Celery still keeps (it forgets old ones): a bounded set.
        self._revoked_seen = revoked
        if not fresh:
            return 0
        ids = recovery.unfinished_among(conn, fresh)
        if ids:
            self.end_revoked(ids)
            self.actions.extend(
                Action("revoked", request_id, "revoked while its message waited")
                for request_id in ids)
        return len(ids)

    def sweep(self, conn: psycopg.Connection[Any]) -> int:
        """One sweep: fence frozen workers, then dispatch again every orphan,
        a page of them at a time (for up to RECOVER_BUDGET seconds), each page
        as one batch; returns how many requests it dispatched again."""
        self.fence(conn)
        waiting = self._waiting(sorted(self.backlog(conn)))
        deadline = time.monotonic() + RECOVER_BUDGET
        suspects, self._suspects = self._suspects, {}
        dispatched = 0
        while True:
            orphans = recovery.orphans(
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
                self._next_orphan = self._orphan_due(conn)
                return dispatched

    def _orphan_due(self, conn: psycopg.Connection[Any]) -> float | None:
        """When (on this host's monotonic clock) the next running request
        whose lock nobody holds (its worker just died) becomes an orphan."""
        due = recovery.next_orphan_in(conn, 2 * self.settings.heartbeat_interval)
        return None if due is None else time.monotonic() + due + DUE_MARGIN

    def redispatch(self, conn: psycopg.Connection[Any], batch: list[tuple[Pending, str]]) -> None:
        """Publish a batch of orphans again: one ledger statement marks them
        dispatched, then their messages go over one broker connection (one
        round trip on Redis). A broker that refuses the batch leaves all of
        it for the next sweep (some may then go twice: harmless), and its
        error is raised."""
        ids = [pending.request_id for pending, _ in batch]
        recovery.mark_swept(conn, ids)
        try:
            self.dispatch([pending for pending, _ in batch])
        except Exception:
            recovery.mark_unswept(conn, ids)
            raise
        meter = metrics.get()
        if meter is not None:
            meter.sweeper.labels("redispatch").inc(len(batch))
        for pending, status in batch:
            log.warning(
                "sweeper: dispatched request %s again (it was %s with its session free)",
                pending.request_id, status,
                extra={"action": "sweeper_redispatch", "request": pending.request_id},
            )
            self.actions.append(Action(
                "redispatch", pending.request_id, f"it was {status} with its session free"))

    def fence(self, conn: psycopg.Connection[Any]) -> int:
        """End the lock connections of running requests whose heartbeat is
        older than the lease (a frozen worker): one connection carries many
        runs, and is ended once for all of them. Returns how many requests."""
        by_backend = recovery.frozen(conn, self.settings.lease)
        meter = metrics.get()
        for pid, request_ids in by_backend.items():
            conn.execute(query("terminate_backend"), {"pid": pid})
            # Stalled, not crashed: their next attempts must not count a crash.
            recovery.mark_frozen_lost(conn, request_ids)
            if meter is not None:
                meter.sweeper.labels("fence").inc(len(request_ids))
            log.warning(
                "sweeper: %d running request(s) stopped their heartbeat for over %gs (%s); "
                "ended their worker's lock connection (pid %s)", len(request_ids),
                self.settings.lease, ", ".join(request_ids[:5]) + (
                    ", ..." if len(request_ids) > 5 else ""), pid,
                extra={"action": "sweeper_fence", "requests": request_ids, "backend": pid},
            )
            self.actions.extend(
                Action("fence", request_id,
                       f"no heartbeat for over {self.settings.lease:g}s; ended its worker's "
                       f"lock connection (pid {pid})")
                for request_id in request_ids)
        return sum(len(request_ids) for request_ids in by_backend.values())

    @property
    def held_within(self) -> float:
        """How long a worker's word that it holds a message lasts: a few of
        its turns (it says so on each), so a worker that died stops counting."""
        return max(3 * self.settings.sweep_interval, 2 * self.settings.heartbeat_interval)

    def retain(self, conn: psycopg.Connection[Any], *, budget: float = PRUNE_BUDGET) -> int:
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
                log.info(
                    "sweeper: pruned what is older than %s: %s",
                    format_duration(retention),
                    ", ".join(f"{n} {table}" for table, n in pruner.totals.items() if n),
                    extra={"action": "sweeper_prune", **pruner.totals},
                )
                self.actions.append(Action(
                    "pruned", detail=f"older than {format_duration(retention)}: " + ", ".join(
                        f"{n} {table}" for table, n in pruner.totals.items() if n)))
        return pruner.total - already

    def forget_workers(self, conn: psycopg.Connection[Any]) -> int:
        """Delete the ``workers`` rows of processes not seen for
        FORGET_WORKERS_AFTER (right after taking the lead, then every
        PRUNE_EVERY seconds); returns how many. A failure is only logged."""
        if time.monotonic() < self._next_forget:
            return 0
        self._next_forget = time.monotonic() + PRUNE_EVERY
        try:
            forgot = conn.execute(
                query("forget_workers"), {"after": FORGET_WORKERS_AFTER}).rowcount
        except psycopg.Error as exc:
            log.warning("sweeper: could not forget long-gone workers: %s", exc,
                        extra={"action": "sweeper_forget"})
            return 0
        if forgot > 0:
            self.actions.append(Action(
                "forgot_workers",
                detail=f"{forgot} worker process(es) not seen for "
                       f"{format_duration(FORGET_WORKERS_AFTER)}"))
        return max(forgot, 0)

    def record_actions(self, conn: psycopg.Connection[Any]) -> None:
        """Record this sweep's actions in ``sweeper_actions`` (one statement,
        which also drops the oldest). A failure is only logged: the actions
        are in the log and the metrics too."""
        actions, self.actions = self.actions, []
        if not actions:
            return
        try:
            conn.execute(query("record_sweeper_actions"), {
                "worker": self.holder,
                "actions": [a.action for a in actions],
                "request_ids": [a.request_id for a in actions],
                "details": [a.detail for a in actions],
                "keep": KEEP_ACTIONS, "keep_for": KEEP_ACTIONS_FOR,
            })
        except psycopg.Error as exc:
            log.warning("sweeper: could not record %d action(s): %s", len(actions), exc,
                        extra={"action": "sweeper_record"})
