"""Fencing tokens: an attempt's journal writes and its finish land only while
the attempt is open in the ledger, checked by the database in the statement
that writes (migration 0034), whatever the worker believes of its lock
connection; and a run that has not heard from the ledger for too long
confirms its lease before a step, or is fenced, on the monotonic clock."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import anyio
import psycopg
import pytest

from loomflow_worker.execution import ledger
from loomflow_worker.execution.execute import confirm_within, fence_after, liveness
from loomflow_worker.execution.request import RunRequest
from loomflow_worker.runtime import LockLost, PostgresRuntime
from loomflow_worker.runtime.errors import FENCED_SQLSTATE
from loomflow_worker.runtime.store import Lease, Liveness
from loomflow_worker.settings import Settings

pytestmark = pytest.mark.anyio

REQUEST = RunRequest(prompt="p", session_id="s", user_id="u", agent="default", metadata={})


async def _open_attempt(dsn: str, request_id: str, attempt: int = 1) -> None:
    """``request_id`` running its attempt ``attempt``, as a start leaves it."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await ledger.ensure_row(conn, request_id, REQUEST)
        await conn.execute(
            "UPDATE runs SET status = 'running', attempts = %s, epoch = 0 "
            "WHERE request_id = %s", (attempt, request_id))
        await conn.execute(
            "INSERT INTO run_attempts (request_id, attempt, worker, pid, epoch) "
            "VALUES (%s, %s, 'w@h', 1, 0)", (request_id, attempt))


async def _end_attempt(dsn: str, request_id: str, attempt: int = 1) -> None:
    """What the sweeper does to a frozen attempt, or a next start to a dead one."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            "UPDATE run_attempts SET ended_at = clock_timestamp(), outcome = 'lost' "
            "WHERE request_id = %s AND attempt = %s", (request_id, attempt))


async def _steps(dsn: str, scope: str) -> set[str]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT step_name FROM journal_steps WHERE session_id = %s", (scope,))
        return {str(row[0]) for row in await cur.fetchall()}


#: The runs of a test share one lock connection.
one_connection = pytest.mark.parametrize("runtime", [1], indirect=True)


async def _lease(runtime: PostgresRuntime, scope: str, request_id: str | None) -> Lease:
    lease = await runtime.journal.acquire(scope, 0)
    await lease.open(pinned=None, resume_last=False)
    lease.request_id, lease.attempt = request_id, 1 if request_id else None
    return lease


@one_connection
async def test_a_write_of_an_ended_attempt_is_refused_by_the_database(
    dsn: str, runtime: PostgresRuntime
) -> None:
    await _open_attempt(dsn, "req-a")
    await _open_attempt(dsn, "req-b")
    a = await _lease(runtime, "scope-a", "req-a")
    b = await _lease(runtime, "scope-b", "req-b")
    # Both on the one lock connection, whose backend lives on.
    assert a.lock_conn is b.lock_conn
    await a.write_step("scope-a", "step-1", 1)
    await _end_attempt(dsn, "req-a")
    with pytest.raises(LockLost, match="the database refused its write"):
        await a.write_step("scope-a", "step-2", 2)
    assert a.fenced is not None and a.lock_conn.fenced is None
    # The other run of the connection writes on; the fenced one writes nothing more.
    await b.write_step("scope-b", "step-1", 1)
    with pytest.raises(LockLost):
        await a.write_step("scope-a", "step-3", 3)
    assert await _steps(dsn, "scope-a") == {"step-1"}
    assert "step-1" in await _steps(dsn, "scope-b")
    for lease in (a, b):
        await runtime.journal.release(lease)


@one_connection
async def test_a_refused_row_among_other_runs_writes_fails_only_its_own(
    dsn: str, runtime: PostgresRuntime
) -> None:
    """Writes of several runs sent together (a batch of arrays past eight rows)
    are one transaction: a refused row fails it, and each run's writes go
    again on their own, so only the ended attempt's are lost."""
    leases = []
    for i in range(12):
        await _open_attempt(dsn, f"req-{i}")
        leases.append(await _lease(runtime, f"scope-{i}", f"req-{i}"))
    for i, lease in enumerate(leases):
        await lease.write_step(f"scope-{i}", "first", i)
    await _end_attempt(dsn, "req-5")
    results = await asyncio.gather(
        *(lease.write_step(f"scope-{i}", "second", i) for i, lease in enumerate(leases)),
        return_exceptions=True,
    )
    assert [i for i, r in enumerate(results) if isinstance(r, LockLost)] == [5]
    assert all(r is None for i, r in enumerate(results) if i != 5)
    for i in range(12):
        assert ("second" in await _steps(dsn, f"scope-{i}")) == (i != 5)
    for lease in leases:
        await runtime.journal.release(lease)


async def test_a_run_outside_a_worker_writes_unchecked(runtime: PostgresRuntime, dsn: str) -> None:
    lease = await _lease(runtime, "scope-web", None)
    await lease.write_step("scope-web", "step-1", 1)
    assert "step-1" in await _steps(dsn, "scope-web")
    await runtime.journal.release(lease)


async def test_a_finish_of_an_ended_attempt_lands_nothing(dsn: str) -> None:
    """A request finished elsewhere (its next attempt ended it succeeded): the
    stale attempt's finish is refused whole, its result, its epoch advance and
    its handoff alike."""
    await _open_attempt(dsn, "req-f")
    await _end_attempt(dsn, "req-f")
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO run_attempts (request_id, attempt, worker, pid, epoch) "
            "VALUES ('req-f', 2, 'w2@h', 2, 0)")
        await conn.execute("UPDATE runs SET attempts = 2 WHERE request_id = 'req-f'")
        with pytest.raises(psycopg.Error) as refused:
            await ledger.finish_async(conn, "req-f", REQUEST.scope, 1, 0, status="succeeded",
                                result={"output": "stale"})
        assert refused.value.sqlstate == FENCED_SQLSTATE
        cur = await conn.execute(
            "SELECT status, result FROM runs WHERE request_id = 'req-f'")
        assert await cur.fetchone() == ("running", None)
        assert await _steps(dsn, REQUEST.scope) == set()
        # The open attempt finishes it.
        await ledger.finish_async(conn, "req-f", REQUEST.scope, 2, 0, status="succeeded",
                            result={"output": "fresh"})
        cur = await conn.execute("SELECT status FROM runs WHERE request_id = 'req-f'")
        assert await cur.fetchone() == ("succeeded",)


def _stamp_counter(calls: list[list[str]]) -> Any:
    async def stamp(conn: Any, ids: list[str]) -> set[str]:
        calls.append(ids)
        return await ledger.heartbeat(conn, ids)

    return stamp


@one_connection
async def test_a_step_waits_for_a_heartbeat_once_its_lease_went_unconfirmed(
    dsn: str, runtime: PostgresRuntime
) -> None:
    """Past ``confirm_within`` without a heartbeat (the process's loop late,
    its heartbeat task not yet run), the run confirms its lease with one
    heartbeat of its connection, shared by every run waiting there, before
    its step; past ``fence_after`` it is fenced at once, with no I/O."""
    stamps: list[list[str]] = []
    runtime.journal.keep_alive(Liveness(
        fence_after=1.0, confirm_within=0.2, lease_timeout=2.0,
        stamp=_stamp_counter(stamps), on_cancelled=lambda lease: None))
    for i in range(3):
        await _open_attempt(dsn, f"req-{i}")
    leases = [await _lease(runtime, f"scope-{i}", f"req-{i}") for i in range(3)]
    conn = leases[0].lock_conn
    conn.stamped(asyncio.get_running_loop().time())
    assert all(lease.live() for lease in leases)
    await anyio.sleep(0.3)
    assert not any(lease.live() for lease in leases)
    await asyncio.gather(*(lease.confirm() for lease in leases))
    assert len(stamps) == 1 and sorted(stamps[0]) == ["req-0", "req-1", "req-2"]
    assert all(lease.live() for lease in leases)
    # Stopped past fence_after (time.sleep holds the whole loop, as SIGSTOP would).
    time.sleep(1.1)
    with pytest.raises(LockLost, match="last confirmed alive"):
        await leases[0].confirm()
    assert conn.fenced is not None and all(lease.fenced is not None for lease in leases)
    assert len(stamps) == 1
    for lease in leases:
        await runtime.journal.release(lease)


def test_the_bounds_sit_well_below_the_lease() -> None:
    for lease, interval in ((30.0, 2.0), (3.0, 0.5), (5.0, 0.5), (4.5, 1.5), (30.0, 10.0)):
        settings = Settings(lease=lease, heartbeat_interval=interval)  # type: ignore[call-arg]
        assert confirm_within(settings) <= fence_after(settings) / 2 < lease / 2
        assert liveness(settings).fence_after == fence_after(settings) < lease
        # A late tick is no death: an interval and a half at least; checked each
        # interval, the fence comes before the sweeper may act.
        assert 1.5 * interval <= fence_after(settings) <= lease - 1.5 * interval


def test_a_lease_under_three_heartbeat_intervals_is_refused_saying_what_to_change() -> None:
    with pytest.raises(ValueError, match=r"at least three heartbeat intervals.*raise LEASE"):
        Settings(lease=20, heartbeat_interval=10)  # type: ignore[call-arg]
    Settings(lease=0.3, heartbeat_interval=0.1)  # type: ignore[call-arg]  # three, in floats
