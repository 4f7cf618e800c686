"""The ``runs`` ledger as the sweeper's leader reads and marks it to recover
what the fleet lost: frozen holders, orphans (requests whose worker died or
whose message is gone), requests revoked while their message waited.

The sweeper's other modules reach the ledger only through these functions
and :mod:`.ledger_results`, as workers do through
:mod:`loomflow_worker.execution.ledger`: a change to the ledger's tables
meets every statement on them in these gateways. Sync, on the sweeper's
autocommit psycopg 3 connection; driver errors go up as they are. The
statements are in ``sweeper/sql/sweeper.sql`` (``mark_swept`` and
``fair_next`` in ``execution/sql/ledger.sql``)."""

from __future__ import annotations

from psycopg.rows import dict_row

from ..execution.ledger import FAIR_PAGE
from ..execution.pending import Pending
from ..runtime.conns import SyncConn
from ..runtime.sql import query


def frozen(conn: SyncConn, lease: float) -> dict[int, list[str]]:
    """The running requests whose heartbeat is older than ``lease`` seconds
    while their scope's lock is still held, by the backend pid of the lock
    connection that holds it (one connection carries many runs). The lock
    table is read only when some heartbeat is stale, which is rare."""
    stale = [row[0] for row in conn.execute(query("stale_running"), {"lease": lease})]
    if not stale:
        return {}
    by_backend: dict[int, list[str]] = {}
    for request_id, pid in conn.execute(
            query("frozen_holders"), {"lease": lease, "request_ids": stale}).fetchall():
        by_backend.setdefault(int(pid), []).append(str(request_id))
    return by_backend


def mark_frozen_lost(conn: SyncConn, request_ids: list[str], pid: int, lease: float) -> None:
    """Their lock connection (backend ``pid``) is about to be ended because
    they stopped heartbeating for ``lease`` seconds (stalled, not crashed):
    their attempts end ``lost``, so the next ones count no crash. An attempt
    that has heartbeated since, or runs on another connection, is left
    open."""
    conn.execute(query("mark_frozen_lost"),
                 {"request_ids": request_ids, "pid": pid, "lease": lease})


def queued_by_queue(conn: SyncConn, default_queue: str) -> dict[str, int]:
    """How many requests are queued in each queue, parked or not (a request
    with no routing counts in ``default_queue``)."""
    rows = conn.execute(query("queued_queues"), {"default_queue": default_queue}).fetchall()
    return {str(queue): int(count) for queue, count in rows}


#: The status :func:`orphans` gives a running request whose worker died, when
#: the copy published since its last start is gone too.
COPY_LOST = "copy_lost"


def orphans(
    conn: SyncConn,
    *,
    waiting: dict[str, int | None],
    default_queue: str,
    after: float,
    queued_after: float,
    held_within: float,
    dead_after: float,
    limit: int,
) -> list[tuple[Pending, str]]:
    """Up to ``limit`` orphans with their status: the oldest unfinished
    request of each scope whose lock nobody holds, running with its worker
    dead, or queued with its message gone (``waiting``: how many messages
    the broker holds for each queue, ``None`` when unknown), each with its
    status (:data:`COPY_LOST` for a running one whose copy is gone). The
    statement ``orphans`` in sweeper.sql says each threshold's part."""
    rows = conn.cursor(row_factory=dict_row).execute(query("orphans"), {
        "after": after, "queued_after": queued_after,
        "queues": list(waiting), "waiting": list(waiting.values()),
        "default_queue": default_queue, "held_within": held_within,
        "dead_after": dead_after, "limit": limit,
    }).fetchall()
    return [(Pending.of(row), str(row["status"])) for row in rows]


def fair_next(conn: SyncConn) -> list[Pending]:
    """Withheld requests whose fair turn came, to publish (waiting for any other
    caller publishing them to be done: see ``loomflow_worker_fair_next``)."""
    rows = conn.cursor(row_factory=dict_row).execute(
        query("fair_next"), {"wait": True, "page": FAIR_PAGE}).fetchall()
    return [Pending.of(row) for row in rows]


def next_orphan_in(conn: SyncConn, dead_after: float) -> float | None:
    """In how many seconds (on the database's clock) the next running request
    whose lock nobody holds (its worker just died) becomes an orphan;
    ``None``: there is none."""
    row = conn.execute(query("next_orphan"), {"dead_after": dead_after}).fetchone()
    return None if row is None or row[0] is None else float(row[0])


def mark_swept(conn: SyncConn, request_ids: list[str], again_after: float) -> set[str]:
    """These orphans are being dispatched again now: those marked, to publish.
    A request parked for a signal is not marked when its signal's sender
    published it since it parked, less than ``again_after`` seconds ago (see
    :mod:`loomflow_worker.execution.signal_waits`)."""
    rows = conn.execute(query("mark_swept"),
                        {"request_ids": request_ids, "again_after": again_after}).fetchall()
    return {str(row[0]) for row in rows}


def mark_unswept(conn: SyncConn, request_ids: list[str]) -> None:
    """The broker refused these orphans' batch: each goes again on the next
    sweep, a queued one as if never published."""
    conn.execute(query("mark_unswept"), {"request_ids": request_ids})


def unfinished_among(conn: SyncConn, request_ids: list[str]) -> list[str]:
    """Those of ``request_ids`` the ledger has unfinished."""
    rows = conn.execute(query("unfinished_among"), {"request_ids": request_ids}).fetchall()
    return [str(row[0]) for row in rows]
