"""The sweeper: recovery in seconds, whatever the broker's visibility timeout.

Every worker runs one in its main process; one leads the fleet at a time
(a session advisory lock elects it, and a leader whose lease runs out, a
frozen worker, has its connection ended so another can take over). Each
sweep:

- ends the lock connection of a running request whose heartbeat is older
  than the lease (a frozen worker): that fences it and frees its session;
- dispatches again the oldest unfinished request of every session whose
  lock nobody holds: running (its worker died) or queued with a dispatch
  that looks lost.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

import psycopg

from .. import metrics
from ..runtime.sql import query
from ..settings import Settings
from .ledger import Pending

log = logging.getLogger("loomflow_worker.sweeper")

LEADER_KEY = 0x6C66_7773_7765_6570  # "lfwsweep"


class Sweeper:
    def __init__(self, settings: Settings, dispatch: Callable[[Pending], None]) -> None:
        self.settings = settings
        self.dispatch = dispatch
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: psycopg.Connection[Any] | None = None
        self.leader = False

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
        while not self._stop.wait(backoff):
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = self._connect()
                if self._lead(self._conn):
                    self.sweep(self._conn)
                backoff = self.settings.sweep_interval
            except psycopg.Error as exc:
                log.warning("sweeper: %s; reconnecting", exc, extra={"action": "sweeper_error"})
                self._close()
                backoff = min(backoff * 2, 10.0)
            except Exception:
                log.exception("sweeper failed", extra={"action": "sweeper_error"})
                backoff = min(backoff * 2, 10.0)

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
                return False
            log.info("sweeper: leading the fleet from %s", self.holder,
                     extra={"action": "sweeper_leader"})
        conn.execute(query("leader_claim"), {"holder": self.holder})
        return True

    def sweep(self, conn: psycopg.Connection[Any]) -> int:
        """One sweep; returns how many requests it dispatched again."""
        frozen = conn.execute(
            query("frozen_holders"), {"lease": self.settings.lease}
        ).fetchall()
        meter = metrics.get()
        for request_id, pid in frozen:
            conn.execute(query("terminate_backend"), {"pid": pid})
            if meter is not None:
                meter.sweeper.labels("fence").inc()
            log.warning(
                "sweeper: request %s stopped its heartbeat for over %gs; ended its worker's "
                "lock connection (pid %s)", request_id, self.settings.lease, pid,
                extra={"action": "sweeper_fence", "request": request_id},
            )
        orphans = conn.execute(
            query("orphans"), {"after": self.settings.redispatch_after, "limit": 500}
        ).fetchall()
        for row in orphans:
            pending = Pending(*row[:7])
            conn.execute(query("mark_swept"), {"request_id": pending.request_id})
            self.dispatch(pending)
            if meter is not None:
                meter.sweeper.labels("redispatch").inc()
            log.warning(
                "sweeper: dispatched request %s again (it was %s with its session free)",
                pending.request_id, row[7],
                extra={"action": "sweeper_redispatch", "request": pending.request_id},
            )
        return len(orphans)
