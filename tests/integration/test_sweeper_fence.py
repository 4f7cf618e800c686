"""The sweeper's fence of a frozen holder, against the real database: the
frozen attempt is recorded ``lost`` before its lock connection ends, so the
copy of its request waiting for the lock never finds it open (which the
request's next start would count as a crash)."""

from __future__ import annotations

import threading
from typing import Any

import psycopg

from loomflow_worker.settings import Settings
from loomflow_worker.sweeper.actions import Action
from loomflow_worker.sweeper.recovery import Recovery

KEY = 4242
REQUEST = "frozen-1"


def _frozen_holder(dsn: str) -> psycopg.Connection[Any]:
    """A lock connection holding a running request's scope lock, its
    heartbeat 60 s old: what a stalled process leaves."""
    holder = psycopg.connect(dsn, autocommit=True)
    holder.execute("SELECT pg_advisory_lock(%s)", (KEY,))
    holder.execute(
        "INSERT INTO runs (request_id, scope, session_id, agent, prompt, status, lock_key,"
        " holder, holder_pid, attempts, heartbeat_at, started_at)"
        " VALUES (%s, 's/u', 's', 'default', 'hi', 'running', %s, 'w', pg_backend_pid(), 1,"
        "         now() - interval '60 s', now() - interval '61 s')", (REQUEST, KEY))
    holder.execute(
        "INSERT INTO run_attempts (request_id, attempt, worker, pid, epoch)"
        " VALUES (%s, 1, 'w', 1, 0)", (REQUEST,))
    return holder


def test_a_frozen_attempt_is_ended_lost_before_its_lock_is_freed(dsn: str) -> None:
    holder = _frozen_holder(dsn)
    seen: list[object] = []
    locked = threading.Event()

    def next_attempt() -> None:
        # The request's next delivery, waiting for its scope's lock: it reads
        # how the previous attempt ended the moment it has the lock.
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_advisory_lock(%s)", (KEY,))
            locked.set()
            row = conn.execute(
                "SELECT outcome FROM run_attempts WHERE request_id = %s", (REQUEST,)).fetchone()
            seen.append(None if row is None else row[0])

    waiter = threading.Thread(target=next_attempt)
    waiter.start()
    # A reader holds the attempt's row a moment (as a console query might):
    # the sweeper's mark waits for it, and so must the lock's release.
    blocker = psycopg.connect(dsn)
    blocker.execute("SELECT 1 FROM run_attempts WHERE request_id = %s FOR UPDATE", (REQUEST,))
    notes: list[Action] = []
    recovery = Recovery(Settings(database_url=dsn, lease_timeout=5.0, heartbeat_interval=0.5),
                        dispatch=lambda batch: None, note=notes.append)
    fenced: list[int] = []
    with psycopg.connect(dsn, autocommit=True) as sweeper_conn:
        sweep = threading.Thread(target=lambda: fenced.append(recovery.fence(sweeper_conn)))
        sweep.start()
        try:
            # The lock stays held while the attempt is not yet ended.
            assert not locked.wait(1.5), f"the lock was freed first; the next start saw {seen}"
        finally:
            blocker.rollback()
            blocker.close()
            sweep.join(10)
            waiter.join(10)
            holder.close()
    assert fenced == [1] and seen == ["lost"], (fenced, seen)
    assert [(a.action, a.request_id) for a in notes] == [("fence", REQUEST)]
