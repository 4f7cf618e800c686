"""Pooled connections are checked with a round trip only after sitting idle."""

from __future__ import annotations

import time

import psycopg
import pytest

from loomflow_worker.runtime.store import IdleCheck


def _end_backend(dsn: str, conn: psycopg.Connection[object]) -> None:
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
    time.sleep(0.1)


def test_a_connection_back_a_moment_ago_is_not_checked_an_idle_one_is(dsn: str) -> None:
    idle = IdleCheck(after=0.5)
    with psycopg.connect(dsn, autocommit=True) as conn:
        _end_backend(dsn, conn)
        with pytest.raises(psycopg.OperationalError):
            idle.check(conn)  # never seen: checked, and found broken
    with psycopg.connect(dsn, autocommit=True) as conn:
        idle.returned(conn)
        _end_backend(dsn, conn)
        idle.check(conn)  # back a moment ago: no round trip, so no error yet
        time.sleep(0.6)
        with pytest.raises(psycopg.OperationalError):
            idle.check(conn)  # idle past `after`: checked, and found broken
