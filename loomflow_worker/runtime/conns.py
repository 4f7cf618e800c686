"""The two kinds of database connection the package passes around, each named
once: ``Conn``, an async psycopg connection (the runtime's lock connections,
the ledger's statements of an attempt, the console's reads), and
``SyncConn``, a sync one (the sweeper's, the operator tools', a signal's
sender's in a Celery task); and what the worker's pool says first
(:func:`without_jit`)."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import TupleRow

from .sql import query

Conn = psycopg.AsyncConnection[TupleRow]
SyncConn = psycopg.Connection[Any]


async def without_jit(conn: Conn) -> None:
    """A pool's ``configure``: the new connection compiles no statement
    (``no_jit`` in journal.sql says why)."""
    await conn.execute(query("no_jit"))
