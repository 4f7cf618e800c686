"""A running request whose worker died is published again at once; the copy
can die too, with a process that received it and died before it started it
(the process a poison request's second attempt kills takes hundreds of such
copies with it). That copy is then in no queue and held by no live worker:
the sweeper publishes another once the broker's count of its queue says so,
after ``queued_after`` as for a queued request's lost message, not after
``after`` (``REDISPATCH_AFTER``, a minute by default). Against the real
database, with the broker's counts given."""

from __future__ import annotations

from typing import Any

import psycopg

from loomflow_worker.execution import ledger
from loomflow_worker.sweeper import ledger_recovery as recovery

QUEUED_AFTER = 5.0
AFTER = 60.0


def _found(conn: psycopg.Connection[Any], waiting: dict[str, int | None]) -> dict[str, str]:
    """The orphans, with the status each is taken for."""
    found = recovery.orphans(conn, waiting=waiting, default_queue="q", after=AFTER,
                             queued_after=QUEUED_AFTER, held_within=60, dead_after=1, limit=10)
    return {pending.request_id: status for pending, status in found}


def _orphans(conn: psycopg.Connection[Any], waiting: dict[str, int | None]) -> list[str]:
    return sorted(_found(conn, waiting))


def _running(conn: psycopg.Connection[Any], request_id: str, key: int, *, started: float,
             swept: float | None) -> None:
    """A running request whose worker died ``started`` seconds after it
    started (its heartbeat as old), published again ``swept`` seconds ago."""
    conn.execute(
        "INSERT INTO runs (request_id, scope, session_id, agent, prompt, status, lock_key,"
        " attempts, started_at, heartbeat_at, swept_at, dispatched_at)"
        " VALUES (%(id)s, %(id)s, %(id)s, 'default', 'hi', 'running', %(key)s, 1,"
        "         now() - make_interval(secs => %(started)s),"
        "         now() - make_interval(secs => %(started)s),"
        "         now() - make_interval(secs => %(swept)s),"
        "         now() - make_interval(secs => coalesce(%(swept)s, %(started)s)))",
        {"id": request_id, "key": key, "started": started, "swept": swept})


def test_a_copy_that_died_unstarted_is_published_again_once_the_queue_has_lost_it(
    dsn: str,
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        # Its copy went out 10 s ago and never started; the other's 2 s ago.
        _running(conn, "copy-lost", 91, started=20, swept=10)
        _running(conn, "copy-young", 92, started=20, swept=2)
        # The broker holds the copy: it waits its turn, however long.
        assert _orphans(conn, {"q": 2}) == []
        # It holds one of the two: the older copy is the one taken (a queue
        # hands out its oldest first), and it is gone.
        assert _orphans(conn, {"q": 1}) == ["copy-lost"]
        # It holds none: the younger is not yet QUEUED_AFTER old.
        assert _found(conn, {"q": 0}) == {"copy-lost": recovery.COPY_LOST}
        # The broker did not answer: only after AFTER.
        assert _orphans(conn, {"q": None}) == []
        assert _orphans(conn, {}) == []

        # A live worker that holds the copy unstarted (a rate limit, a busy
        # loop) says so, and it is not taken for lost.
        assert ledger.mark_held(conn, ["copy-lost", "copy-young"]) == {"copy-lost", "copy-young"}
        assert _orphans(conn, {"q": 0}) == []

        # Once an attempt started from it, the copy is no longer held (the
        # worker forgets it), and that attempt's own death is taken at once.
        conn.execute("UPDATE runs SET started_at = now() - interval '3 s',"
                     " heartbeat_at = now() - interval '3 s' WHERE request_id = 'copy-lost'")
        assert ledger.mark_held(conn, ["copy-lost"]) == set()
        assert _found(conn, {"q": 0}) == {"copy-lost": "running"}


def test_a_copy_parked_by_the_worker_that_took_it_is_not_counted_in_its_queue(
    dsn: str,
) -> None:
    # A queued request's message waits in the queue (the broker counts 1),
    # and the copy of a running one was taken since and parked (its worker
    # acknowledged it: a full concurrency limit). Counting that copy among the
    # queue's messages would take the queued request's message for lost.
    with psycopg.connect(dsn, autocommit=True) as conn:
        _running(conn, "copy-parked", 94, started=30, swept=15)
        conn.execute("UPDATE runs SET received_at = now() - interval '10 s'"
                     " WHERE request_id = 'copy-parked'")
        conn.execute(
            "INSERT INTO runs (request_id, scope, session_id, agent, prompt, status, lock_key,"
            " dispatched_at) VALUES ('queued-1', 'queued-1', 'queued-1', 'default', 'hi',"
            " 'queued', 95, now() - interval '20 s')")
        assert _orphans(conn, {"q": 1}) == []
        # The queue lost it: that one goes again.
        assert _found(conn, {"q": 0}) == {"queued-1": "queued"}


def test_a_copy_whose_scope_lock_is_held_is_no_orphan(dsn: str) -> None:
    # The copy started on a live worker that holds the scope's lock: however
    # the counts read, it is not published again.
    with psycopg.connect(dsn, autocommit=True) as conn, \
            psycopg.connect(dsn, autocommit=True) as holder:
        _running(conn, "copy-held", 93, started=20, swept=10)
        holder.execute("SELECT pg_advisory_lock(93)")
        assert _orphans(conn, {"q": 0}) == []
        holder.execute("SELECT pg_advisory_unlock(93)")
        assert _orphans(conn, {"q": 0}) == ["copy-held"]
