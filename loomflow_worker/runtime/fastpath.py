"""The hot statements of a lock connection, sent straight through libpq.

A run sends a handful of statements, most of them one journal upsert each:
a few bytes out, a command tag back. Through psycopg's cursor each costs
about 120 us of CPU in this process: a cursor, its transformer, the query's
conversion and prepare bookkeeping, a wait generator; the round trip itself
(a prepared statement sent, its result read) costs a fraction of that. So
these statements go through psycopg's libpq wrapper (``conn.pgconn``)
directly: prepared once per connection under a name of this module's, their
parameters sent as bytes in binary format, their results read as
``PGresult``. Everything else on the connection still goes through psycopg.

The caller owns the connection for the statement (a lock connection's turn:
nothing else uses it meanwhile), and errors are psycopg's own: a statement
that fails raises the error psycopg would have raised, a connection that
fails raises :class:`psycopg.OperationalError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import AsyncConnection, errors
from psycopg.adapt import PyFormat, Transformer
from psycopg.pq import DiagnosticField, ExecStatus, Format
from psycopg.pq.abc import PGresult

from .sql import query

TEXT_OID = 25
BYTEA_OID = 17
INT4_OID = 23
INT8_OID = 20
INT2_OID = 21
BOOL_OID = 16

_PLACEHOLDER = re.compile(r"%\((\w+)\)s")
_OK = (ExecStatus.COMMAND_OK, ExecStatus.TUPLES_OK)
_BINARY = int(Format.BINARY)
DIAG_SQLSTATE = DiagnosticField.SQLSTATE


@dataclass(frozen=True)
class Statement:
    """A named query (``loomflow_worker/*/sql``), its ``%(name)s`` placeholders numbered
    in the order ``params`` gives, each parameter of the type in ``types``."""

    name: bytes
    sql: bytes
    types: tuple[int, ...]
    formats: tuple[int, ...]  # every parameter in binary format

    @classmethod
    def of(cls, name: str, params: Sequence[str], types: Sequence[int]) -> Statement:
        if len(params) != len(types):
            raise ValueError(f"{name}: {len(params)} parameters but {len(types)} types")
        numbers = {param: f"${i}" for i, param in enumerate(params, 1)}
        text = query(name)
        used = set(_PLACEHOLDER.findall(text))
        if used != set(params):
            raise ValueError(f"{name}: the query takes {sorted(used)}, not {sorted(params)}")
        sql = _PLACEHOLDER.sub(lambda m: numbers[m[1]], text)
        return cls(f"loomflow_worker_{name}".encode(), sql.encode(), tuple(types),
                   (_BINARY,) * len(types))


class Query:
    """A named query (``loomflow_worker/*/sql``) sent the same way, for statements
    whose parameters and columns are not all of the types above: psycopg's
    adapters dump its parameters (each typed as its value says) and
    :func:`dicts` loads its rows. It is prepared once per connection for each
    set of parameter types it is called with."""

    def __init__(self, name: str, sql: bytes, params: tuple[str, ...]) -> None:
        self.name = name
        self.sql = sql
        self.params = params
        self._typed: dict[tuple[tuple[int, ...], tuple[int, ...]], Statement] = {}

    @classmethod
    def of(cls, name: str) -> Query:
        """The query ``name``, its ``%(name)s`` placeholders numbered in the
        order they first appear."""
        names: list[str] = []

        def number(match: re.Match[str]) -> str:
            if match[1] not in names:
                names.append(match[1])
            return f"${names.index(match[1]) + 1}"

        sql = _PLACEHOLDER.sub(number, query(name)).replace("%%", "%").encode()
        return cls(name, sql, tuple(names))

    def call(self, conn: AsyncConnection[Any], params: Mapping[str, Any]) -> Call:
        """The query with ``params``, for :func:`execute` or :func:`pipeline`."""
        tx = Transformer(conn)
        values = tx.dump_sequence([params[name] for name in self.params],
                                  [PyFormat.AUTO] * len(self.params))
        key = (tuple(tx.types or ()), tuple(int(f) for f in tx.formats or ()))
        stmt = self._typed.get(key)
        if stmt is None:
            stmt = self._typed[key] = Statement(
                f"loomflow_worker_{self.name}_{len(self._typed)}".encode(), self.sql, *key)
        return stmt, values


def dicts(conn: AsyncConnection[Any], res: PGresult) -> list[dict[str, Any]]:
    """The rows of a result, as dicts by column name, each value loaded as
    psycopg loads it."""
    tx = Transformer(conn)
    tx.set_pgresult(res)
    names = [(res.fname(i) or b"").decode() for i in range(res.nfields)]
    return [dict(zip(names, row, strict=True)) for row in tx.load_rows(0, res.ntuples, tuple)]


#: A statement's parameters, each in the format its statement says.
Values = Sequence[bytes | bytearray | memoryview | None]


# The statements prepared on each connection, by name.
_prepared: weakref.WeakKeyDictionary[AsyncConnection[Any], set[bytes]] = (
    weakref.WeakKeyDictionary()
)


def _prepared_on(conn: AsyncConnection[Any]) -> set[bytes]:
    found = _prepared.get(conn)
    if found is None:
        found = _prepared[conn] = set()
    return found


async def execute(conn: AsyncConnection[Any], stmt: Statement, values: Values) -> PGresult:
    """Run ``stmt`` with ``values`` (each in the binary format of its type) on
    ``conn``, preparing it first on a connection that has not seen it;
    returns its result (rows in binary format)."""
    if stmt.name not in _prepared_on(conn):
        await _prepare(conn, (stmt,))
    conn.pgconn.send_query_prepared(stmt.name, values, stmt.formats, _BINARY)
    return await _result(conn)


#: In :func:`pipeline`, a commit point between two statements.
SYNC = None

Call = tuple[Statement, Values]


async def pipeline(
    conn: AsyncConnection[Any], calls: Sequence[Call | None]
) -> list[PGresult | psycopg.Error]:
    """Send ``calls`` in one round trip (libpq's pipeline mode) and return each
    statement's result, or the error it raised, in order.

    Statements up to a :data:`SYNC` (and the end) run as one implicit
    transaction, committed there: a statement that must see the previous
    one committed, or must not run before it is (an unlock after a write),
    goes after a ``SYNC``. After an error, the statements up to the next
    ``SYNC`` are skipped (:class:`psycopg.errors.PipelineAborted`) and the
    rest run."""
    await _prepare(conn, [call[0] for call in calls if call is not None])
    reading = send(conn, calls)
    try:
        results = await reading.collect()
    except BaseException:
        # Results may be left unread (a lost connection, a cancelled wait): the
        # error going up is the one to see, and the owner closes the connection.
        with contextlib.suppress(psycopg.Error):
            reading.end()
        raise
    reading.end()
    return results


def prepared(conn: AsyncConnection[Any], calls: Sequence[Call | None]) -> bool:
    """Whether every statement of ``calls`` is prepared on ``conn`` already
    (so that :func:`send` may send them)."""
    done = _prepared_on(conn)
    return all(call is None or call[0].name in done for call in calls)


def send(conn: AsyncConnection[Any], calls: Sequence[Call | None]) -> Reading:
    """Queue ``calls`` (statements prepared on ``conn`` already) as
    :func:`pipeline` sends them, without waiting: the caller flushes
    (``conn.pgconn.flush()``) and reads their results with the
    :class:`Reading` returned."""
    pg = conn.pgconn
    statements = [call for call in calls if call is not SYNC]
    if len(statements) == 1:
        # One statement is its own transaction: no pipeline mode needed.
        stmt, values = statements[0]
        pg.send_query_prepared(stmt.name, values, stmt.formats, _BINARY)
        return Reading(conn, None)
    if calls and calls[-1] is not SYNC:
        calls = [*calls, SYNC]
    pg.enter_pipeline_mode()
    syncs = 0
    try:
        for call in calls:
            if call is SYNC:
                pg.pipeline_sync()
                syncs += 1
            else:
                stmt, values = call
                pg.send_query_prepared(stmt.name, values, stmt.formats, _BINARY)
    except BaseException:
        with contextlib.suppress(psycopg.Error):
            pg.exit_pipeline_mode()
        raise
    return Reading(conn, syncs)


class Reading:
    """The results of the statements :func:`send` sent, read as they come:
    :meth:`read` after each :meth:`consume` of what the socket holds, until
    it returns them."""

    def __init__(self, conn: AsyncConnection[Any], syncs: int | None) -> None:
        self.conn = conn
        # Commit points still to come; None: one statement, not in pipeline mode.
        self.syncs = syncs
        self.out: list[PGresult | psycopg.Error] = []
        # The current statement's result: its first error, else its last result.
        self.found: PGresult | None = None

    def read(self) -> list[PGresult | psycopg.Error] | None:
        """Each statement's result or error, once every one came; ``None``
        until then. Reads only what libpq holds (no read that would only say
        "not yet")."""
        pg = self.conn.pgconn
        while not pg.is_busy():
            res = pg.get_result()
            if res is None:  # the end of one statement's results
                if self.syncs is None:
                    if self.found is None:
                        raise psycopg.OperationalError("the server sent no result")
                    return [_checked(self.found, self.conn)]
                if self.found is not None:
                    self.out.append(_checked(self.found, self.conn))
                self.found = None
            elif res.status == ExecStatus.PIPELINE_SYNC:
                assert self.syncs is not None
                self.syncs -= 1
                if not self.syncs:
                    return self.out
            elif self.found is None or self.found.status in _OK:
                self.found = res  # the first error of a statement wins
        return None

    async def collect(self) -> list[PGresult | psycopg.Error]:
        """Send what libpq still holds of the statements, then wait for the
        socket until :meth:`read` returns their results."""
        await _flush(self.conn)
        while (results := self.read()) is None:
            await _readable(self.conn)
            self.consume()
        return results

    def consume(self) -> None:
        """Take in what the socket holds (raising how the server said it ended
        the connection, if it did)."""
        _consume(self.conn, self.found)

    def end(self) -> None:
        """Leave pipeline mode, if the statements were sent in it."""
        if self.syncs is not None:
            self.conn.pgconn.exit_pipeline_mode()


def succeeded(results: Sequence[PGresult | psycopg.Error]) -> list[PGresult]:
    """:func:`pipeline`'s results when every statement succeeded; else the
    first error is raised."""
    for result in results:
        if isinstance(result, psycopg.Error):
            raise result
    return [result for result in results if not isinstance(result, psycopg.Error)]


def _checked(res: PGresult, conn: AsyncConnection[Any]) -> PGresult | psycopg.Error:
    if res.status in _OK:
        return res
    if res.status == ExecStatus.PIPELINE_ABORTED:
        return errors.PipelineAborted("skipped: an earlier statement failed")
    return errors.error_from_result(res, encoding=conn.info.encoding)


async def _prepare(conn: AsyncConnection[Any], stmts: Sequence[Statement]) -> None:
    """Prepare on ``conn`` the statements of ``stmts`` it has not seen."""
    done = _prepared_on(conn)
    for stmt in stmts:
        if stmt.name not in done:
            conn.pgconn.send_prepare(stmt.name, stmt.sql, stmt.types)
            await _result(conn)
            done.add(stmt.name)


async def _result(conn: AsyncConnection[Any]) -> PGresult:
    """Flush what was sent and read the command's result, raising its error."""
    answer = await _answer(conn)
    if isinstance(answer, psycopg.Error):
        raise answer
    return answer


async def _answer(conn: AsyncConnection[Any]) -> PGresult | psycopg.Error:
    """Flush what was sent and read the command's result, or the error it
    raised (a connection that fails raises)."""
    return (await Reading(conn, None).collect())[0]


def _consume(conn: AsyncConnection[Any], found: PGresult | None) -> None:
    """Read what the server sent. A server that ended the connection (a
    terminated backend, a shutdown) said why before it closed: that error
    (``found``, or one still in libpq's buffer), as psycopg would raise it
    (``AdminShutdown``...), rather than a bare failure to read."""
    pg = conn.pgconn
    try:
        pg.consume_input()
    except psycopg.OperationalError as exc:
        _socket_closed(conn)
        said = found if found is not None and found.status not in _OK else pg.get_result()
        if said is not None and said.error_field(DIAG_SQLSTATE):
            raise errors.error_from_result(said, encoding=conn.info.encoding) from exc
        raise


async def _flush(conn: AsyncConnection[Any]) -> None:
    """Send what libpq holds, waiting while the socket's buffer is full."""
    try:
        while conn.pgconn.flush():
            await _writable(conn)
    except psycopg.OperationalError:
        _socket_closed(conn)
        raise


def _socket_closed(conn: AsyncConnection[Any]) -> None:
    """libpq failed to read or write ``conn``: after a failed read it has
    closed the socket, and no reader may stay on that file descriptor, which
    the next socket opened in this process may get (a reader removed from a
    socket still open is added again by the next wait)."""
    watched = _watched.get(conn)
    if watched is not None:
        watched.stop()


async def _readable(conn: AsyncConnection[Any]) -> None:
    """Wait until the connection's socket can be read."""
    await _wait(conn, write=False)


async def _writable(conn: AsyncConnection[Any]) -> None:
    """Wait until the connection's socket can be written (its buffer was full)."""
    await _wait(conn, write=True)


class _Watch:
    """A connection's socket watched for reading for as long as the
    connection is this module's alone (a lock connection between its turns
    that go through psycopg): one reader registered once, rather than one
    registered and removed on each wait. The socket turning readable while
    nobody waits (a backend ended between turns) removes the reader, leaving
    what came for the next wait to read, as an unwatched connection does."""

    def __init__(self, conn: AsyncConnection[Any], loop: asyncio.AbstractEventLoop) -> None:
        self.conn = conn
        self.loop = loop
        self.fd: int | None = None
        self.ready: asyncio.Future[None] | None = None
        self.resumed = False
        # Called when the socket turns readable, instead of waking a waiter
        # (see read_in_callback).
        self.callback: Callable[[], None] | None = None

    def listen(self) -> None:
        if self.fd is None:
            self.fd = self.conn.pgconn.socket
            self.loop.add_reader(self.fd, self._readable)

    async def wait(self) -> None:
        self.listen()
        ready = self.ready = self.loop.create_future()
        try:
            await ready
        finally:
            self.ready = None
            # The loop's turn that resumed this waiter may hold a call of
            # _readable for what the waiter reads now: until the next turn,
            # a call finding no waiter is that one.
            if not self.loop.is_closed():  # else a coroutine closed at shutdown
                self.resumed = True
                self.loop.call_soon(self._settled)

    def _settled(self) -> None:
        self.resumed = False

    def _readable(self) -> None:
        if self.callback is not None:
            self.callback()
            return
        ready = self.ready
        if ready is None:
            if not self.resumed:
                self.stop()
        elif not ready.done():
            ready.set_result(None)
        # Done: its waiter reads the socket as soon as it resumes.

    def stop(self) -> None:
        if self.fd is not None:
            self.loop.remove_reader(self.fd)
            self.fd = None


_watched: weakref.WeakKeyDictionary[AsyncConnection[Any], _Watch] = (
    weakref.WeakKeyDictionary()
)


def watch(conn: AsyncConnection[Any]) -> None:
    """From now on this module's waits for ``conn``'s answers share one
    reader on its socket. Only for a connection nothing else reads between
    :func:`watch` and :func:`unwatch` (psycopg registers and removes readers
    of its own), and :func:`unwatch` it before it is closed."""
    if conn not in _watched:
        _watched[conn] = _Watch(conn, asyncio.get_running_loop())


def watched(conn: AsyncConnection[Any]) -> bool:
    """Whether :func:`watch` watches ``conn``."""
    return conn in _watched


def read_in_callback(conn: AsyncConnection[Any], callback: Callable[[], None] | None) -> None:
    """While ``callback`` is set, it is called each time the socket of
    ``conn`` (a connection :func:`watch` watches; else nothing is set) turns
    readable, in the loop's callback: it reads the results itself, with
    :class:`Reading`, and no task waits. ``None`` sets it back."""
    found = _watched.get(conn)
    if found is not None:
        if callback is not None:
            found.listen()
        found.callback = callback


def unwatch(conn: AsyncConnection[Any]) -> None:
    """Remove the reader :func:`watch` set on ``conn``'s socket, before
    psycopg uses the connection or it is closed."""
    found = _watched.pop(conn, None)
    if found is not None:
        found.stop()


async def _wait(conn: AsyncConnection[Any], *, write: bool) -> None:
    if not write:
        watched = _watched.get(conn)
        if watched is not None:
            await watched.wait()
            return
    loop = asyncio.get_running_loop()
    fd = conn.pgconn.socket
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    if write:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


# ---- values -----------------------------------------------------------------------------


def rows(res: PGresult) -> list[dict[str, Any]]:
    """The rows of a binary-format result, as dicts by column name."""
    columns: list[tuple[str, Callable[[bytes], Any]]] = []
    for i in range(res.nfields):
        name = (res.fname(i) or b"").decode()
        load = _LOADERS.get(res.ftype(i))
        if load is None:
            raise psycopg.NotSupportedError(
                f"column {name!r} has type oid {res.ftype(i)}, which the fast path can't read"
            )
        columns.append((name, load))
    out = []
    for r in range(res.ntuples):
        row: dict[str, Any] = {}
        for c, (name, load) in enumerate(columns):
            raw = res.get_value(r, c)
            row[name] = None if raw is None else load(raw)
        out.append(row)
    return out


def _int(raw: bytes) -> int:
    return int.from_bytes(raw, "big", signed=True)


_LOADERS: dict[int, Callable[[bytes], Any]] = {
    BOOL_OID: lambda raw: raw != b"\x00",
    INT2_OID: _int,
    INT4_OID: _int,
    INT8_OID: _int,
    TEXT_OID: lambda raw: bytes(raw).decode(),
    BYTEA_OID: bytes,
}


def text(value: str) -> bytes:
    """A ``text`` parameter in binary format: UTF-8, the client encoding lock
    connections are opened with (``LockSettings.client_kwargs``)."""
    return value.encode()


def int4(value: int) -> bytes:
    return value.to_bytes(4, "big", signed=True)


def int8(value: int) -> bytes:
    return value.to_bytes(8, "big", signed=True)


def boolean(value: bool) -> bytes:
    return b"\x01" if value else b"\x00"


_JOURNAL_PARAMS = ("scope", "key", "value", "request", "attempt")
_JOURNAL_TYPES = (TEXT_OID, TEXT_OID, BYTEA_OID, TEXT_OID, INT4_OID)
PUT_STEP = Statement.of("put_step", _JOURNAL_PARAMS, _JOURNAL_TYPES)
PUT_STREAM = Statement.of("put_stream", _JOURNAL_PARAMS, _JOURNAL_TYPES)


#: Up to this many journal rows are sent as a pipeline of plain upserts; more
#: as one statement of arrays (``put_journal_batch``), which costs Postgres less.
MAX_PIPELINED_ROWS = 8


def journal_call(
    table: str, scope: str, key: str, value: bytes, token: tuple[str, int] | None = None
) -> Call:
    """The upsert of one journal entry of ``table`` (``steps`` or ``streams``),
    landing only while the attempt ``token`` (request id, attempt number) is
    open, if one is given."""
    request, attempt = (None, None) if token is None else (text(token[0]), int4(token[1]))
    return (PUT_STEP if table == "steps" else PUT_STREAM,
            (text(scope), text(key), value, request, attempt))


ADVANCE_EPOCH = Statement.of(
    "advance_epoch", ("scope", "new", "value"), (TEXT_OID, INT4_OID, BYTEA_OID)
)
UNLOCK_SCOPE = Statement.of("unlock_scope", ("key",), (INT8_OID,))
TRY_LOCK = Statement.of("try_lock", ("key",), (INT8_OID,))
OPEN_RUN = Statement.of("open_run", ("scope", "pinned", "resume"), (TEXT_OID, INT4_OID, BOOL_OID))
