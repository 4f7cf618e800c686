"""A lock connection: one Postgres connection that carries many runs.

Postgres lets one session hold any number of advisory locks, so the scope
locks of every run a process has in flight live on a small fixed set of
these connections, and so do the runs' journal reads and writes (fencing:
whatever is written through a connection is written by the backend that
holds the lock).

A connection runs one statement at a time, so each lock connection has a
server task of its own that takes work from a queue:

- journal writes that arrive while a statement is in flight are sent
  together as one statement when it ends, so a step costs about one round
  trip however many runs write at once;
- work made of statements alone (:class:`Batch`: start a request, finish
  it, take or release a lock) waiting together is sent together, each
  turn's statements committed on their own (a Sync after each), so a burst
  of starts and finishes costs about one round trip too;
- any other work is a callable given the connection for one exclusive
  turn, which may be a transaction of several statements;
- urgent work (the heartbeat that keeps the connection's runs alive) goes
  before every queued write and turn, so a busy connection never makes its
  runs look dead;
- a caller that is cancelled stops waiting, but never a statement half
  sent: the shared connection stays usable for the other runs;
- a journal write or a batch whose caller finds the connection free (the
  server waits for work: a run alone on it, a quiet process) is sent by
  that caller at once, and its answer read by the socket's reader callback:
  no turn of the server task, which is most of a round trip's cost.

When the connection fails (its backend ended, the network lost, no answer
within the I/O timeout) every run on it is fenced at once: queued work
fails with :class:`LockLost`, the connection is closed (Postgres frees the
locks) and each lease's ``on_fenced`` callbacks run. A late event loop is
not a silent server: the I/O timeout counts only time the loop could have
read an answer (see :class:`_Watchdog`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

import psycopg
from psycopg.pq.abc import PGresult

from . import fastpath
from .conns import Conn as Conn
from .errors import LockLost

log = logging.getLogger(__name__)

T = TypeVar("T")
U = TypeVar("U")

Table = Literal["steps", "streams"]


class LeaseView(Protocol):
    """What a lock connection reads of a lease it carries (:class:`.store.Lease`,
    which uses the connection: a protocol here keeps the two modules apart)."""

    @property
    def scope(self) -> str: ...

    @property
    def request_id(self) -> str | None: ...

    def fence(self, cause: LockLost) -> None: ...


L = TypeVar("L", bound=LeaseView)


@dataclass(frozen=True)
class JournalRow:
    """One journal entry to upsert; ``token``, the attempt (request id and
    attempt number) that writes it, which the database checks is still open."""

    table: Table
    scope: str
    key: str
    value: bytes
    token: tuple[str, int] | None = None


@dataclass(frozen=True)
class Batch(Generic[T]):
    """A turn made of statements alone: ``build(conn)`` makes them (run as
    one implicit transaction) and ``read(conn, results)`` makes the turn's
    answer of their results (a ``psycopg.Error`` for one that failed, and
    for those after it). Batches waiting together go in one round trip."""

    build: Callable[[Conn], Sequence[fastpath.Call | None]]
    read: Callable[[Conn, list[PGresult | psycopg.Error]], T]

    def then(self, answer: Callable[[T], U]) -> Batch[U]:
        """This batch, its answer made into ``answer``'s."""
        read = self.read
        return Batch(self.build, lambda conn, results: answer(read(conn, results)))


#: The most batches sent in one round trip.
MAX_BATCHED = 64


@dataclass
class _Work:
    fn: Callable[[Conn], Awaitable[Any]] | None
    done: asyncio.Future[Any]
    batch: Batch[Any] | None = None


@dataclass
class _Write:
    rows: list[JournalRow]
    done: asyncio.Future[None]


class LockConnection(Generic[L]):
    """One lock connection and the server task that owns it, and the leases
    (``L``) it carries."""

    def __init__(self, conn: Conn, *, io_timeout: float, index: int = 0) -> None:
        self.conn = conn
        self.index = index
        self.io_timeout = io_timeout
        self.backend_pid = conn.info.backend_pid
        # The cause of the fence once the connection failed.
        self.fenced: LockLost | None = None
        self._leases: set[L] = set()
        self._work: deque[_Work] = deque()
        self._urgent: deque[_Work] = deque()
        self._writes: list[_Write] = []
        # The callers of the statement in flight.
        self._current: list[asyncio.Future[Any]] = []
        self._watchdog = _Watchdog(self)
        self._wake = asyncio.Event()
        self._server: asyncio.Task[None] | None = None
        # The server waits for work; and statements its caller sent at once.
        self._idle = False
        self._flight: _Flight | None = None
        # Statements of journal writes sent, and the rows they carried.
        self.batches = 0
        self.rows_written = 0
        # When (loop time) the last heartbeat that stamped every run of the
        # connection was sent: the runs are alive in the ledger since then.
        self.stamped_at = asyncio.get_running_loop().time()

    def start(self) -> None:
        self._server = asyncio.get_running_loop().create_task(
            self._serve(), name=f"loomflow-worker lock connection {self.index}"
        )

    @property
    def load(self) -> int:
        return len(self._leases)

    @property
    def depth(self) -> int:
        """Work and writes waiting for the connection."""
        return len(self._work) + len(self._writes) + len(self._urgent)

    # ---- what callers use --------------------------------------------------------------

    def attach(self, lease: L) -> None:
        """Carry ``lease``, whose lock was taken on this connection: its loss
        fences the lease, and its heartbeats stamp the lease's request."""
        self._leases.add(lease)

    def detach(self, lease: L) -> None:
        """Carry ``lease`` no more (its lock was released, or lost with the connection)."""
        self._leases.discard(lease)

    def running(self) -> list[L]:
        """The leases that run a request: those a heartbeat stamps."""
        return [lease for lease in self._leases if lease.request_id is not None]

    def unconfirmed_for(self) -> float:
        """Seconds (monotonic, loop time) since the last heartbeat that stamped
        every run of the connection was sent."""
        return asyncio.get_running_loop().time() - self.stamped_at

    def stamped(self, at: float) -> None:
        """Every request running here is alive in the ledger since ``at`` (loop
        time): a heartbeat sent then was answered, or there was none to stamp."""
        self.stamped_at = max(self.stamped_at, at)

    async def run(self, fn: Callable[[Conn], Awaitable[T]], *, urgent: bool = False) -> T:
        """``fn(conn)`` in an exclusive turn on the connection; ``urgent``
        work goes before everything queued."""
        if self.fenced is not None:
            raise self.fenced
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        (self._urgent if urgent else self._work).append(_Work(fn, done))
        self._wake.set()
        return await done

    async def send(self, batch: Batch[T]) -> T:
        """``batch`` in a turn on the connection, in one round trip with the
        batches waiting with it."""
        if self.fenced is not None:
            raise self.fenced
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        if self._free():
            calls = list(batch.build(self.conn))
            if self._send_now(calls, done, functools.partial(self._answer, batch, done)):
                return await done
            batch = Batch(lambda conn: calls, batch.read)
        self._work.append(_Work(None, done, batch))
        self._wake.set()
        return await done

    async def write(self, rows: list[JournalRow]) -> None:
        """Upsert ``rows``, batched with the writes of other runs."""
        if self.fenced is not None:
            raise self.fenced
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        write = _Write(rows, done)
        if not (self._free() and self._send_now(
                _journal_calls(self.conn, rows), done,
                functools.partial(self._wrote, [write], rows))):
            self._writes.append(write)
            self._wake.set()
        await done

    def fence(self, cause: str, exc: BaseException | None = None) -> LockLost:
        """Mark the connection lost: every run on it is fenced, the connection
        is closed. Returns the :class:`LockLost` the runs see."""
        if self.fenced is not None:
            return self.fenced
        fenced = LockLost(self._scopes(), cause)
        if exc is not None:
            fenced.__cause__ = exc
        self.fenced = fenced
        log.error(
            "lock connection %d (backend %s) lost: %s; fencing its %d runs",
            self.index, self.backend_pid, cause, self.load,
            extra={"action": "fenced", "backend": self.backend_pid, "runs": self.load},
        )
        self._abandon(fenced)
        self._fail_waiting(fenced)
        for lease in list(self._leases):
            lease.fence(fenced)
        self._wake.set()
        server = self._server
        if server is not None and server is not asyncio.current_task():
            # Stop a statement that may hang; the server closes the connection.
            server.cancel()
        return fenced

    async def aclose(self) -> None:
        if self.fenced is None:
            self.fenced = LockLost(self._scopes(), "the runtime closed")
        self._wake.set()
        server, self._server = self._server, None
        if server is not None:
            server.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await server
        else:
            await self._close()

    def _scopes(self) -> str:
        scopes = sorted(a.scope for a in self._leases)
        if len(scopes) == 1:
            return scopes[0]
        return f"{len(scopes)} scopes on lock connection {self.index}"

    async def _close(self) -> None:
        fastpath.unwatch(self.conn)
        try:
            await asyncio.wait_for(self.conn.close(), timeout=5)
        except Exception:
            log.debug("closing a lock connection failed", exc_info=True)

    # ---- the server task ---------------------------------------------------------------

    async def _serve(self) -> None:
        fastpath.watch(self.conn)
        try:
            while self.fenced is None:
                if self._flight is not None:
                    # Statements a caller sent at once are on their way.
                    if self._flight.by_server:
                        await self._complete(self._flight)
                    else:
                        await self._flight.landed
                    continue
                while self._urgent and self.fenced is None:
                    await self._take(self._urgent)
                # Writes and batches go together, and other work takes turns
                # with them, so neither waits on the other for long however
                # busy the connection is.
                if (self._writes or self._batch_next()) and self.fenced is None:
                    await self._together()
                if self._work and not self._batch_next() and self.fenced is None:
                    await self._take(self._work)
                if not self._writes and not self._work and not self._urgent:
                    self._wake.clear()
                    self._idle = True
                    try:
                        await self._wake.wait()
                    finally:
                        self._idle = False
        finally:
            # Closing frees every lock the connection holds.
            self.fenced = self.fenced or LockLost(self._scopes(), "the connection closed")
            self._abandon(self.fenced)
            self._fail_waiting(self.fenced)
            await asyncio.shield(self._close())

    def _batch_next(self) -> bool:
        return bool(self._work) and self._work[0].batch is not None

    async def _take(self, queue: deque[_Work]) -> None:
        work = queue.popleft()
        if not work.done.done():
            await self._turn(work)

    def _fail_waiting(self, exc: LockLost) -> None:
        """Fail the work and writes still queued: they will never be sent."""
        for work in (*self._urgent, *self._work):
            _fail(work.done, exc)
        for write in self._writes:
            _fail(write.done, exc)
        self._urgent.clear()
        self._work.clear()
        self._writes.clear()

    async def _guarded(
        self, fn: Callable[[Conn], Awaitable[T]], waiting: list[asyncio.Future[Any]]
    ) -> T:
        """``fn(conn)``, for the callers ``waiting`` on it. No answer within the
        I/O timeout fences the connection there and then: the callers hear of
        it at once, whatever the driver then takes to give up on the query."""
        self._current = waiting
        self._watchdog.start()
        try:
            return await fn(self.conn)
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            raise self._lost(exc) from exc
        finally:
            self._watchdog.stop()
            self._current = []

    async def _turn(self, work: _Work) -> None:
        assert work.fn is not None
        # psycopg may read the connection in this turn, with readers of its own.
        fastpath.unwatch(self.conn)
        try:
            result = await self._guarded(work.fn, [work.done])
        except BaseException as exc:
            _fail(work.done, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        finally:
            if self.fenced is None:
                fastpath.watch(self.conn)
        if not work.done.done():
            work.done.set_result(result)

    async def _together(self) -> None:
        """The journal writes waiting and the batches at the head of the work
        queue, in one round trip: the writes committed first (all or none),
        then each batch on its own."""
        writes, self._writes = self._writes, []
        works: list[_Work] = []
        while self._batch_next() and len(works) < MAX_BATCHED:
            work = self._work.popleft()
            if not work.done.done():
                works.append(work)
        rows = [row for write in writes for row in write.rows]
        calls: list[fastpath.Call | None] = _journal_calls(self.conn, rows) if rows else []
        written = len(calls)
        if calls:
            calls.append(fastpath.SYNC)
        spans: list[tuple[_Work, int, int]] = []
        first = written
        for work in works:
            assert work.batch is not None
            try:
                built = list(work.batch.build(self.conn))
            except BaseException as exc:
                _fail(work.done, exc)
                continue
            calls += [*built, fastpath.SYNC]
            # pipeline() answers each statement, not each commit point.
            answered = sum(1 for call in built if call is not fastpath.SYNC)
            spans.append((work, first, first + answered))
            first += answered
        if not calls:
            return
        waiting = [write.done for write in writes] + [work.done for work, _, _ in spans]
        try:
            results = await self._guarded(functools.partial(fastpath.pipeline, calls=calls),
                                          waiting)
        except BaseException as exc:
            for done in waiting:
                _fail(done, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for work, start, end in spans:
            assert work.batch is not None
            self._answer(work.batch, work.done, results[start:end])
        if writes:
            await self._written(writes, rows, results[:written])

    async def _written(self, writes: list[_Write], rows: list[JournalRow],
                       results: list[PGresult | psycopg.Error]) -> None:
        """Answer the writers of ``writes``, sent together (``results``)."""
        if self._wrote(writes, rows, results):
            return
        # One bad entry must not fail the others: each write on its own.
        for write in writes:
            try:
                await self._guarded(functools.partial(upsert, rows=write.rows), [write.done])
            except BaseException as exc:
                _fail(write.done, exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
            else:
                _succeed(write.done)

    # ---- statements sent by their caller -----------------------------------------------

    # A caller that finds the connection free sends its statements itself, and
    # the socket's reader callback reads their results and answers it: two
    # turns of the loop fewer than a turn of the server task (waking it, and
    # it waking on the answer), which is most of a round trip's cost to a run
    # that has the connection to itself. The caller waits only for its answer:
    # cancelled, it stops waiting, and the results are read all the same.

    def _free(self) -> bool:
        """Whether a caller may send its statements at once: the server waits
        for work, none is queued and nothing is in flight."""
        return (self._idle and self._flight is None and self.fenced is None
                and not self._urgent and not self._work and not self._writes)

    def _send_now(self, calls: Sequence[fastpath.Call | None], done: asyncio.Future[Any],
                  answer: Callable[[list[PGresult | psycopg.Error]], object]) -> bool:
        """Send ``calls`` now, and ``answer`` their results once they come (in
        the socket's reader callback). ``False`` when they can't go now (a
        statement not yet prepared on the connection, or a large one): the
        caller queues them for the server."""
        if not calls or not fastpath.prepared(self.conn, calls) or sum(
            len(value or b"") for call in calls if call is not None for value in call[1]
        ) > MAX_SENT_NOW or not fastpath.watched(self.conn):
            return False
        try:
            reading = fastpath.send(self.conn, calls)
            unsent = self.conn.pgconn.flush()
        except psycopg.Error as exc:
            self._current = [done]
            self._lost(exc)
            return True
        flight = self._flight = _Flight(
            reading, answer, asyncio.get_running_loop().create_future(), by_server=bool(unsent))
        self._current = [done]
        self._watchdog.start()
        if flight.by_server:
            # The socket's buffer is full: the server sends the rest and reads
            # the answer, waiting for the socket as its turns do.
            self._wake.set()
        else:
            fastpath.read_in_callback(self.conn, self._read)
        return True

    def _read(self) -> None:
        """The socket is readable: the results of the statements in flight,
        once they all came."""
        flight = self._flight
        if flight is None:
            return
        try:
            flight.reading.consume()
            results = flight.reading.read()
            if results is None:
                return
            flight.reading.end()
        except (psycopg.Error, OSError) as exc:
            self._lost(exc)
            return
        self._land()
        flight.answer(results)

    async def _complete(self, flight: _Flight) -> None:
        """The rest of statements a caller sent that the socket's buffer could
        not take at once, sent, and their answer read: a turn of the server."""

        async def finish(conn: Conn) -> list[PGresult | psycopg.Error]:
            results = await flight.reading.collect()
            flight.reading.end()
            return results

        waiting = self._current
        try:
            results = await self._guarded(finish, waiting)
        except BaseException as exc:
            self._land()
            for done in waiting:
                _fail(done, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        self._land()
        flight.answer(results)

    def _land(self) -> None:
        """The statements in flight are answered (or never will be): the
        connection is the server's again."""
        flight, self._flight = self._flight, None
        if flight is None:
            return
        fastpath.read_in_callback(self.conn, None)
        self._watchdog.stop()
        self._current = []
        if not flight.landed.done():
            flight.landed.set_result(None)

    def _abandon(self, exc: LockLost) -> None:
        """Fail the callers of the statement in flight (the server's, or those
        a caller sent at once): the connection is lost."""
        current = self._current
        self._land()
        self._current = []
        for done in current:
            _fail(done, exc)

    def _lost(self, exc: BaseException) -> LockLost:
        return self.fence(f"{type(exc).__name__}: {str(exc).strip() or 'connection lost'}", exc)

    def _wrote(self, writes: list[_Write], rows: list[JournalRow],
               results: list[PGresult | psycopg.Error]) -> bool:
        """Answer the writers of ``writes``, sent together (``results``), if
        that can be done at once: all written, or one writer whose write
        failed. ``False``: several, one of which failed, to be sent again
        each on its own (see ``_written``)."""
        failed = next((r for r in results if isinstance(r, psycopg.Error)), None)
        if failed is None:
            self.batches += 1
            self.rows_written += len(rows)
            for write in writes:
                _succeed(write.done)
            return True
        if len(writes) == 1:
            _fail(writes[0].done, failed)
            return True
        return False

    def _answer(self, batch: Batch[T], done: asyncio.Future[T],
                results: list[PGresult | psycopg.Error]) -> None:
        try:
            answer = batch.read(self.conn, results)
        except Exception as exc:
            _fail(done, exc)
        else:
            if not done.done():
                done.set_result(answer)


#: Statements a caller sends at once carry at most this many bytes of values:
#: a larger write waits for the server, which can wait for the socket's buffer.
MAX_SENT_NOW = 64 * 1024


@dataclass
class _Flight:
    """Statements a caller sent at once (see ``LockConnection._send_now``)."""

    reading: fastpath.Reading
    answer: Callable[[list[PGresult | psycopg.Error]], object]
    landed: asyncio.Future[None]
    # Part of them waited for room in the socket's buffer: the server sends
    # the rest and reads the answer.
    by_server: bool = False


#: A timer that fires this much after its time found the loop busy elsewhere.
LATE = 0.5


class _Watchdog:
    """Fences a connection whose statement gets no answer within its I/O
    timeout. A timer that fires late found the loop held (a CPU-bound burst,
    a tool that blocked it): the answer may be waiting unread, so the
    statement gets another turn of the loop, as long as the loop stays late.

    One timer serves the connection's statements one after another: a
    statement sets its due time, and a timer that finds a later one set
    waits for that one, so a round trip costs no timer of its own."""

    def __init__(self, lock_conn: LockConnection[Any]) -> None:
        self._lock_conn = lock_conn
        self._due: float | None = None
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._due = loop.time() + self._lock_conn.io_timeout
        if self._handle is None:
            self._handle = loop.call_at(self._due, self._expire, loop)

    def stop(self) -> None:
        self._due = None

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._handle = None
        due = self._due
        if due is None:
            return  # no statement waits
        now = loop.time()
        if now < due:
            self._handle = loop.call_at(due, self._expire, loop)
            return
        late = now - due
        if late > LATE:
            self._due = now + min(late, self._lock_conn.io_timeout)
            self._handle = loop.call_at(self._due, self._expire, loop)
            return
        silent = f"no answer within {self._lock_conn.io_timeout:g}s"
        self._lock_conn.fence(silent, TimeoutError(silent))


def _fail(done: asyncio.Future[Any], exc: BaseException) -> None:
    if not done.done():
        if isinstance(exc, asyncio.CancelledError):
            done.cancel()
        else:
            done.set_exception(exc)


def _succeed(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


async def upsert(conn: Conn, rows: list[JournalRow]) -> None:
    """Upsert journal rows in one transaction, raising the first error."""
    fastpath.succeeded(await fastpath.pipeline(conn, _journal_calls(conn, rows)))


def _journal_calls(conn: Conn, rows: list[JournalRow]) -> list[fastpath.Call | None]:
    """The statements that upsert journal rows (the last value of a key wins),
    as one transaction: a few as plain statements, more as one statement."""
    latest: dict[tuple[Table, str, str], JournalRow] = {}
    for row in rows:
        latest[(row.table, row.scope, row.key)] = row
    if len(latest) <= fastpath.MAX_PIPELINED_ROWS:
        return [fastpath.journal_call(row.table, row.scope, row.key, row.value, row.token)
                for row in latest.values()]
    params: dict[str, list[Any]] = {
        f"{prefix}_{column}": []
        for prefix in ("step", "stream")
        for column in ("scopes", "keys", "values", "requests", "attempts")
    }
    for row in latest.values():
        prefix = "step" if row.table == "steps" else "stream"
        params[f"{prefix}_scopes"].append(row.scope)
        params[f"{prefix}_keys"].append(row.key)
        params[f"{prefix}_values"].append(row.value)
        params[f"{prefix}_requests"].append(None if row.token is None else row.token[0])
        params[f"{prefix}_attempts"].append(None if row.token is None else row.token[1])
    return [PUT_JOURNAL_BATCH.call(conn, params)]


PUT_JOURNAL_BATCH = fastpath.Query.of("put_journal_batch")


def after_rows(rows: list[JournalRow], batch: Batch[T]) -> Batch[T]:
    """``batch`` with journal ``rows`` upserted first, in its transaction: an
    error of theirs skips the batch and is raised, and the rows stand or fall
    with the batch's first statements."""
    count = 0

    def build(conn: Conn) -> list[fastpath.Call | None]:
        nonlocal count
        calls = _journal_calls(conn, rows)
        count = len(calls)
        return [*calls, *batch.build(conn)]

    def read(conn: Conn, results: list[PGresult | psycopg.Error]) -> T:
        fastpath.succeeded(results[:count])
        return batch.read(conn, results[count:])

    return Batch(build, read)
