"""The ``runs`` ledger read for operators: requests listed by filter, one
request's row and status, and its attempts.

The operator tools (``admin``) read the ledger only through these functions,
as workers write it only through :mod:`.ledger`: a change to the ledger's
tables meets every statement on them in this layer. Sync, on an autocommit
psycopg 3 connection; each row comes by column name, for the caller's read
model. Driver errors go up as they are: the caller translates them. The
statements are in ``execution/sql/ledger_reads.sql``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from decimal import Decimal
from typing import Any

from psycopg.rows import DictRow, dict_row

from ..runtime.conns import SyncConn
from ..runtime.sql import query


def list_requests(
    conn: SyncConn,
    *,
    session_id: str | None = None,
    user_id: str | None = None,
    statuses: Sequence[str] = (),
    older_than: timedelta | None = None,
    newer_than: timedelta | None = None,
    min_cost: Decimal | None = None,
    by_cost: bool = False,
    limit: int,
) -> list[DictRow]:
    """Up to ``limit`` requests, newest first (``by_cost``: those that cost
    something, the costliest first), matching every filter given (ages by enqueue time; no
    ``statuses``: any status; ``min_cost``: at least that many dollars)."""
    return _rows(conn, "admin_list_runs_by_cost" if by_cost else "admin_list_runs", {
        "session_id": session_id,
        "user_id": user_id,
        "statuses": list(statuses) or None,
        "older": older_than.total_seconds() if older_than is not None else None,
        "newer": newer_than.total_seconds() if newer_than is not None else None,
        "min_cost": min_cost,
        "limit": limit,
    })


def request_status(conn: SyncConn, request_id: str) -> DictRow | None:
    """The request's ``status``, ``result``, ``error`` and ``error_type``;
    ``None`` when the ledger has no such request."""
    return _row(conn, "admin_run_status", {"request_id": request_id})


def request_row(conn: SyncConn, params: Mapping[str, Any]) -> DictRow | None:
    """The request's whole row (its attempt count as ``attempts_count``, its
    prompt cut as ``params`` say: ``admin.request_params``); ``None`` when the
    ledger has no such request."""
    return _row(conn, "get_run", params)


def request_attempts(conn: SyncConn, request_id: str) -> list[DictRow]:
    """The request's attempts, first to last: ``attempt``, ``worker``, ``pid``,
    ``epoch``, ``started_at``, ``ended_at``, ``outcome`` and the start of the
    next one (``next_started_at``)."""
    return _rows(conn, "get_run_attempts", {"request_id": request_id})


def request_upgrades(conn: SyncConn, request_id: str) -> list[DictRow]:
    """The request's moves to another version of its agent, oldest first:
    ``at``, ``from_version``, ``to_version``, ``by``."""
    return _rows(conn, "get_run_upgrades", {"request_id": request_id})


def agent_versions(conn: SyncConn) -> list[DictRow]:
    """Each version of each agent, from the fleet's registry and the requests
    pinned to it (see ``agent_versions``)."""
    return _rows(conn, "agent_versions", {})


def usage_report(conn: SyncConn, params: Mapping[str, Any]) -> list[DictRow]:
    """Tokens, cost, requests and replay savings per group (``usage_report``;
    its parameters: ``admin.usage_params``)."""
    return _rows(conn, "usage_report", params)


def _rows(conn: SyncConn, name: str, params: Mapping[str, Any]) -> list[DictRow]:
    return conn.cursor(row_factory=dict_row).execute(query(name), params).fetchall()


def _row(conn: SyncConn, name: str, params: Mapping[str, Any]) -> DictRow | None:
    return conn.cursor(row_factory=dict_row).execute(query(name), params).fetchone()
