"""Results in the result backend, kept as the ledger has them.

A finished request's result is stored by its worker. The sweeper's leader
stores, from the ledger, one the backend refused (it was down) or one whose
worker died before storing it (:meth:`ResultRepairer.repair`), and every
result the backend lost after it was stored (:meth:`ResultRepairer.recheck`,
through :mod:`.result_watch`). While the backend is down, results wait in the
ledger for a later sweep; the outage is said once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import psycopg

from ..runtime.conns import SyncConn
from ..settings import Settings
from . import ledger_results
from .actions import Action, Note
from .result_watch import ResultBackend, ResultWatch, store_from_ledger

log = logging.getLogger(__name__)

# A finished request whose worker process still lives stores its own result,
# late when the process is busy: the sweeper checks it only after this long
# (one whose worker is gone, after HANDOFF_GRACE).
RESULT_WAIT_ALIVE = 60.0
# Results are repaired this many at a time, for requests that ended within
# RESULTS_WITHIN seconds.
RESULTS_BATCH = 200
RESULTS_WITHIN = 3600.0



class ResultRepairer:
    """The leader's result repair: ``results`` reaches the backend, ``note``
    records what it did."""

    def __init__(self, settings: Settings, results: ResultBackend, note: Note) -> None:
        self.settings = settings
        self.results = results
        self.note = note
        # The result backend refused the last store: said once per outage.
        self.backend_down = False
        self.watch = ResultWatch(results, lambda action, detail: note(
            Action(action, detail=detail)))

    def repair(self, conn: SyncConn) -> int:
        """Store, from the ledger, the results of finished requests that are not
        in the result backend: those the backend refused (it was down), and
        those whose worker died between its commit and storing it; returns how
        many. Never those whose caller wants no result (``ignore_result``), nor
        those their worker stored (a caller may have forgotten them since)."""
        # A worker that stored a result says so with its next stamp, within a
        # heartbeat interval: only a result still unchecked after that is looked for.
        after = max(self.settings.handoff_grace, 2 * self.settings.heartbeat_interval)
        batches: list[tuple[Callable[[], list[str]], bool, Callable[[list[str]], None]]] = [
            (lambda: ledger_results.unstored(conn, RESULTS_BATCH), False,
             lambda ids: ledger_results.mark_stored(conn, ids)),
            (lambda: ledger_results.unchecked(
                conn, after=after, alive_after=max(after, RESULT_WAIT_ALIVE),
                within=RESULTS_WITHIN, limit=RESULTS_BATCH), True,
             lambda ids: ledger_results.mark_checked(conn, ids, RESULTS_WITHIN)),
        ]
        repaired = 0
        for read, check, mark in batches:
            ids = read()
            if not ids:
                continue
            repaired += self._store(conn, ids, check, mark)
            if self.backend_down:
                break
        return repaired

    def _store(self, conn: SyncConn, ids: list[str], check: bool,
               mark: Callable[[list[str]], None]) -> int:
        """Store those of ``ids`` the backend lacks (all of them unless
        ``check``), then ``mark`` those done; returns how many it stored."""
        try:
            missing = self.results.missing(ids) if check else set(ids)
        except Exception as exc:
            self.unreachable(exc)
            return 0
        stored: list[tuple[str, str]] = []
        try:
            store_from_ledger(conn, self.results, [i for i in ids if i in missing], stored)
            # The rest were there already, their request is gone, or its
            # result's lifetime is over.
            checked = ids
            self.backend_down = False
        except psycopg.Error:
            raise
        except Exception as exc:
            checked = [request_id for request_id, _ in stored]
            self.unreachable(exc)
        for request_id, status in stored:
            log.warning(
                "sweeper: stored the %s result of request %s, which its worker "
                "could not store", status, request_id,
                extra={"action": "sweeper_result", "request": request_id},
            )
            self.note(Action("result_stored", request_id,
                             f"stored its {status} result, which its worker could not store"))
        if checked:
            mark(checked)
        return len(stored)

    def recheck(self, conn: SyncConn) -> int:
        """Store again, from the ledger, the results the backend lost after
        they were stored (it restarted empty, say; see :mod:`.result_watch`),
        for a bounded time per sweep; returns how many."""
        try:
            restored = self.watch.look(conn)
        except psycopg.Error:
            raise
        except Exception as exc:
            self.unreachable(exc)
            return 0
        self.backend_down = False
        return restored

    def unreachable(self, exc: Exception) -> None:
        """Results wait in the ledger while the backend is down: said once per outage."""
        if not self.backend_down:
            log.warning("sweeper: the result backend is unreachable (%s); "
                        "results wait in the ledger", exc,
                        extra={"action": "sweeper_result_wait"})
        self.backend_down = True
