"""The sweeper's watch on the result backend: every result it lost after it
was stored is stored again from the ledger (those it never stored are
:mod:`.result_repair`'s).

A Redis restarted without persistence (or from a snapshot older than its last
writes), flushed, failed over to a replica that was behind, or evicting keys
under memory pressure forgets results their callers may not have read yet.
To tell, cheaply, the leader leaves a mark in the backend on every sweep (a
moment on the database's clock, under a key of this ledger's own) and keeps
it in the ledger too. On the next sweep, the mark gone says the backend lost
everything, an older mark says it went back to that moment, and more keys
evicted than last time say some may be gone. Then every finished request
whose result Celery's ``result_expires`` says should still exist, and whose
caller wants it, is looked for, a batch at a time (one round trip to each
store) and for a bounded time per sweep, so recovery keeps its pace; those
missing are stored again for what is left of their lifetime. A backend that
keeps its data costs one round trip to each store per sweep.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg.rows import dict_row

from ..runtime.conns import SyncConn
from ..runtime.sql import query
from . import ledger_results

log = logging.getLogger(__name__)

# A re-check looks for this many results per round trip, and goes on for up
# to RECHECK_BUDGET seconds per sweep.
RECHECK_BATCH = 200
RECHECK_BUDGET = 0.25
# A backend that went back to an older copy lost what was stored after its
# mark; a result is stored a while after its request ends (by a busy worker,
# or by the sweeper): those that ended this long before the mark are looked
# for too.
ROLLBACK_SLACK = 300.0
# Evictions start a re-check of every result at most this often (a Redis
# short of memory evicts on and on; each pass looks at every result).
EVICTION_PASS_EVERY = 600.0

EPOCH = datetime.fromtimestamp(0, UTC)


@dataclass(frozen=True)
class BackendMark:
    """What the result backend held: the mark left there last (``None``:
    gone), and how many keys its server has evicted since it started
    (``None``: it does not say)."""

    found: float | None
    evicted: int | None


@dataclass(frozen=True)
class ResultBackend:
    """How the sweeper reaches the result backend: ``missing(request_ids)``
    says which of them have no outcome stored (in one round trip where the
    backend allows); ``store(request_id, status, result, error, age)`` stores
    one as the ledger has it, for what is left of its lifetime (its request
    ended ``age`` seconds ago), and says whether any was left; ``probe(token,
    stamp)`` reads the mark left under ``token`` and leaves ``stamp`` in its
    place (``None``: a backend it cannot watch); ``lifetime``: how long a
    result lives there (``None``: for ever)."""

    missing: Callable[[list[str]], set[str]]
    store: Callable[[str, str, Any, str | None, float], bool]
    probe: Callable[[str, float], BackendMark | None] | None = None
    lifetime: float | None = None


@dataclass(frozen=True)
class Loss:
    """Since when the backend may have lost results, and why."""

    since: datetime
    why: str
    eviction: bool = False


@dataclass(frozen=True)
class Recheck:
    """A re-check under way: the finished requests after (``at``, ``seq``),
    in the order they finished, up to ``until``, are left to look for."""

    at: datetime
    seq: int
    until: datetime | None = None


def lost_since(mark: float | None, evicted: int | None, seen: BackendMark, now: datetime,
               lifetime: float | None) -> Loss | None:
    """What the backend lost since the mark it was left (``mark``, when it
    had evicted ``evicted`` keys), now that it shows ``seen``; ``None``:
    nothing. No mark yet (the first look) tells nothing."""
    if mark is None:
        return None
    oldest = now - timedelta(seconds=lifetime) if lifetime else EPOCH
    if seen.found is None:
        return Loss(oldest, "the mark left there is gone (restarted empty, flushed, "
                            "or failed over)")
    if seen.found < mark:
        back_to = datetime.fromtimestamp(seen.found, UTC)
        return Loss(max(oldest, back_to - timedelta(seconds=ROLLBACK_SLACK)),
                    f"it went back to its state of {back_to.isoformat(timespec='seconds')} "
                    "(restored from an older copy)")
    if evicted is not None and seen.evicted is not None and seen.evicted > evicted:
        return Loss(oldest, f"it evicted {seen.evicted - evicted} key(s)", eviction=True)
    return None


def store_from_ledger(conn: SyncConn, results: ResultBackend,
                      request_ids: list[str], stored: list[tuple[str, str]]) -> None:
    """Store these finished requests' outcomes as the ledger has them (a
    request gone from the ledger, or past its result's lifetime, is skipped);
    each stored is added to ``stored`` (request id, status) as it goes, so a
    backend failing midway leaves those done said. Outcomes are read only for
    what the backend lacks: a result can be large."""
    if not request_ids:
        return
    for outcome in ledger_results.outcomes(conn, request_ids):
        if results.store(outcome.request_id, outcome.status, outcome.result, outcome.error,
                         outcome.age):
            stored.append((outcome.request_id, outcome.status))


@dataclass(frozen=True)
class _Known:
    """What the ledger says of the backend (``result_backend_watch``), and the
    database's clock when it was read: the mark the leader leaves next."""

    token: str
    mark: float | None
    evicted: int | None
    recheck: Recheck | None
    now: datetime


class ResultWatch:
    """The leader's watch on the result backend (see the module's docstring).
    ``note(action, detail)`` records what it did for the console."""

    def __init__(self, results: ResultBackend, note: Callable[[str, str], None]) -> None:
        self.results = results
        self.note = note
        self._known: _Known | None = None
        self._next_eviction_pass = 0.0
        # The current re-check's tally, for the line that says it ended.
        self._checked = 0
        self._restored = 0

    def forget(self) -> None:
        """Read the ledger again on the next look (another leader may have
        written it since)."""
        self._known = None

    def look(self, conn: SyncConn, *, budget: float = RECHECK_BUDGET) -> int:
        """Probe the backend, start a re-check if it lost results, and carry a
        re-check on for up to ``budget`` seconds; returns how many results it
        stored again. The backend's errors are raised (after what was done is
        recorded)."""
        probe = self.results.probe
        if probe is None:
            return 0
        known = self._known or self._read(conn)
        seen = probe(known.token, known.now.timestamp())
        if seen is None:
            return 0
        loss = lost_since(known.mark, known.evicted, seen, known.now, self.results.lifetime)
        evicted = seen.evicted
        if loss is not None and loss.eviction and (
                known.recheck is not None or time.monotonic() < self._next_eviction_pass):
            # Taken up once this pass ends, or once passes may start again.
            loss, evicted = None, known.evicted
        recheck = known.recheck
        if loss is not None:
            recheck = self._start(loss, recheck)
        known = self._write(conn, replace(known, mark=known.now.timestamp(), evicted=evicted,
                                          recheck=recheck), widen=loss is not None)
        if known.recheck is None:
            return 0
        restored, failure = self._walk(conn, known.recheck, budget)
        self._write(conn, self._known or known, widen=False)
        if failure is not None:
            raise failure
        return restored

    def _start(self, loss: Loss, recheck: Recheck | None) -> Recheck:
        log.warning("sweeper: the result backend lost results: %s; looking for every result "
                    "of a request that ended since %s", loss.why,
                    loss.since.isoformat(timespec="seconds"),
                    extra={"action": "sweeper_result_recheck"})
        self.note("results_recheck", f"the result backend lost results: {loss.why}")
        if loss.eviction:
            self._next_eviction_pass = time.monotonic() + EVICTION_PASS_EVERY
        if recheck is None or (loss.since, -1) < (recheck.at, recheck.seq):
            return Recheck(loss.since, -1, recheck.until if recheck else None)
        return recheck

    def _walk(self, conn: SyncConn, recheck: Recheck,
              budget: float) -> tuple[int, Exception | None]:
        """Look for the next results of ``recheck``, a batch at a time, for up
        to ``budget`` seconds; store again those missing. Returns how many it
        stored, and the backend's error that stopped it, if one did."""
        deadline = time.monotonic() + budget
        restored = 0
        while True:
            rows = ledger_results.finished_after(conn, recheck.at, recheck.seq, recheck.until,
                                                 RECHECK_BATCH)
            if not rows:
                self._ended()
                return restored, None
            ids = [row.request_id for row in rows]
            stored: list[tuple[str, str]] = []
            try:
                missing = self.results.missing(ids)
                store_from_ledger(conn, self.results, [i for i in ids if i in missing], stored)
            except psycopg.Error:
                raise
            except Exception as exc:
                self._restored += len(stored)
                return restored + len(stored), exc
            restored += len(stored)
            self._restored += len(stored)
            self._checked += len(ids)
            recheck = replace(recheck, at=rows[-1].finished_at, seq=rows[-1].seq)
            assert self._known is not None
            self._known = replace(self._known, recheck=recheck)
            if len(rows) < RECHECK_BATCH or time.monotonic() >= deadline:
                return restored, None

    def _ended(self) -> None:
        log.info("sweeper: looked for %d result(s) the result backend may have lost; "
                 "stored %d again", self._checked, self._restored,
                 extra={"action": "sweeper_result_recheck", "checked": self._checked,
                        "stored": self._restored})
        self.note("results_rechecked", f"looked for {self._checked} result(s); "
                                       f"stored {self._restored} again")
        self._checked = self._restored = 0
        assert self._known is not None
        self._known = replace(self._known, recheck=None)

    def _read(self, conn: SyncConn) -> _Known:
        row = conn.cursor(row_factory=dict_row).execute(query("backend_watch")).fetchone()
        if row is None:
            raise psycopg.OperationalError("result_backend_watch has no row: run migrate")
        recheck = (Recheck(row["recheck_at"], int(row["recheck_seq"]), row["recheck_until"])
                   if row["recheck_at"] is not None else None)
        self._known = _Known(row["token"], row["mark"], row["evicted"], recheck, row["now"])
        return self._known

    def _write(self, conn: SyncConn, known: _Known, *, widen: bool) -> _Known:
        """Record ``known`` in the ledger; a re-check ``widen``-ed reaches up
        to now. Returns it with the database's clock (the next mark)."""
        recheck = known.recheck
        row = conn.execute(query("backend_watched"), {
            "mark": known.mark, "evicted": known.evicted,
            "recheck_at": recheck.at if recheck else None,
            "recheck_seq": recheck.seq if recheck else None,
            "widen": widen,
        }).fetchone()
        assert row is not None
        now, until = row
        if recheck is not None:
            recheck = replace(recheck, until=until)
        self._known = replace(known, recheck=recheck, now=now)
        return self._known
