"""Whether a database's connections are server sessions, as the workers'
advisory locks, keepalives and LISTEN need: checked before a pool opens, by
``migrate`` and by ``doctor``. A leaf module (no agent framework), so those
commands start without loading what a run needs."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
from psycopg import AsyncConnection

from .errors import CONNECT, SessionPooler, describe_dsn, first_line, translated
from .lockconn import Conn
from .sql import query


async def probe(dsn: str, connect_timeout: int) -> None:
    """Connect to ``dsn`` and check that its connections are sessions: a clear
    error instead of a hang (:class:`DatabaseUnavailable`) or of runs that
    stall behind a transaction-mode pooler (:class:`SessionPooler`)."""
    async with await _connect(dsn, connect_timeout) as conn:
        await require_sessions(conn, dsn, connect_timeout)


async def _connect(dsn: str, connect_timeout: int) -> Conn:
    with translated(CONNECT, dsn):
        return await AsyncConnection.connect(dsn, autocommit=True,
                                             connect_timeout=connect_timeout)


async def require_sessions(conn: Conn, dsn: str, connect_timeout: int) -> None:
    """Raise :class:`SessionPooler` when ``conn`` (autocommit, to ``dsn``) is
    not one server session across transactions, as behind PgBouncer in
    transaction or statement mode.

    Behaviour is tested, not names: ``conn`` sets a session-level setting;
    a second connection, in a transaction block, must be another session
    (its own backend, without the setting); then ``conn`` must still be on
    its backend with its setting. A pooler hands a released server to the
    next client, so one of these fails; a statement-mode pooler refuses the
    transaction block."""
    token = uuid.uuid4().hex
    mine = await _probe_row(conn, "session_probe_mark", {"token": token})
    problem = ""
    async with await _connect(dsn, connect_timeout) as other:
        try:
            async with other.transaction():
                theirs = await _probe_row(other, "session_probe_read", {})
        except psycopg.Error as exc:
            problem = f"a transaction block was refused ({first_line(exc)})"
        else:
            if theirs[0] == mine[0] or theirs[1] == token:
                problem = "two connections were given one server session"
    if not problem:
        again = await _probe_row(conn, "session_probe_read", {})
        if again[0] != mine[0] or again[1] != token:
            problem = "a session setting made in one transaction was gone in the next"
    if problem:
        raise SessionPooler(
            f"the database at {describe_dsn(dsn)} is behind a pooler in transaction or "
            f"statement mode: {problem}. The workers' session advisory locks, keepalives and "
            "LISTEN need each connection to stay one server session: point "
            "LOOMFLOW_WORKER_DATABASE_URL at Postgres itself, or set pool_mode = session in "
            "the pooler (PgBouncer) for this database"
        )


async def _probe_row(conn: Conn, name: str, params: dict[str, Any]) -> tuple[Any, ...]:
    cur = await conn.execute(query(name), params)
    row = await cur.fetchone()
    assert row is not None
    return tuple(row)
