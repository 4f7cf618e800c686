"""Pooled connections are checked with a round trip only after sitting idle,
and returning one to its pool costs no hand-off to the pool's worker."""

from __future__ import annotations

import time

import psycopg
import pytest

from loomflow_worker.runtime.store import IdleCheck

from .helpers import wait_until


def _end_backend(dsn: str, conn: psycopg.Connection[object]) -> None:
    pid = conn.info.backend_pid
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_until(
            lambda: admin.execute(
                "SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone() is None,
            f"backend {pid} gone", timeout=5,
        )


def test_a_connection_taken_a_moment_ago_is_not_checked_an_idle_one_is(dsn: str) -> None:
    idle = IdleCheck(after=0.5)
    with psycopg.connect(dsn, autocommit=True) as conn:
        _end_backend(dsn, conn)
        with pytest.raises(psycopg.OperationalError):
            idle.check(conn)  # never seen: checked, and found broken
    with psycopg.connect(dsn, autocommit=True) as conn:
        idle.check(conn)  # never seen: checked, and fine
        _end_backend(dsn, conn)
        idle.check(conn)  # taken a moment ago: no round trip, so no error yet
        time.sleep(0.6)
        with pytest.raises(psycopg.OperationalError):
            idle.check(conn)  # idle past `after`: checked, and found broken


def test_the_pools_return_connections_without_a_reset_hook(dsn: str) -> None:
    """A pool with a ``reset`` hook hands every returned connection to its
    worker thread (a thread switch per statement for the enqueue pool): the
    enqueue pool has none, and a connection comes back at once."""
    from loomflow_worker.execution.ledger import EnqueuePool

    enqueue = EnqueuePool()
    try:
        pool = enqueue.pool(dsn, 5)
        with enqueue.connection(dsn, 5) as conn:
            conn.execute("SELECT 1")
        assert pool.get_stats()["pool_available"] == 1
    finally:
        enqueue.close()
