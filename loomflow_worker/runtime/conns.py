"""The two kinds of database connection the package passes around, each named
once: ``Conn``, an async psycopg connection (the runtime's lock connections,
the ledger's statements of an attempt, the console's reads), and
``SyncConn``, a sync one (the sweeper's, the operator tools', a signal's
sender's in a Celery task)."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import TupleRow

Conn = psycopg.AsyncConnection[TupleRow]
SyncConn = psycopg.Connection[Any]
