"""Where a request's next attempt must run, read from its attempts by
``precheck_run`` on the real ledger: in the shared process, in quarantine
among a few suspects, or alone; and what a death in each place charges."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from loomflow_worker.runtime.sql import query

PARAMS: dict[str, Any] = {
    "kind": "run", "session_id": "s", "user_id": None, "agent": "a", "prompt_sha256": b"",
    "metadata": None, "stale": 60, "key": 42, "may_lock": False,
}

SHARED, GROUP, ALONE = 0, 1, 2


def _request(conn: psycopg.Connection[Any], deaths: list[list[str]], *,
             suspicion: int, lost_streak: int = 0) -> None:
    """Request ``r`` running, its attempts each with the requests that were
    open in the same process when it ended (``[]``: alone, or it ended)."""
    conn.execute("INSERT INTO runs (request_id, scope, session_id, agent, prompt, status,"
                 " attempts, suspicion, lost_streak) VALUES ('r', 's', 's', 'a', 'p',"
                 " 'running', %s, %s, %s)", (len(deaths), suspicion, lost_streak))
    for attempt, others in enumerate(deaths, start=1):
        worker = f"host:{attempt}"
        conn.execute("INSERT INTO run_attempts (request_id, attempt, worker, pid, epoch)"
                     " VALUES ('r', %s, %s, 1, 0)", (attempt, worker))
        for other in others:
            conn.execute("INSERT INTO runs (request_id, scope, session_id, agent, prompt,"
                         " status, attempts) VALUES (%s, %s, %s, 'a', 'p', 'running', 1)",
                         (f"{other}-{attempt}",) * 3)
            conn.execute("INSERT INTO run_attempts (request_id, attempt, worker, pid, epoch)"
                         " VALUES (%s, 1, %s, 1, 0)", (f"{other}-{attempt}", worker))


def _needs(conn: psycopg.Connection[Any], isolation: int) -> int:
    cur = conn.cursor(row_factory=dict_row)
    row = cur.execute(query("precheck_run"), {**PARAMS, "request_id": "r",
                                              "isolation": isolation}).fetchone()
    assert row is not None
    return int(row["quarantine"])


@pytest.mark.parametrize(("history", "suspicion", "lost_streak", "needs"), [
    # Died once with its shared process: it runs shared again.
    ([["n"]], 0, 0, SHARED),
    # Twice: among a few suspects (the second death is its last attempt's).
    ([["n"], ["n"]], 1, 0, GROUP),
    # Its group died with it: nobody's death, but it runs alone next.
    ([["n"], ["n"], ["g"]], 2, 0, ALONE),
    # Died again, with no other attempt of its process open: alone next.
    ([["n"], ["n"], []], 2, 0, ALONE),
    # Alone and died again: alone again (each such death is a crash).
    ([["n"], ["n"], ["g"], []], 3, 0, ALONE),
    # A lost attempt in a row with another: alone, whatever its suspicion.
    ([[]], 0, 1, ALONE),
])
def test_a_request_runs_as_apart_as_its_deaths_say(
    dsn: str, history: list[list[str]], suspicion: int, lost_streak: int, needs: int
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        _request(conn, history, suspicion=suspicion, lost_streak=lost_streak)
        if lost_streak:
            conn.execute("UPDATE run_attempts SET outcome = 'lost', ended_at = now()"
                         " WHERE request_id = 'r'")
        # A process that gives it less says what it needs, and takes no lock;
        # one that gives it as much or more runs it.
        for isolation in (SHARED, GROUP, ALONE):
            assert _needs(conn, isolation) == (needs if needs > isolation else 0), isolation


def test_a_suspect_whose_attempt_a_shutdown_interrupted_stays_in_quarantine(dsn: str) -> None:
    """A deploy puts a suspect's message back (queued, its attempt
    ``interrupted``): its next attempt still runs apart, not shared."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        _request(conn, [["n"], ["n"], []], suspicion=2)
        conn.execute("UPDATE run_attempts SET outcome = 'interrupted', ended_at = now()"
                     " WHERE request_id = 'r' AND attempt = 3")
        conn.execute("UPDATE runs SET status = 'queued' WHERE request_id = 'r'")
        assert _needs(conn, SHARED) == GROUP
        assert _needs(conn, GROUP) == 0
        # A request queued with no suspicion (nearly every one) is not looked at.
        conn.execute("UPDATE runs SET suspicion = 1 WHERE request_id = 'r'")
        assert _needs(conn, SHARED) == 0


def test_a_death_in_a_group_is_nobodys_crash_and_one_alone_is_its_own(dsn: str) -> None:
    """``start_request`` charges the last attempt: a death shared with another
    open attempt of its process raises suspicion, one alone counts a crash."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        _request(conn, [["n"], ["n"], ["g"]], suspicion=1)
        conn.execute("UPDATE runs SET suspicion = 2 WHERE request_id = 'r'")
        isolation = ALONE

        def start() -> tuple[int, int]:
            row = conn.execute(query("start_request"), {
                "request_id": "r", "scope": "s", "worker": "host:next", "pid": 1,
                "boot": "now", "stale": 60, "lease": 30.0, "interval": 2.0,
                "isolation": isolation, "version": None}).fetchone()
            assert row is not None
            counts = conn.execute("SELECT crashes, suspicion FROM runs"
                                  " WHERE request_id = 'r'").fetchone()
            assert counts is not None
            return int(counts[0]), int(counts[1])

        # Its group's death (another member open in that process): no crash.
        assert start() == (0, 3)
        # Its next attempt, alone, died (its heartbeat long stopped): a crash.
        conn.execute("UPDATE runs SET heartbeat_at = now() - interval '1 hour'")
        assert start() == (1, 3)
        # An attempt left open by an earlier process under the same worker id (a
        # container restarted in place: same host name, same pid) did not die
        # with it: its death alone is a crash still.
        conn.execute("INSERT INTO runs (request_id, scope, session_id, agent, prompt, status,"
                     " attempts) VALUES ('old', 'old', 'old', 'a', 'p', 'running', 1)")
        conn.execute("INSERT INTO run_attempts (request_id, attempt, worker, pid, epoch, boot)"
                     " VALUES ('old', 1, 'host:next', 1, 0, 'earlier')")
        conn.execute("UPDATE runs SET heartbeat_at = now() - interval '1 hour'")
        assert start() == (2, 3)


@pytest.mark.parametrize(("isolation", "charged"), [(GROUP, 0), (SHARED, 1), (ALONE, 1)])
def test_a_death_alone_in_a_group_that_others_had_left_is_shared(
    dsn: str, isolation: int, charged: int
) -> None:
    """A process of quarantine among a few suspects takes a new member as
    another leaves; one whose attempt replied may have left behind what kills
    the process later (a thread, memory). A member that dies there with no
    other attempt open is not charged once another ran in that process: its
    death raises its suspicion. Elsewhere (a shared process, a pool child of
    one slot, alone) such a death is its own, as before."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO runs (request_id, scope, session_id, agent, prompt, status,"
                     " attempts, suspicion) VALUES ('r', 's', 's', 'a', 'p', 'running', 1, 1)")
        conn.execute("INSERT INTO runs (request_id, scope, session_id, agent, prompt, status,"
                     " attempts) VALUES ('left', 'l', 'l', 'a', 'p', 'succeeded', 1)")
        for request_id, outcome in (("left", "succeeded"), ("r", None)):
            conn.execute("INSERT INTO run_attempts (request_id, attempt, worker, pid, epoch,"
                         " boot, isolation, outcome) VALUES (%s, 1, 'host:7', 7, 0, 'b', %s, %s)",
                         (request_id, isolation, outcome))
        row = conn.execute("SELECT shared FROM loomflow_worker_last_attempt('r', 1)").fetchone()
        assert row is not None and row[0] is (charged == 0)
        # The same process's member of an earlier incarnation (another boot)
        # does not make it shared.
        conn.execute("UPDATE run_attempts SET boot = 'earlier' WHERE request_id = 'left'")
        row = conn.execute("SELECT shared FROM loomflow_worker_last_attempt('r', 1)").fetchone()
        assert row is not None and row[0] is False
        conn.execute("UPDATE run_attempts SET boot = 'b' WHERE request_id = 'left'")
        conn.execute(query("start_request"), {
            "request_id": "r", "scope": "s", "worker": "host:8", "pid": 8, "boot": "c",
            "stale": 60, "lease": 30.0, "interval": 2.0, "isolation": ALONE,
            "version": None})
        counts = conn.execute("SELECT crashes, suspicion FROM runs WHERE request_id = 'r'"
                              ).fetchone()
        assert counts == (charged, 1 + (1 - charged)), counts
        # Its new attempt records how apart it runs.
        isolations = conn.execute("SELECT attempt, isolation FROM run_attempts"
                                  " WHERE request_id = 'r' ORDER BY attempt").fetchall()
        assert isolations == [(1, isolation), (2, ALONE)], isolations
