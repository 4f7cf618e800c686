"""The sweeper: recovery in seconds, whatever the broker's visibility timeout.

Every worker runs one in its main process; one leads the fleet at a time
(a session advisory lock elects it, and a leader whose lease runs out, a
frozen worker, has its connection ended so another can take over). Each
sweep, the leader:

- ends requests revoked while their message waited, fences frozen workers
  and dispatches again the requests whose worker or message is gone
  (:mod:`.recovery`);
- stores, from the ledger, the results the result backend lacks: refused
  while it was down, left unstored by a worker that died, or lost by the
  backend since (:mod:`.result_repair`);
- with ``retention`` set, prunes what is older than it, and forgets worker
  processes long gone (:mod:`.retention`);
- counts the requests waiting for a version of their agent, says so when no
  live worker serves it, and applies its agent's on_version_gone policy (the
  version watch the worker's Celery binding gives it, a :class:`Watch`);

and records what it did in ``sweeper_actions``, for the console. Every
worker, leader or not, says on each turn which messages it holds unstarted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

import psycopg

from .. import metrics
from ..execution import ledger
from ..execution.pending import Pending
from ..runtime.conns import SyncConn
from ..runtime.sql import query
from ..settings import Settings
from .actions import Action
from .recovery import Recovery, Revokes
from .result_repair import ResultRepairer
from .result_watch import ResultBackend
from .retention import Retention

log = logging.getLogger(__name__)

LEADER_KEY = 0x6C66_7773_7765_6570  # "lfwsweep"

# What the sweeper keeps of its own actions (``sweeper_actions``, for the
# console): the last KEEP_ACTIONS, none older than KEEP_ACTIONS_FOR seconds.
KEEP_ACTIONS = 1000
KEEP_ACTIONS_FOR = 86400.0

# The leader sweeps again when the next dead worker's runs become orphans,
# waiting at least MIN_PAUSE, and no longer than the sweep interval.
MIN_PAUSE = 0.05


class Watch(Protocol):
    """A watch the leader keeps each turn beside its own jobs: the worker's
    over agent versions (``VersionWatch``), which knows the Celery binding's
    upgrade and cancel."""

    def watch(self, conn: SyncConn) -> int:
        """One look; how many things it read."""
        ...


class Sweeper:
    """The loop: ``dispatch``, ``queue_length`` and ``revoked`` serve the
    recovery, ``results`` the result repair (none: no repair), ``versions``
    watches agent versions (none: no watch), ``held`` stamps the requests this
    worker holds unstarted."""

    def __init__(
        self,
        settings: Settings,
        dispatch: Callable[[list[Pending]], None],
        queue_length: Callable[[list[str]], dict[str, int | None]] | None = None,
        results: ResultBackend | None = None,
        revoked: Revokes | None = None,
        held: Callable[[SyncConn], int] | None = None,
        versions: Watch | None = None,
    ) -> None:
        self.settings = settings
        # Stamps the requests this worker holds unstarted (a rate limit, an
        # eta, a prefetch) on every turn, leader or not; returns how many.
        self.held = held
        # This worker process, as the leader's row and the actions name it
        # (the column sweeper_leader.holder keeps its stored name).
        self.worker = ledger.worker_name(socket.gethostname(), os.getpid())
        # This sweep's actions, recorded at its end (record_actions).
        self.actions: list[Action] = []
        self.recovery = Recovery(settings, dispatch, self.actions.append,
                                 queue_length=queue_length, revoked=revoked)
        self.repair = (ResultRepairer(settings, results, self.actions.append)
                       if results is not None else None)
        self.retention = Retention(settings, self.actions.append)
        self.versions = versions
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: SyncConn | None = None
        self.leader = False
        # When the runs of a worker that just died become orphans (monotonic).
        self._next_orphan: float | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="loomflow-worker sweeper",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._close()

    def _connect(self) -> SyncConn:
        conn = psycopg.connect(
            self.settings.database_url.get_secret_value(),
            autocommit=True,
            connect_timeout=self.settings.connect_timeout,
            keepalives=1, keepalives_idle=5, keepalives_interval=2, keepalives_count=3,
            tcp_user_timeout=15_000,
            application_name="loomflow-worker sweeper",
        )
        conn.execute(query("no_jit"))  # see journal.sql
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
                self._turn(self._conn)
                backoff = self.settings.sweep_interval
            except psycopg.Error as exc:
                log.warning("sweeper: %s; reconnecting", exc, extra={"action": "sweeper_error"})
                self._close()
                backoff = min(backoff * 2, 10.0)
            except Exception:
                log.exception("sweeper failed", extra={"action": "sweeper_error"})
                backoff = min(backoff * 2, 10.0)

    def _turn(self, conn: SyncConn) -> None:
        """One turn: stamp the messages held here; the leader sweeps."""
        self.stamp_held(conn)
        try:
            if self._lead(conn):
                self.recovery.sweep_revoked(conn)
                self.recovery.sweep(conn)
                self._next_orphan = self.recovery.next_orphan
                if self.repair is not None:
                    self.repair.repair(conn)
                    self.repair.recheck(conn)
                self.retention.retain(conn)
                self.retention.forget_workers(conn)
                if self.versions is not None:
                    self.versions.watch(conn)
            else:
                metrics.report_backlog({})  # the leader reports them
                metrics.report_version_waiting({})
        finally:
            self.record_actions(conn)

    def _pause(self, backoff: float) -> float:
        """How long to wait before the next sweep: ``backoff``, or less when
        the runs of a worker that just died are about to be orphans (the
        leader sweeps the moment their lease runs out, not up to a sweep
        interval later)."""
        due, self._next_orphan = self._next_orphan, None
        if due is None:
            return backoff
        return min(backoff, max(due - time.monotonic(), MIN_PAUSE))

    def _lead(self, conn: SyncConn) -> bool:
        if not self.leader:
            row = conn.execute(query("leader_lock"), {"key": LEADER_KEY}).fetchone()
            self.leader = bool(row and row[0])
            if not self.leader:
                self._end_stale_leader(conn)
                return False
            log.info("sweeper: leading the fleet from %s", self.worker,
                     extra={"action": "sweeper_leader"})
            self.actions.append(Action("lead", detail=f"leading the fleet from {self.worker}"))
            self.retention.lead()
            if self.repair is not None:
                self.repair.watch.forget()
        conn.execute(query("leader_claim"), {"worker": self.worker})
        return True

    def _end_stale_leader(self, conn: SyncConn) -> None:
        """End the leader's connection when it stopped stamping its lease (a
        frozen worker), so another can lead."""
        stale = conn.execute(
            query("leader_stale"), {"lease": self.settings.lease_timeout}).fetchone()
        if stale is None:
            return
        conn.execute(query("terminate_backend"), {"pid": stale[0]})
        log.warning("sweeper: ended a frozen leader's connection (pid %s)",
                    stale[0], extra={"action": "sweeper_takeover"})
        self.actions.append(Action(
            "takeover", detail=f"ended a frozen leader's connection (pid {stale[0]})"))

    def stamp_held(self, conn: SyncConn) -> int:
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

    def record_actions(self, conn: SyncConn) -> None:
        """Record this sweep's actions in ``sweeper_actions`` (one statement,
        which also drops the oldest). A failure is only logged: the actions
        are in the log and the metrics too."""
        actions = list(self.actions)
        # Cleared in place: the sweeper's jobs note into this list.
        self.actions.clear()
        if not actions:
            return
        try:
            conn.execute(query("record_sweeper_actions"), {
                "worker": self.worker,
                "actions": [a.action for a in actions],
                "request_ids": [a.request_id for a in actions],
                "details": [a.detail for a in actions],
                "keep": KEEP_ACTIONS, "keep_for": KEEP_ACTIONS_FOR,
            })
        except psycopg.Error as exc:
            log.warning("sweeper: could not record %d action(s): %s", len(actions), exc,
                        extra={"action": "sweeper_record"})
