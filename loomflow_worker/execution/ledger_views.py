"""The ``runs`` ledger read for the run console: pages of requests, a
session's requests, one request's row and attempts, and the fleet's counts.

The console reads the ledger only through these functions, as the operator
tools read it through :mod:`.ledger_reads` and workers write it through
:mod:`.ledger`: a change to the ledger's tables meets every statement on them
in this layer. Async, on the caller's connection (the console's read-only
pool); each row is made by the caller's read model, ``row``: a class taking
the query's columns by name (psycopg's ``class_row``). The queries are those of
``execution/sql/ledger_views.sql`` and ``show``'s two of
``ledger_reads.sql``."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, TypeVar

from psycopg.rows import class_row

from ..runtime.conns import Conn
from ..runtime.sql import query

Row = TypeVar("Row")


async def list_requests(
    conn: Conn,
    row: type[Row],
    *,
    status: str | None,
    session_id: str | None,
    user_id: str | None,
    agent: str | None,
    since: datetime | None,
    until: datetime | None,
    before: int | None,
    limit: int,
    prompt_chars: int,
) -> list[Row]:
    """Up to ``limit`` requests, newest first, matching every filter given
    (enqueued in ``[since, until)``, numbered below ``before``), each prompt
    cut to ``prompt_chars`` characters."""
    return await _rows(conn, row, "console_requests", {
        "status": status, "session_id": session_id, "user_id": user_id, "agent": agent,
        "since": since, "until": until, "before": before, "limit": limit,
        "prompt_chars": prompt_chars,
    })


async def session_requests(
    conn: Conn, row: type[Row], session_id: str, *, limit: int, prompt_chars: int
) -> list[Row]:
    """The session's latest ``limit`` requests, newest first, every user's
    scope of it, each with ``cancel_requested`` and whether it holds its
    scope's lock (``holds_lock``)."""
    return await _rows(conn, row, "console_session", {
        "session_id": session_id, "limit": limit, "prompt_chars": prompt_chars,
    })


async def request_row(conn: Conn, row: type[Row], params: Mapping[str, Any]) -> Row | None:
    """The request's whole row, as ``show`` reads it (``admin.request_params``
    says how much of the prompt); ``None`` when the ledger has no such
    request."""
    return next(iter(await _rows(conn, row, "get_run", params)), None)


async def request_attempts(conn: Conn, row: type[Row], request_id: str) -> list[Row]:
    """The request's attempts, first to last, each with the start of the
    next one."""
    return await _rows(conn, row, "get_run_attempts", {"request_id": request_id})


async def request_upgrades(conn: Conn, row: type[Row], request_id: str) -> list[Row]:
    """The request's moves to another version of its agent, oldest first."""
    return await _rows(conn, row, "get_run_upgrades", {"request_id": request_id})


async def agent_versions(conn: Conn, row: type[Row]) -> list[Row]:
    """Each version of each agent: its live workers and the requests pinned to it."""
    return await _rows(conn, row, "agent_versions", {})


async def queue_depth(conn: Conn, row: type[Row]) -> Row:
    """The queue of record: queued requests ready to run, those backing off,
    running ones, and the oldest queued one's enqueue time."""
    return (await _rows(conn, row, "console_queue", {}))[0]


async def in_flight(conn: Conn, row: type[Row]) -> list[Row]:
    """Running requests counted by the worker process holding them."""
    return await _rows(conn, row, "console_in_flight", {})


async def recent_attempts(conn: Conn, row: type[Row], *, window: float) -> list[Row]:
    """Attempts started within ``window`` seconds by worker process, with
    how many of them died or were interrupted."""
    return await _rows(conn, row, "console_recent_workers", {"window": window})


async def key_backlog(conn: Conn, row: type[Row], *, limit: int) -> list[Row]:
    """The fairness keys with the most requests waiting: queued (and of them,
    withheld or parked on a limit) and running."""
    return await _rows(conn, row, "console_key_backlog", {"limit": limit})


async def concurrency_limits(conn: Conn, row: type[Row]) -> list[Row]:
    """Every concurrency limit, with how many requests wait on it."""
    return await _rows(conn, row, "concurrency_limits", {})


async def swept(conn: Conn, row: type[Row], *, limit: int) -> list[Row]:
    """The latest ``limit`` requests the sweeper dispatched again."""
    return await _rows(conn, row, "console_swept", {"limit": limit})


async def usage_report(conn: Conn, row: type[Row], params: Mapping[str, Any]
                       ) -> list[Row]:
    """Tokens, cost, requests and replay savings per group (``usage_report``;
    its parameters: ``admin.usage_params``)."""
    return await _rows(conn, row, "usage_report", params)


async def _rows(
    conn: Conn, row: type[Row], name: str, params: Mapping[str, Any]
) -> list[Row]:
    async with conn.cursor(row_factory=class_row(row)) as cur:
        await cur.execute(query(name), params)
        return await cur.fetchall()
