"""The handoff between consecutive requests of a scope, statement by statement.

A finishing request hands the scope to the next one and publishes it again
only when a worker already took and parked its message; a worker about to
park a message stops if the scope was handed to it meanwhile. Both decide in
one UPDATE of the next request's row, so whichever comes second sees the
first, whatever the interleaving: these tests hold one side's transaction
open while the other runs, on the real Postgres."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import psycopg
import pytest
from loomflow import Agent

from loomflow_worker import NoMemory, register_agent
from loomflow_worker.execution import ledger
from loomflow_worker.execution.execute import execute
from loomflow_worker.execution.request import RunRequest, check_request
from loomflow_worker.runtime.lockconn import Batch
from loomflow_worker.runtime.store import Lease
from loomflow_worker.settings import Settings
from loomflow_worker.testing import DeterministicModel
from loomflow_worker.worker.context import WorkerContext
from tests.waiting import wait_until_async

pytestmark = pytest.mark.anyio

FIRST, NEXT = "req-first", "req-next"
REQUEST = RunRequest(prompt="p", session_id="s", user_id="u", agent="default", metadata={})


@pytest.fixture
async def conns(dsn: str) -> AsyncIterator[tuple[Any, Any]]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as setup:
        for request_id in (FIRST, NEXT):
            await ledger.ensure_row(setup, request_id, REQUEST)
        await setup.execute(
            "UPDATE runs SET status = 'running', attempts = 1 WHERE request_id = %s", (FIRST,))
        # Its attempt, open: a finish lands only for an open attempt (its fencing token).
        await setup.execute(
            "INSERT INTO run_attempts (request_id, attempt, worker, pid, epoch) "
            "VALUES (%s, 1, 'w@h', 1, 0)", (FIRST,))
    async with await psycopg.AsyncConnection.connect(dsn) as hander, \
            await psycopg.AsyncConnection.connect(dsn, autocommit=True) as parker:
        yield hander, parker


async def _finish_first(conn: Any) -> ledger.Handoff | None:
    return await ledger.finish_async(conn, FIRST, REQUEST.scope, 1, 0, status="succeeded",
                                     result={})


async def _hand_off_after_a_cancel(conn: Any) -> ledger.Handoff | None:
    await conn.execute("UPDATE runs SET status = 'cancelled' WHERE request_id = %s", (FIRST,))
    return await ledger.hand_off_async(conn, REQUEST.scope)


HANDERS = [_finish_first, _hand_off_after_a_cancel]
Hander = Callable[[Any], Awaitable[ledger.Handoff | None]]


async def _blocked(
    call: Callable[[], Awaitable[Any]], on: Any, release: Callable[[], Awaitable[None]]
) -> Any:
    """Run ``call`` on connection ``on``, which must wait on a lock until ``release`` runs."""
    result: list[Any] = []

    async def run() -> None:
        result.append(await call())

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        async with await psycopg.AsyncConnection.connect(on.info.dsn, autocommit=True) as look:
            async def waits_or_ended() -> bool:
                return bool(result) or await _waits_on_a_lock(look, on.info.backend_pid)

            await wait_until_async(waits_or_ended, "the second statement waiting on a lock", 10,
                                   every=0.01)
        assert not result, "the second statement did not wait for the first"
        await release()
    return result[0]


async def _waits_on_a_lock(conn: Any, pid: int) -> bool:
    cur = await conn.execute("SELECT cardinality(pg_blocking_pids(%s)) > 0", (pid,))
    row = await cur.fetchone()
    return bool(row and row[0])


@pytest.mark.parametrize("hand", HANDERS)
async def test_handed_first_the_parker_sees_it_and_does_not_park(
    conns: tuple[Any, Any], hand: Hander
) -> None:
    hander, parker = conns
    handoff = await hand(hander)  # transaction still open
    assert handoff is not None and handoff.pending.request_id == NEXT
    assert not handoff.received and handoff.dispatch == []
    may_park = await _blocked(lambda: ledger.park(parker, NEXT), parker, hander.commit)
    assert may_park is False


@pytest.mark.parametrize("hand", HANDERS)
async def test_parked_first_the_hander_sees_it_and_publishes(
    conns: tuple[Any, Any], hand: Hander
) -> None:
    hander, parker = conns
    await parker.set_autocommit(False)
    assert await ledger.park(parker, NEXT) is True  # transaction still open
    handoff = await _blocked(lambda: hand(hander), hander, parker.commit)
    await hander.commit()
    assert handoff is not None and handoff.received
    assert [p.request_id for p in handoff.dispatch] == [NEXT]


async def test_a_scope_is_handed_once(conns: tuple[Any, Any]) -> None:
    hander, parker = conns
    await ledger.park(parker, NEXT)
    first = await _finish_first(hander)
    await hander.commit()
    assert first is not None and first.received
    # A duplicate of the finished request looks again: already handed, so
    # nothing is published twice.
    assert await ledger.hand_off_async(hander, REQUEST.scope) is None


@register_agent("test-handoff-look")
def _quick(runtime: Any) -> Agent:
    return Agent("a", model=DeterministicModel(), runtime=runtime, memory=NoMemory(),
                 auto_extract=False)


async def test_a_request_that_parks_after_the_finish_chose_no_one_is_handed_the_scope(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request enqueued just after the one before it finished (so that
    finish chose no one) finds the scope's lock still held, waits for it, and
    parks: the finishing worker looks once more after its unlock and hands
    it the scope, to publish again. Two worker contexts (two lock
    connections); the second request arrives between the finish and the
    unlock of the first."""
    settings = Settings(database_url=dsn, events=False)  # type: ignore[arg-type]
    first_ctx, next_ctx = WorkerContext(settings), WorkerContext(settings)
    args = {"prompt": "hello", "session_id": "s", "user_id": "u",
            "agent": "test-handoff-look", "metadata": None}
    req = check_request(settings, kind="run", **args)
    enqueue = ledger.EnqueuePool()
    parked: list[str] = []
    real_finish, real_send = ledger.finish_batch, Lease.send
    finishes: list[Batch[Any]] = []

    def finish_batch(*a: Any, **kw: Any) -> Batch[ledger.Handoff | None]:
        finishes.append(real_finish(*a, **kw))
        return finishes[-1]

    async def send_then_the_next_arrives(lease: Lease, batch: Batch[Any]) -> Any:
        answer = await real_send(lease, batch)
        if batch in finishes and not parked:
            enqueue.insert(dsn, 5, NEXT, req)
            outcome = await execute(next_ctx, NEXT, args, "run")
            parked.append(outcome.kind)
        return answer

    monkeypatch.setattr(ledger, "finish_batch", finish_batch)
    monkeypatch.setattr(Lease, "send", send_then_the_next_arrives)
    try:
        enqueue.insert(dsn, 5, FIRST, req)
        outcome = await execute(first_ctx, FIRST, args, "run")
    finally:
        enqueue.close()
        await first_ctx.aclose()
        await next_ctx.aclose()
    assert parked == ["parked"]
    assert outcome.kind == "succeeded"
    assert [p.request_id for p in outcome.dispatch] == [NEXT]
