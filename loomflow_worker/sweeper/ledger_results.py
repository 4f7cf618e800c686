"""The ``runs`` ledger as the sweeper's leader reads and marks it to keep the
result backend as the ledger has it: finished requests whose result is not
stored, or not yet checked there, or to look for again, and their outcomes.

The sweeper's result repair reaches the ledger only through these
functions, as workers do through :mod:`loomflow_worker.execution.ledger`.
Sync, on the sweeper's autocommit psycopg 3 connection; driver errors go up
as they are. The statements are in ``sweeper/sql/sweeper.sql``."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg.rows import dict_row

from ..runtime.conns import SyncConn
from ..runtime.sql import query


@dataclass(frozen=True)
class Outcome:
    """A finished request's outcome as the ledger has it, and how many
    seconds ago it ended (its result lives ``result_expires`` from then)."""

    request_id: str
    status: str
    result: Any
    error: str | None
    age: float


@dataclass(frozen=True)
class Finished:
    """A finished request, and its place in the order requests finished."""

    request_id: str
    finished_at: datetime
    seq: int


def unstored(conn: SyncConn, limit: int) -> list[str]:
    """Up to ``limit`` finished requests whose worker could not store their
    result, oldest first."""
    rows = conn.execute(query("unstored_results"), {"limit": limit}).fetchall()
    return [str(row[0]) for row in rows]


def unchecked(conn: SyncConn, *, after: float, alive_after: float, within: float,
              limit: int) -> list[str]:
    """Up to ``limit`` requests finished between ``after`` seconds ago
    (``alive_after`` while their worker process lives) and ``within`` seconds
    ago whose result is not checked in the result backend yet."""
    rows = conn.execute(query("unchecked_results"), {
        "after": after, "alive_after": alive_after, "within": within, "limit": limit,
    }).fetchall()
    return [str(row[0]) for row in rows]


def mark_stored(conn: SyncConn, request_ids: list[str]) -> None:
    """These results are in the backend now: none waits any longer."""
    conn.execute(query("mark_result_stored"), {"request_ids": request_ids})


def mark_checked(conn: SyncConn, request_ids: list[str], within: float) -> None:
    """These results are checked; so are those past looking back to (finished
    over ``within`` seconds ago)."""
    conn.execute(query("mark_result_checked"), {"request_ids": request_ids, "within": within})


def outcomes(conn: SyncConn, request_ids: list[str]) -> list[Outcome]:
    """The outcomes of those of ``request_ids`` that are finished (one gone
    from the ledger is not there)."""
    rows = conn.cursor(row_factory=dict_row).execute(
        query("request_outcomes"), {"request_ids": request_ids}).fetchall()
    return [Outcome(row["request_id"], row["status"], row["result"], row["error"],
                    float(row["age"])) for row in rows]


def finished_after(conn: SyncConn, at: datetime, seq: int, until: datetime | None,
                   limit: int) -> list[Finished]:
    """Up to ``limit`` finished requests whose result is wanted, in the order
    they finished, after (``at``, ``seq``) and until ``until`` (``None``: now)."""
    rows = conn.execute(query("results_to_recheck"), {
        "at": at, "seq": seq, "until": until, "limit": limit}).fetchall()
    return [Finished(str(request_id), finished_at, int(seq))
            for request_id, finished_at, seq in rows]
