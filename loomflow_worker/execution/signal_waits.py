"""Requests parked waiting for a signal (their run waited ``PARK_AFTER`` for
it and gave its slot back), claimed for publishing by the signal's sender as
it sends: the CLI's ``signal``, and ``PostgresRuntime.signal`` in a process of
the Celery binding (:mod:`loomflow_worker.tasks.wake`).

The sweeper publishes the waiters no sender did, within a sweep. Both mark a
request with the statement ``mark_swept``, which marks a parked waiter only
while nobody published it since it parked: of a sender and the sweeper that
find the same waiter, only the one that marks it publishes it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from psycopg.rows import DictRow, dict_row

from ..runtime.conns import Conn, SyncConn
from ..runtime.sql import query
from .pending import Pending


def claim(conn: SyncConn, session_id: str, name: str) -> list[Pending]:
    """The requests waiting for the signal ``name`` of ``session_id`` that a
    signal in its mailbox may wake, marked published now: the caller
    publishes them. Those another caller marked first are not among them."""
    rows = conn.cursor(row_factory=dict_row).execute(
        query("signal_waiters"), {"session_id": session_id, "name": name}).fetchall()
    if not rows:
        return []
    marked = conn.execute(query("mark_swept"), _marking(rows)).fetchall()
    return _claimed(rows, marked)


async def claim_async(conn: Conn, session_id: str, name: str) -> list[Pending]:
    """:func:`claim`, on an async connection."""
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(query("signal_waiters"), {"session_id": session_id, "name": name})
    rows = await cur.fetchall()
    if not rows:
        return []
    marked = await (await conn.execute(query("mark_swept"), _marking(rows))).fetchall()
    return _claimed(rows, marked)


def _marking(rows: Sequence[DictRow]) -> dict[str, Any]:
    # No again_after: a sender publishes only a waiter nobody published since it parked.
    return {"request_ids": [row["request_id"] for row in rows], "again_after": None}


def _claimed(rows: Sequence[DictRow], marked: Sequence[tuple[Any, ...]]) -> list[Pending]:
    ids = {str(row[0]) for row in marked}
    return [Pending.of(row) for row in rows if row["request_id"] in ids]
