"""The Postgres journal store (psycopg 3) and the lease that owns a scope.

Two kinds of connection:

- the shared pool, for work outside a run (checkpoints listed by an
  operator, signals sent from a web handler, pruning);
- lock connections, each lent to one outermost run for its whole life.
  The run's session-level advisory lock lives on it, and every journal
  read and write of the run goes through it. Postgres frees the lock when
  that connection's backend ends, and nothing can be written through a
  dead backend, so a run that lost its lock can write nothing more
  (fencing). Lock connections come from a pool of their own that no other
  code borrows; a connection goes back only after its lock was released
  and checked released.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import anyio
import psycopg
from loomflow.runtime.journal import Checkpoint, CheckpointMeta, JournalEntry
from psycopg import AsyncConnection
from psycopg.pq.abc import PGresult
from psycopg.rows import DictRow, dict_row
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from . import fastpath
from .codec import CodecStats, Serializer, check_serializer, decode, encode
from .conns import without_jit
from .errors import (
    CONNECT,
    FENCED_SQLSTATE,
    DatabaseUnavailable,
    InvalidInput,
    LockLost,
    OpenFailed,
    SessionBusy,
    translated,
)
from .keys import scope_lock_key
from .lockconn import Batch, JournalRow, LockConnection, after_rows
from .lockconn import Conn as Conn
from .migrate import migrate
from .prune import Pruner
from .sessions import probe
from .sql import query

log = logging.getLogger(__name__)

T = TypeVar("T")

EPOCH_KEY = "__run_epoch__"
LAST_RUN_KEY = "__last_run_epoch__"

#: A run waiting for a scope another process holds tries its lock again after
#: 1, 2, 4, 8, then every 10 ms (one short statement on a shared connection
#: each time); one held in this process is tried again the moment it is freed.
WAIT_POLL_MIN = 0.001
WAIT_POLL_MAX = 0.01


class IdleCheck:
    """A pool's ``check`` that spends a round trip only on a connection not
    taken from the pool for over ``after`` seconds. One in use a moment ago
    is as good as it was then, and a busy worker takes its connections every
    few milliseconds; one that broke in between fails its next statement,
    which the caller retries like any lost connection. It stamps each
    connection as it is taken: a pool ``reset`` hook would stamp it as it
    comes back, but makes the pool hand every returned connection to its
    worker thread (or task) first."""

    def __init__(self, after: float = 1.0) -> None:
        self.after = after
        self._taken: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()

    def _due(self, conn: Any) -> bool:
        now = time.monotonic()
        taken, self._taken[conn] = self._taken.get(conn), now
        return taken is None or now - taken > self.after

    def check(self, conn: psycopg.Connection[Any]) -> None:
        if self._due(conn):
            ConnectionPool.check_connection(conn)

    async def acheck(self, conn: AsyncConnection[Any]) -> None:
        if self._due(conn):
            await AsyncConnectionPool.check_connection(conn)


@dataclass(frozen=True)
class LockSettings:
    """How lock connections detect a dead peer and how long a run waits."""

    wait_timeout: float | None = 60.0
    io_timeout: float = 30.0
    keepalives_idle: int = 5
    keepalives_interval: int = 2
    keepalives_count: int = 3
    tcp_user_timeout_ms: int = 15_000
    connect_timeout: int = 10

    def client_kwargs(self) -> dict[str, Any]:
        return {
            "keepalives": 1,
            "keepalives_idle": self.keepalives_idle,
            "keepalives_interval": self.keepalives_interval,
            "keepalives_count": self.keepalives_count,
            "tcp_user_timeout": self.tcp_user_timeout_ms,
            "connect_timeout": self.connect_timeout,
            "application_name": "loomflow-worker lock",
            # The fast path (fastpath.py) sends and reads text as UTF-8.
            "client_encoding": "UTF8",
            "autocommit": True,
        }


@dataclass
class RunStats:
    """Counts since the runtime was made (per process)."""

    steps_executed: int = 0
    steps_replayed: int = 0
    codec: CodecStats = field(default_factory=CodecStats)


def _namespace_bounds(ns: str) -> tuple[str, str]:
    # Keys "<ns>/..." sort (in the C collation) in [ns + "/", ns + "0").
    return ns + "/", ns + "0"


#: One statement for a connection, to go in the pipeline of another (see
#: :meth:`PostgresJournalStore.release`).
Followup = Callable[[Conn], fastpath.Call]


@dataclass(frozen=True)
class OpenChoice:
    """Which epoch a run opens: ``pinned``, else the last run's when
    ``resume_last``, else the current one."""

    pinned: int | None
    resume_last: bool

    def read(self, scope: str) -> Callable[[Conn], Awaitable[list[DictRow]]]:
        async def run(conn: Conn) -> list[DictRow]:
            cur = await self.send(conn, scope)
            return await cur.fetchall()

        return run

    def call(self, scope: str) -> fastpath.Call:
        """The open query, for :func:`fastpath.pipeline`."""
        pinned = None if self.pinned is None else fastpath.int4(self.pinned)
        resume = fastpath.boolean(self.resume_last)
        return (fastpath.OPEN_RUN, (fastpath.text(scope), pinned, resume))

    async def send(self, conn: Conn, scope: str) -> psycopg.AsyncCursor[DictRow]:
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(
            query("open_run"),
            {"scope": scope, "pinned": self.pinned, "resume": self.resume_last},
            binary=True,  # journal values arrive as raw bytes, not hex text
        )
        return cur


#: A tool call's journal key: its position (the run's namespace, ``idem:``,
#: loomflow's ``tool_call_{turn}_{slot}``), then a digest of its tool and arguments.
_TOOL_KEY = re.compile(r"^((?:[^/]+/)?idem:tool_call_\d+_\d+):")


_MODEL_KEY = re.compile(r"^((?:[^/]+/)?model_call_\d+)@")


def model_position(key: str) -> str | None:
    """The position part of a model call's journal key, its namespace and turn
    (``None``: not a model call's)."""
    if "model_call_" not in key:
        return None
    found = _MODEL_KEY.match(key)
    return None if found is None else found[1]


def tool_position(key: str) -> str | None:
    """The position part of a tool call's journal key (``None``: not a tool call's)."""
    if "idem:tool_call_" not in key:
        return None
    found = _TOOL_KEY.match(key)
    return None if found is None else found[1]


@dataclass(frozen=True)
class Liveness:
    """How a worker keeps the requests its runs hold alive in the ledger, and
    when a run may start a step (:meth:`Lease.confirm`).

    Each lock connection's running requests are stamped every heartbeat
    interval; the sweeper ends the lock connections of a worker whose
    requests went unstamped for ``lease_timeout`` and resumes them
    elsewhere. So a step starts only within ``confirm_within`` seconds (well
    below the lease) of a heartbeat that was answered, measured on the
    monotonic clock from when that heartbeat was sent; past that, the run
    first waits for a heartbeat of its connection, and past ``fence_after``
    (the process was stopped, or its loop held, for so long that the
    sweeper may have acted) its connection is fenced instead."""

    fence_after: float
    confirm_within: float
    lease_timeout: float
    stamp: Callable[[Conn, list[str]], Awaitable[set[str]]]
    on_cancelled: Callable[[Lease], None]


#: A heartbeat sent to confirm a lease that failed (not a lost connection) is
#: sent again after this many seconds, until the connection is fenced.
CONFIRM_RETRY = 0.1


class Lease:
    """One outermost run holding its scope: its lease on a shared lock
    connection, and the journal entries of the namespaces the run has
    opened, kept in memory so a replayed step costs no round trip."""

    def __init__(
        self, store: PostgresJournalStore, lock_conn: LockConnection[Lease], scope: str
    ) -> None:
        self.store = store
        self.lock_conn = lock_conn
        self.scope = scope
        self.lock_key = scope_lock_key(scope)
        self.fenced: LockLost | None = None
        # Called once when the lease is fenced (its lock connection lost).
        self.on_fenced: list[Callable[[LockLost], None]] = []
        # Set to stop the run at its next step boundary (a cancel, a deadline).
        self.stop: BaseException | None = None
        # The request the lease runs, when it runs one (heartbeats), and the
        # attempt: with the request id, the fencing token its writes carry.
        self.request_id: str | None = None
        self.attempt: int | None = None
        # The request was moved to another version of its agent on purpose: a
        # model call the journal holds at the same position (namespace and
        # turn) under another fingerprint (the old version's instructions or
        # tools) replays as it was, so its tool calls replay too and only what
        # had not completed runs on the new code.
        self.upgraded = False
        # Whether the latest step came from the journal (marks live events).
        self.last_replayed = False
        self.released = False
        self._steps: dict[tuple[str, str], bytes] = {}
        # The key journaled at each tool call's position (its namespace, turn
        # and slot), to tell a call of other content there (see ``diverged``).
        self._positions: dict[tuple[str, str], str] = {}
        # The key journaled at each model call's position, as read from the
        # database (see ``upgraded``).
        self._model_positions: dict[tuple[str, str], str] = {}
        self._streams: dict[tuple[str, str], bytes] = {}
        self._loaded: set[tuple[str, str]] = set()
        self.signal_counts: dict[tuple[str, str], int] = {}
        # The scope's "last run" mark: written with the run's first journal
        # write rather than in a round trip of its own.
        self.last_run: int | None = None
        self.pending_last_run: int | None = None
        # The scope's current epoch as read at open: only this lease can
        # move it while the lock is held.
        self.current_epoch: int | None = None
        # What the open query returned in the lock's round trip, if it was sent there.
        self.prefetched: tuple[OpenChoice, list[DictRow]] | None = None
        # Called once, after the run's next executed (not replayed) step.
        self.on_executed: Callable[[], Awaitable[Any]] | None = None
        # Told of each step's result as it is journaled or replayed, with the
        # object whose method made it (a model, for a model call) and whether
        # it came from the journal: the attempt's usage (see execution.usage).
        self.usage: Callable[[Any, Any, bool], None] | None = None
        # The concurrency limit slots the run holds (advisory lock keys on its
        # lock connection), released with its scope.
        self.slots: list[int] = []
        # The journal rows of the run's latest executed step, not sent yet:
        # they go ahead of the run's next statement on the lock connection,
        # in its round trip (its finish's, for the last step), and before its
        # next step runs (PostgresRuntime.step).
        self._unsent: list[JournalRow] = []

    @property
    def backend_pid(self) -> int:
        return self.lock_conn.backend_pid

    async def executed(self) -> None:
        """A step of the run was executed and journaled."""
        callback, self.on_executed = self.on_executed, None
        if callback is not None:
            await callback()

    def fence(self, cause: LockLost) -> None:
        if self.fenced is not None:
            return
        self.fenced = cause
        for callback in self.on_fenced:
            callback(cause)

    def request_stop(self, reason: BaseException) -> None:
        """Stop the run at its next step boundary with ``reason``, unless a stop
        was requested already (the first reason stands)."""
        if self.stop is None:
            self.stop = reason

    @property
    def token(self) -> tuple[str, int] | None:
        """The attempt the run's journal writes land for (request id, attempt
        number): the database refuses them once that attempt has ended."""
        if self.request_id is None or self.attempt is None:
            return None
        return self.request_id, self.attempt

    @contextlib.contextmanager
    def _refusals(self) -> Iterator[None]:
        """Inside, the database's refusal of a write of the run (its attempt
        ended: fenced and resumed elsewhere) fences the lease, not its lock
        connection's other runs, and raises :class:`LockLost`."""
        try:
            yield
        except psycopg.Error as exc:
            if exc.sqlstate != FENCED_SQLSTATE:
                raise
            cause = LockLost(
                self.scope, f"the database refused its write: {exc.diag.message_primary}")
            self.fence(cause)
            raise (self.fenced or cause) from exc

    def live(self) -> bool:
        """Whether the run may start a step now, with no I/O: its lock
        connection's runs were confirmed alive in the ledger less than
        ``confirm_within`` seconds ago (a run that no heartbeat stamps, outside
        a worker, always may). A fenced or stopped run raises why."""
        if self.fenced is not None:
            raise self.fenced
        liveness = self.store.liveness
        if liveness is None or self.request_id is None:
            return True
        return self.lock_conn.unconfirmed_for() <= liveness.confirm_within

    def check_lapsed(self) -> None:
        """Fence the run's lock connection, and raise, when its runs went
        unconfirmed for longer than ``fence_after``: the process was stopped
        (SIGSTOP, a paused VM, a throttled container) or its loop held, and
        the sweeper may have resumed them elsewhere. No I/O."""
        if self.fenced is not None:
            raise self.fenced
        liveness = self.store.liveness
        if liveness is None or self.request_id is None:
            return
        silent = self.lock_conn.unconfirmed_for()
        if silent > liveness.fence_after:
            raise self.lock_conn.fence(
                f"its runs were last confirmed alive {silent:.1f}s ago (the process was "
                "stopped or its event loop held; the sweeper may end the connection after "
                f"LEASE={liveness.lease_timeout:g}s): no step starts on a lease that may be gone"
            )

    async def confirm(self) -> None:
        """Before a step whose run is not :meth:`live`: wait for a heartbeat of
        its lock connection sent now (one for every run waiting on that
        connection), or fence the connection once it went unconfirmed past
        ``fence_after``. Returns once the run may start its step."""
        liveness = self.store.liveness
        while not self.live():
            self.check_lapsed()
            assert liveness is not None
            if not await self.store.beat(self.lock_conn, liveness):
                await anyio.sleep(CONFIRM_RETRY)

    async def io(self, fn: Callable[[Conn], Awaitable[T]]) -> T:
        """Run ``fn`` in a turn on the lock connection (after the run's unsent
        journal rows); its loss fences the run."""
        await self.send_unsent()
        return await self.lock_conn.run(fn)

    async def send(self, batch: Batch[T]) -> T:
        """``batch`` in a turn on the lock connection, in one round trip with
        the other runs' batches waiting with it; its loss fences the run. The
        run's unsent journal rows go first, in the batch's transaction."""
        if self.fenced is not None:
            raise self.fenced
        rows, self._unsent = self._unsent, []
        with self._refusals():
            return await self.lock_conn.send(after_rows(rows, batch) if rows else batch)

    async def send_unsent(self) -> None:
        """Write the run's unsent journal rows now (no round trip when there
        are none)."""
        if self.fenced is not None:
            raise self.fenced
        if self._unsent:
            await self._write([])

    def take_unsent(self) -> list[fastpath.Call]:
        """The run's unsent journal rows as statements, for a caller that
        sends them itself; they are no longer the lease's to send."""
        rows, self._unsent = self._unsent, []
        return [fastpath.journal_call(row.table, row.scope, row.key, row.value, row.token)
                for row in rows]

    # ---- reading -----------------------------------------------------------

    async def open(self, *, pinned: int | None, resume_last: bool) -> tuple[int, int | None, int]:
        """Read the scope's epochs, choose the run's, and load that epoch's
        namespace, all in one query (sent with the lock's, when the store
        was asked to). Returns ``(current, last, epoch)``: ``epoch`` is
        ``pinned`` if given, else the last run's when ``resume_last``, else
        the current one."""
        choice = OpenChoice(pinned, resume_last)
        prefetched, self.prefetched = self.prefetched, None
        if prefetched is not None and (
            prefetched[0] == choice
            # Read for the epoch pinned now (by the start it went with).
            or (pinned is not None and prefetched[1] and prefetched[1][0]["epoch"] == pinned)
        ):
            rows = prefetched[1]
        else:
            rows = await self.io(choice.read(self.scope))
        current, last, epoch = rows[0]["current"], rows[0]["last"], rows[0]["epoch"]
        self._keep(self.scope, rows)
        self._loaded.add((self.scope, str(epoch) if epoch else ""))
        self.last_run = last
        self.current_epoch = current
        return current, last, epoch

    def mark_last_run(self, epoch: int) -> None:
        if self.last_run != epoch:
            self.pending_last_run = epoch

    async def flush_last_run(self) -> None:
        epoch = self.pending_last_run
        if epoch is None:
            return
        await self._write([])

    async def load(self, scope: str, ns: str) -> None:
        """Load the namespace ``ns`` of ``scope`` into memory in one query."""
        if (scope, ns) in self._loaded:
            return

        async def run(conn: Conn) -> list[DictRow]:
            cur = conn.cursor(row_factory=dict_row)
            if ns:
                lo, hi = _namespace_bounds(ns)
                await cur.execute(query("load_namespace"), {"scope": scope, "lo": lo, "hi": hi})
            else:
                await cur.execute(query("load_root_namespace"), {"scope": scope})
            return await cur.fetchall()

        self._keep(scope, await self.io(run))
        self._loaded.add((scope, ns))

    def _keep(self, scope: str, rows: list[DictRow]) -> None:
        """Hold journal rows (``stream``, ``step_name``, ``value``) in memory; a
        row with no ``step_name`` is an empty namespace's."""
        for row in rows:
            if row["step_name"] is not None:
                kept = self._streams if row["stream"] else self._steps
                kept[(scope, row["step_name"])] = bytes(row["value"])
                if not row["stream"]:
                    self._note_position(scope, row["step_name"])
                model = model_position(row["step_name"])
                if model is not None:
                    self._model_positions.setdefault((scope, model), row["step_name"])

    def _note_position(self, scope: str, key: str) -> None:
        position = tool_position(key)
        if position is not None:
            self._positions.setdefault((scope, position), key)

    def diverged(self, scope: str, key: str) -> tuple[str, Any] | None:
        """For a tool call not in the journal under ``key``: the position and
        the result of the call of other content journaled at its position
        (its namespace, turn and slot), if one is; ``None`` otherwise."""
        position = tool_position(key)
        if position is None:
            return None
        found = self._positions.get((scope, position))
        if found is None or found == key:
            return None
        blob = self._steps.get((scope, found))
        ok, value = self.store._decode(blob, found) if blob is not None else (False, None)
        return position, value if ok else None

    def cached_step(self, scope: str, ns: str, key: str) -> tuple[bool | None, Any]:
        """``lookup_step`` without I/O: ``(None, None)`` when the namespace isn't
        loaded yet."""
        if (scope, ns) not in self._loaded:
            return None, None
        key = self._upgraded_key(self._steps, scope, key)
        blob = self._steps.get((scope, key))
        if blob is None:
            return False, None
        return self.store._decode(blob, key)

    async def lookup_step(self, scope: str, ns: str, key: str) -> tuple[bool, Any]:
        await self.load(scope, ns)
        key = self._upgraded_key(self._steps, scope, key)
        blob = self._steps.get((scope, key))
        if blob is None:
            return False, None
        return self.store._decode(blob, key)

    async def lookup_stream(self, scope: str, ns: str, key: str) -> tuple[bool, Any]:
        await self.load(scope, ns)
        key = self._upgraded_key(self._streams, scope, key)
        blob = self._streams.get((scope, key))
        if blob is None:
            return False, None
        ok, chunks = self.store._decode(blob, key)
        return (True, list(chunks or [])) if ok else (False, None)

    def _upgraded_key(self, kept: dict[tuple[str, str], bytes], scope: str, key: str) -> str:
        """``key``, or for an upgraded request's model call the journal does not
        hold under it, the key of the model call journaled at its position."""
        if not self.upgraded or (scope, key) in kept:
            return key
        position = model_position(key)
        found = self._model_positions.get((scope, position)) if position is not None else None
        return found if found is not None and (scope, found) in kept else key

    # ---- writing -----------------------------------------------------------

    async def write_step(self, scope: str, key: str, value: Any, *, later: bool = False) -> None:
        """Journal a step's result; ``later``: with the run's next statement
        (see ``_unsent``)."""
        blob = self.store._encode(value, key)
        if blob is None:
            return
        await self._write([JournalRow("steps", scope, key, blob, self.token)], later=later)
        self._steps[(scope, key)] = blob
        self._note_position(scope, key)

    async def write_stream(
        self, scope: str, key: str, chunks: list[Any], *, later: bool = False
    ) -> None:
        blob = self.store._encode(list(chunks), key)
        if blob is None:
            return
        await self._write([JournalRow("streams", scope, key, blob, self.token)], later=later)
        self._streams[(scope, key)] = blob

    async def _write(self, rows: list[JournalRow], *, later: bool = False) -> None:
        """Journal ``rows`` (batched with other runs' writes on the lock
        connection), after the unsent ones; ``later``: keep them unsent. The
        run's first write also carries the last-run mark, and is never kept."""
        if self.fenced is not None:
            raise self.fenced
        if later and self.pending_last_run is None:
            self._unsent.extend(rows)
            return
        if self._unsent:
            rows, self._unsent = [*self._unsent, *rows], []
        started = time.perf_counter()
        last_run = self.pending_last_run
        if last_run is not None:
            mark = self.store._encode(last_run, LAST_RUN_KEY)
            assert mark is not None
            rows = [*rows, JournalRow("steps", self.scope, LAST_RUN_KEY, mark, self.token)]
        with self._refusals():
            await self.lock_conn.write(rows)
        if last_run is not None:
            self.pending_last_run = None
            self.last_run = last_run
        self.store.observe_write(time.perf_counter() - started)

    def remember_step(self, scope: str, key: str, blob: bytes) -> None:
        self._steps[(scope, key)] = blob
        self._note_position(scope, key)

    # ---- epochs --------------------------------------------------------------

    async def _stored_epochs(self, conn: Conn) -> tuple[int, int | None]:
        """``(current epoch, epoch of the last run or None)`` of the scope."""
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(query("read_epochs"), {"scope": self.scope})
        found: dict[str, int] = {}
        for row in await cur.fetchall():
            key = row["step_name"]
            ok, value = self.store._decode(bytes(row["value"]), key)
            if ok and isinstance(value, int):
                found[key] = value
        return found.get(EPOCH_KEY, 0), found.get(LAST_RUN_KEY)

    async def finish(
        self,
        epoch: int,
        *,
        advance: bool = True,
        on_finish: Callable[[Conn, int], Awaitable[None]] | None = None,
    ) -> int:
        """Advance the scope's epoch past ``epoch``, forward only.

        One upsert that writes ``epoch + 1`` only over a smaller stored
        epoch: no lost update, never a step back. ``on_finish(conn,
        new_epoch)`` runs in the same transaction, for callers that record
        the run's outcome with it. A run that journaled nothing
        (``advance=False``) leaves the epoch as it is."""
        if not advance and on_finish is None:
            return epoch
        await self.flush_last_run()
        if on_finish is None and self.current_epoch is not None and self.current_epoch > epoch:
            # A resumed run: the epoch moved past it when it first finished,
            # and nothing else can have moved it since the open.
            return self.current_epoch
        params = {
            "scope": self.scope,
            "new": epoch + 1,
            "value": self.store._encode(epoch + 1, EPOCH_KEY),
        }

        async def advance_epoch(conn: Conn) -> int:
            if not advance:
                return (await self._stored_epochs(conn))[0]
            cur = await conn.execute(query("advance_epoch"), params)
            row = await cur.fetchone()
            assert row is not None
            return int(row[0])

        async def run(conn: Conn) -> int:
            if on_finish is None:
                return await advance_epoch(conn)
            async with conn.transaction():
                new = await advance_epoch(conn)
                await on_finish(conn, new)
                return new

        return await self.io(run)


class PostgresJournalStore:
    """loomflow's ``JournalStore`` on psycopg 3, with lock connections for runs."""

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        *,
        max_checkpoints_per_session: int = 20,
        serializer: Serializer = "json",
        lock: LockSettings | None = None,
        lock_connections: int = 2,
        owns_pool: bool = False,
    ) -> None:
        if not isinstance(pool, AsyncConnectionPool):
            raise InvalidInput(
                "PostgresRuntime needs a psycopg_pool.AsyncConnectionPool (psycopg 3), not "
                f"{type(pool).__module__}.{type(pool).__qualname__}; or use "
                "await PostgresRuntime.connect(dsn)"
            )
        if not isinstance(lock_connections, int) or lock_connections < 1:
            raise InvalidInput(
                f"lock_connections must be an integer of at least 1, not {lock_connections!r}"
            )
        self.pool = pool
        self.conninfo, self.conn_kwargs = pool_target(pool)
        self.serializer = check_serializer(serializer)
        self.max_checkpoints = max_checkpoints_per_session
        self.lock_settings = lock or LockSettings()
        self.stats = RunStats()
        self._owns_pool = owns_pool
        self.lock_connections = lock_connections
        # The lock connections open now; a lost one is replaced on demand.
        self._lock_conns: list[LockConnection[Lease]] = []
        self._opened = 0
        self._opening: asyncio.Lock | None = None
        # Scope lock keys held (or being taken) by this process, and the
        # attempts waiting for one held here: a session lock is reentrant
        # on its connection, so this process must never take one twice.
        self._held: dict[int, Lease | None] = {}
        self._freed: dict[int, asyncio.Event] = {}
        # Concurrency limit slots held (or being taken) by this process's runs:
        # reentrant too, so never tried twice here.
        self._slots: set[int] = set()
        self._closed = False
        # Called with the seconds each journal write of a run took (metrics).
        self._on_write: Callable[[float], None] | None = None
        # The heartbeat running on each lock connection, if one is, and when
        # (loop time) it was sent.
        self._beats: dict[LockConnection[Lease], tuple[asyncio.Task[bool], float]] = {}
        # How running requests are kept alive (a worker's), if they are.
        self.liveness: Liveness | None = None

    def time_writes(self, on_write: Callable[[float], None] | None) -> None:
        """Call ``on_write`` with the seconds each journal write of a run takes
        (metrics); ``None``: no longer."""
        self._on_write = on_write

    def observe_write(self, seconds: float) -> None:
        if self._on_write is not None:
            self._on_write(seconds)

    def live_connections(self) -> list[LockConnection[Lease]]:
        """The lock connections open and not fenced (a copy: one may be lost or
        opened meanwhile)."""
        return [lock_conn for lock_conn in self._lock_conns if lock_conn.fenced is None]

    def queue_depth(self) -> int:
        """Statements waiting for the lock connections."""
        return sum(lock_conn.depth for lock_conn in self._lock_conns)

    def keep_alive(self, liveness: Liveness) -> None:
        """The runs of this store's leases that run a request are kept alive
        in the ledger by :meth:`heartbeat`, and start a step only while
        ``liveness`` says their lease holds (:meth:`Lease.confirm`)."""
        self.liveness = liveness

    def heartbeat(self) -> None:
        """One heartbeat of the process's running requests (see
        :meth:`keep_alive`). For each live lock connection: with no run on it,
        it is stamped alive now; when nothing has stamped its runs for more
        than ``fence_after`` seconds (the sweeper ends the lock connections of
        a worker silent for ``lease_timeout``), it is fenced; otherwise, unless
        a beat of it is still under way (never two at once on a connection),
        ``stamp`` stamps its requests in one urgent statement, ahead of every
        statement queued there, and returns those whose cancel was requested:
        ``on_cancelled`` is called with their leases."""
        liveness = self.liveness
        if liveness is None:
            return
        now = asyncio.get_running_loop().time()
        lock_conns = self.live_connections()
        for lock_conn in lock_conns:
            running = lock_conn.running()
            if not running:
                lock_conn.stamped(now)
            elif now - lock_conn.stamped_at > liveness.fence_after:
                lock_conn.fence(
                    f"no heartbeat stamped its runs for {now - lock_conn.stamped_at:.1f}s "
                    "(the sweeper may end the connection after "
                    f"LEASE={liveness.lease_timeout:g}s)"
                )
            elif lock_conn not in self._beats or self._beats[lock_conn][0].done():
                self._beat_now(lock_conn, liveness)
        self._beats = {conn: beat for conn, beat in self._beats.items() if conn in lock_conns}

    async def beat(self, lock_conn: LockConnection[Lease], liveness: Liveness) -> bool:
        """A heartbeat of ``lock_conn``'s running requests, waited for: the one
        under way if it was sent lately enough to confirm them (every run
        confirming on the connection waits for that one), else one sent now;
        whether it stamped them. A caller that stops waiting leaves it going."""
        now = asyncio.get_running_loop().time()
        beat = self._beats.get(lock_conn)
        if beat is None or beat[0].done() or now - beat[1] > liveness.confirm_within / 2:
            beat = self._beat_now(lock_conn, liveness)
        return await asyncio.shield(beat[0])

    def _beat_now(
        self, lock_conn: LockConnection[Lease], liveness: Liveness
    ) -> tuple[asyncio.Task[bool], float]:
        """A heartbeat of ``lock_conn``'s running requests, started now."""
        loop = asyncio.get_running_loop()
        beat = self._beats[lock_conn] = (loop.create_task(
            _beat(lock_conn, lock_conn.running(), liveness.stamp, liveness.on_cancelled)
        ), loop.time())
        return beat

    # ---- lifecycle -----------------------------------------------------------

    async def init_schema(self) -> None:
        async with self.pool.connection() as conn:
            await migrate(conn)

    async def aclose(self) -> None:
        self._closed = True
        lock_conns, self._lock_conns = self._lock_conns, []
        for lock_conn in lock_conns:
            await lock_conn.aclose()
        if self._owns_pool:
            await self.pool.close()

    async def _open_lock_connection(self) -> LockConnection[Lease]:
        s = self.lock_settings
        with translated(CONNECT, self.conninfo):
            conn: Conn = await AsyncConnection.connect(
                self.conninfo, **{**self.conn_kwargs, **s.client_kwargs()}
            )
        try:
            # The server side of the same keepalive, so a partitioned worker's
            # locks are freed in seconds rather than after the kernel's two hours.
            await conn.execute(query("lock_keepalives"), {
                "idle": str(s.keepalives_idle), "interval": str(s.keepalives_interval),
                "count": str(s.keepalives_count), "user_timeout": str(s.tcp_user_timeout_ms),
            })
        except BaseException:
            await conn.close()
            raise
        self._opened += 1
        lock_conn: LockConnection[Lease] = LockConnection(
            conn, io_timeout=s.io_timeout, index=self._opened
        )
        lock_conn.start()
        return lock_conn

    async def _lock_connection(self) -> LockConnection[Lease]:
        """The least loaded lock connection, opening one while there are fewer
        than ``lock_connections`` and every open one carries a run."""
        live = self.live_connections()
        idle = min(live, key=lambda lock_conn: lock_conn.load, default=None)
        if idle is not None and (idle.load == 0 or len(live) >= self.lock_connections):
            return idle
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._closed:
                raise DatabaseUnavailable("the runtime is closed")
            if len(self.live_connections()) < self.lock_connections:
                lock_conn = await self._open_lock_connection()
                self._lock_conns = [*self.live_connections(), lock_conn]
            return min(self.live_connections(), key=lambda lock_conn: lock_conn.load)

    # ---- leases (one per outermost run) ----------------------------------------

    async def acquire(
        self, scope: str, wait: float | None, *, opening: OpenChoice | None = None
    ) -> Lease:
        """Take ``scope``'s lock on a lock connection.

        ``wait`` is how long to wait for a busy scope: ``None`` forever,
        ``0`` not at all. Raises :class:`SessionBusy` when it runs out.
        With ``opening``, the first try sends the run's open query in the
        same round trip as the lock's, for :meth:`Lease.open`."""
        lease = await self.acquire_if(scope, wait, None, opening=opening)
        assert lease is not None
        return lease

    async def acquire_if(
        self,
        scope: str,
        wait: float | None,
        gate: Callable[[int, bool], Batch[bool | None]] | None,
        *,
        opening: OpenChoice | None = None,
    ) -> Lease | None:
        """:meth:`acquire`, with ``gate(key, may_lock)`` sent instead of the
        plain try-lock: one statement that decides whether to take the
        lock and, when ``may_lock``, tries to (``pg_try_advisory_lock(key)``)
        in the same round trip. It returns whether it got the lock, or
        ``None`` when it chose not to try: then there is no lease.

        Waiting never blocks a shared connection: the lock is tried again,
        at once when a run of this process frees it, else after a short
        growing pause."""
        key = scope_lock_key(scope)
        deadline = None if wait is None else time.monotonic() + wait
        pause = WAIT_POLL_MIN
        while True:
            lock_conn = await self._lock_connection()
            may_lock = key not in self._held
            if may_lock:
                self._held[key] = None  # taken here while the statement runs
            # Only the first try reads the journal with the lock: a waiter
            # polling a busy scope reads nothing.
            try_open = opening if gate is None and may_lock and pause == WAIT_POLL_MIN else None
            try:
                if gate is not None:
                    tried, opened = await lock_conn.send(gate(key, may_lock)), None
                elif may_lock:
                    tried, opened = await self._try_lock(lock_conn, key, scope, try_open)
                else:
                    tried, opened = False, None
            except BaseException as exc:
                if may_lock:
                    if isinstance(exc, asyncio.CancelledError):
                        # Stopped while its statement may have taken the
                        # lock (a revoke before the run began): a session
                        # lock outlives the caller, so free it.
                        await _unlock_now(lock_conn, key)
                    self._forget(key)
                raise
            if tried and may_lock:
                lease = Lease(self, lock_conn, scope)
                if try_open is not None and opened is not None:
                    lease.prefetched = (try_open, opened)
                self._held[key] = lease
                lock_conn.attach(lease)
                return lease
            if may_lock:
                self._forget(key)
            if tried is None:
                return None
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise SessionBusy(scope, wait)
            freed = self._freed.setdefault(key, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(freed.wait(), pause if left is None else min(pause, left))
            pause = min(pause * 2, WAIT_POLL_MAX)

    async def _try_lock(
        self, lock_conn: LockConnection[Lease], key: int, scope: str, opening: OpenChoice | None
    ) -> tuple[bool, list[DictRow] | None]:
        """Try ``scope``'s lock on ``lock_conn`` (with the run's open query),
        in one round trip with the other runs' statements waiting there."""
        try:
            return await lock_conn.send(_lock_and_open(key, scope, opening))
        except OpenFailed as failed:
            # A session lock outlives the transaction the open failed in:
            # free it before the error goes up.
            await _unlock_now(lock_conn, key)
            raise failed.error from None

    async def take_slot(self, lease: Lease, keys: Sequence[int]) -> bool:
        """Take one free slot of a concurrency limit, one of ``keys``, for
        ``lease`` (on its lock connection, in one statement that stops at the
        first it gets); ``False`` when every slot is held, here or elsewhere.

        The slots this process holds are left out, and the one taken is
        recorded, within the connection's turn: the next turn on it (which
        would get a slot this session holds again, the lock being reentrant)
        sees it taken, and a start on another connection is never told a
        slot is taken that nobody holds."""

        async def take(conn: Conn) -> int | None:
            free = [key for key in keys if key not in self._slots]
            if not free:
                return None
            got = await _take_one(free, conn)
            if got is not None:
                self._slots.add(got)
            return got

        got = await lease.io(take)
        if got is None:
            return False
        lease.slots.append(got)
        return True

    def _forget(self, key: int) -> None:
        self._held.pop(key, None)
        freed = self._freed.pop(key, None)
        if freed is not None:
            freed.set()

    async def release(
        self,
        lease: Lease,
        then: Followup | None = None,
        *,
        before: Sequence[fastpath.Call] = (),
    ) -> list[DictRow] | None:
        """Unlock the lease's scope, checking that this process holds it no
        more; a connection where it would still be held is closed.

        ``then(conn)`` sends a statement that must run once the scope is free
        (a look for work that waited on it): it goes in the unlock's round
        trip, in one pipeline, and Postgres runs it after the unlock, on a
        snapshot of its own. Its rows are returned; ``None`` when it did not
        run (the connection was lost, or the lock was not held): run it
        elsewhere.

        ``before`` are statements that must be committed before the scope is
        free (the run's last journal writes): they go in the same round trip,
        committed before the unlock runs, and the first error among them is
        raised once the scope is released."""
        if lease.released:
            return None
        lease.released = True
        lock_conn = lease.lock_conn
        if then is not None and before:
            raise InvalidInput("release(): `then` and `before` do not go together")
        failed: list[BaseException] = []
        if lease.fenced is None and lock_conn.fenced is None:
            # The run's last journal rows, committed before the scope is free.
            if then is None:
                before = [*lease.take_unsent(), *before]
            else:
                with anyio.CancelScope(shield=True):
                    try:
                        await lease.send_unsent()
                    except LockLost:
                        pass  # fenced: the unlock below is skipped
                    except Exception as exc:
                        failed.append(exc)
        followed: list[DictRow] | None = None
        try:
            if lease.fenced is None and lock_conn.fenced is None:
                with anyio.CancelScope(shield=True):
                    try:
                        if lease.slots:
                            await lock_conn.run(functools.partial(_unlock_slots, lease.slots))
                        if then is None:
                            row = await lock_conn.send(
                                _unlock_after(before, lease.lock_key, failed))
                        else:
                            row, followed = await lock_conn.send(
                                _unlock_then(then, lease.lock_key))
                    except LockLost as exc:
                        # The connection is gone, and its locks with it; what
                        # was to be committed first may not have been.
                        row = {"released": True}
                        if before:
                            failed.append(exc)
                    if row is None or not row["released"]:
                        log.error(
                            "scope %s: lock not held at release; closing "
                            "its lock connection", lease.scope,
                            extra={"action": "unlock_mismatch", "scope": lease.scope},
                        )
                        lock_conn.fence(f"the lock of scope {lease.scope!r} was not released")
                        followed = None
            elif before:
                failed.append(lease.fenced or lock_conn.fenced or LockLost(lease.scope, "fenced"))
        finally:
            lock_conn.detach(lease)
            self._slots.difference_update(lease.slots)
            if self._held.get(lease.lock_key) is lease:
                self._forget(lease.lock_key)
        if failed:
            raise failed[0]
        return followed

    async def finish_and_release(self, lease: Lease, epoch: int, *, advance: bool) -> None:
        """:meth:`Lease.finish` (no ``on_finish``) and :meth:`release` in one
        round trip: the epoch advance (and a pending last-run mark) committed,
        then the unlock."""
        writes: list[fastpath.Call] = []
        last_run = lease.pending_last_run if advance else None
        if last_run is not None:
            mark = self._encode(last_run, LAST_RUN_KEY)
            assert mark is not None
            writes.append(fastpath.journal_call("steps", lease.scope, LAST_RUN_KEY, mark))
        resumed = lease.current_epoch is not None and lease.current_epoch > epoch
        if advance and not resumed:
            value = self._encode(epoch + 1, EPOCH_KEY)
            assert value is not None
            writes.append((fastpath.ADVANCE_EPOCH, (
                fastpath.text(lease.scope), fastpath.int4(epoch + 1), value,
            )))
        await self.release(lease, before=writes)
        if last_run is not None:
            lease.pending_last_run = None
            lease.last_run = last_run

    # ---- values -------------------------------------------------------------------

    def _encode(self, value: Any, key: str) -> bytes | None:
        return encode(value, self.serializer, self.stats.codec, key=key)

    def _decode(self, blob: bytes, key: str) -> tuple[bool, Any]:
        return decode(blob, self.serializer, self.stats.codec, key=key)

    # ---- JournalStore protocol (outside a run's cache) ------------------------------

    async def _fetchone(self, name: str, params: dict[str, Any]) -> DictRow | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(query(name), params)
            row: DictRow | None = await cur.fetchone()
            return row

    async def get_step(self, session_id: str, step_name: str) -> JournalEntry | None:
        row = await self._fetchone("get_step", {"scope": session_id, "key": step_name})
        if row is None:
            return None
        ok, value = self._decode(bytes(row["value"]), step_name)
        return JournalEntry(value=value, created_at=row["created_at"]) if ok else None

    async def put_step(self, session_id: str, step_name: str, value: Any) -> None:
        blob = self._encode(value, step_name)
        if blob is None:
            return
        async with self.pool.connection() as conn:
            await conn.execute(
                query("put_step"),
                {"scope": session_id, "key": step_name, "value": blob,
                 "request": None, "attempt": None},
            )

    async def get_stream(self, session_id: str, step_name: str) -> list[Any] | None:
        row = await self._fetchone("get_stream", {"scope": session_id, "key": step_name})
        if row is None:
            return None
        ok, chunks = self._decode(bytes(row["chunks"]), step_name)
        return list(chunks or []) if ok else None

    async def put_stream(self, session_id: str, step_name: str, chunks: list[Any]) -> None:
        blob = self._encode(list(chunks), step_name)
        if blob is None:
            return
        async with self.pool.connection() as conn:
            await conn.execute(
                query("put_stream"),
                {"scope": session_id, "key": step_name, "value": blob,
                 "request": None, "attempt": None},
            )

    # ---- checkpoints ------------------------------------------------------------------

    async def put_checkpoint(self, cp: Checkpoint) -> None:
        params = {
            "session_id": cp.session_id,
            "checkpoint_id": cp.checkpoint_id,
            "turn": cp.turn,
            "created_at": cp.created_at.timestamp(),
            "payload": cp.model_dump_json(),
        }
        trim = {"session_id": cp.session_id, "keep": self.max_checkpoints}
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute(query("put_checkpoint"), params)
            if self.max_checkpoints > 0:
                await conn.execute(query("trim_checkpoints"), trim)

    async def get_checkpoint(self, session_id: str, checkpoint_id: str) -> Checkpoint | None:
        row = await self._fetchone(
            "get_checkpoint", {"session_id": session_id, "checkpoint_id": checkpoint_id}
        )
        return None if row is None else Checkpoint.model_validate_json(row["payload"])

    async def get_latest_checkpoint(self, session_id: str) -> Checkpoint | None:
        row = await self._fetchone("latest_checkpoint", {"session_id": session_id})
        return None if row is None else Checkpoint.model_validate_json(row["payload"])

    async def list_checkpoints(self, session_id: str, limit: int = 50) -> list[CheckpointMeta]:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                query("list_checkpoints"), {"session_id": session_id, "limit": limit}
            )
            rows = await cur.fetchall()
        return [
            CheckpointMeta(
                checkpoint_id=r["checkpoint_id"], turn=r["turn"],
                created_at=datetime.fromtimestamp(r["created_at"], tz=UTC),
            )
            for r in rows
        ]

    # ---- pruning -----------------------------------------------------------------------

    async def prune(self, before: datetime | None = None, session_id: str | None = None) -> None:
        """loomflow's ``JournalStore.prune``; see :meth:`prune_rows`."""
        await self.prune_rows(before=before, session_id=session_id)

    async def prune_rows(
        self,
        before: datetime | None = None,
        session_id: str | None = None,
        *,
        batch_size: int = 5000,
        on_batch: Callable[[str, int], None] | None = None,
    ) -> int:
        """Prune by the rules of :mod:`.prune` what is older than ``before`` (a
        naive one is local time, as loomflow's stores read it) of the scope
        ``session_id``, either filter ``None`` for none. Returns how many rows
        went; ``on_batch(table, rows)`` sees each batch."""
        if before is not None and before.tzinfo is None:
            before = before.astimezone()
        pruner = Pruner(before, scope=session_id, batch_size=batch_size)
        await pruner.arun(self.pool.connection, on_batch=on_batch)
        return pruner.total


def pool_target(pool: AsyncConnectionPool[Any]) -> tuple[str, dict[str, Any]]:
    """The connection string and arguments of ``pool``'s connections."""
    if not isinstance(pool.conninfo, str) or not (
        pool.kwargs is None or isinstance(pool.kwargs, dict)
    ):
        raise InvalidInput(
            "PostgresRuntime needs a pool made with a fixed connection string and kwargs "
            "(lock connections are opened beside it with the same target)"
        )
    return pool.conninfo, dict(pool.kwargs or {})


async def open_pool(
    dsn: str, *, min_size: int, max_size: int, connect_timeout: int
) -> AsyncConnectionPool[Any]:
    """The journal's pool on ``dsn``, open, once :func:`probe` found the
    server and its connections sessions."""
    await probe(dsn, connect_timeout)
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn,
        kwargs={"autocommit": True, "connect_timeout": connect_timeout,
                "application_name": "loomflow-worker"},
        min_size=min_size,
        max_size=max_size,
        open=False,
        check=IdleCheck().acheck,
        configure=without_jit,
        name="loomflow-worker",
    )
    await pool.open(wait=True, timeout=connect_timeout)
    return pool


def _lock_and_open(
    key: int, scope: str, opening: OpenChoice | None
) -> Batch[tuple[bool, list[DictRow] | None]]:
    """The statement that tries a scope's lock. With ``opening``, the run's
    open query follows the try-lock in the same transaction: Postgres runs
    it after the lock is taken, on a snapshot of its own, so it reads every
    step the previous holder committed; its rows are dropped when the lock
    was busy. Raises :class:`OpenFailed` when the lock was taken but the
    open failed, or its rows could not be read."""
    calls: list[fastpath.Call | None] = [(fastpath.TRY_LOCK, (fastpath.int8(key),))]
    if opening is not None:
        calls.append(opening.call(scope))

    def read(conn: Conn, results: list[PGresult | psycopg.Error]) -> tuple[
        bool, list[DictRow] | None
    ]:
        tried = results[0]
        if isinstance(tried, psycopg.Error):
            raise tried
        if not _first_value(tried):
            return False, None
        if opening is None:
            return True, None
        try:
            opened = results[1]
            if isinstance(opened, psycopg.Error):
                raise opened
            return True, fastpath.rows(opened)
        except Exception as exc:
            raise OpenFailed(exc) from exc

    return Batch(lambda conn: calls, read)


async def _beat(
    lock_conn: LockConnection[Lease],
    running: list[Lease],
    stamp: Callable[[Conn, list[str]], Awaitable[set[str]]],
    on_cancelled: Callable[[Lease], None],
) -> bool:
    """One heartbeat of the requests running on ``lock_conn`` (see
    :meth:`PostgresJournalStore.heartbeat`); whether it stamped them."""
    ids = [a.request_id for a in running if a.request_id is not None]
    sent = asyncio.get_running_loop().time()
    try:
        cancelled = await lock_conn.run(lambda conn: stamp(conn, ids), urgent=True)
    except LockLost:
        return False
    except Exception as exc:
        log.warning("a heartbeat on lock connection %d failed: %s", lock_conn.index, exc,
                    extra={"action": "heartbeat_failed", "backend": lock_conn.backend_pid})
        return False
    lock_conn.stamped(sent)
    for lease in running:
        if lease.request_id in cancelled:
            on_cancelled(lease)
    return True


async def _take_one(keys: list[int], conn: Conn) -> int | None:
    cur = await conn.execute(query("take_slot"), {"keys": keys})
    row = await cur.fetchone()
    return None if row is None else int(row[0])


async def _unlock_slots(keys: list[int], conn: Conn) -> None:
    await conn.execute(query("unlock_slots"), {"keys": keys})


def _unlock_after(
    before: Sequence[fastpath.Call], key: int, failed: list[BaseException]
) -> Batch[dict[str, Any] | None]:
    """The unlock, after ``before`` committed (their first error into ``failed``)."""
    unlock_call = (fastpath.UNLOCK_SCOPE, (fastpath.int8(key),))

    def read(conn: Conn, results: list[PGresult | psycopg.Error]) -> dict[str, Any] | None:
        *done, unlocked = results
        failed.extend(r for r in done if isinstance(r, psycopg.Error))
        if isinstance(unlocked, psycopg.Error):
            raise unlocked
        return _first(unlocked)

    if not before:
        return Batch(lambda conn: [unlock_call], read)
    return Batch(lambda conn: [*before, fastpath.SYNC, unlock_call], read)


def _first(res: Any) -> dict[str, Any] | None:
    found = fastpath.rows(res)
    return found[0] if found else None


def _first_value(res: Any) -> Any:
    """The first column of the first row of a fast-path result (``None``: no row)."""
    found = fastpath.rows(res)
    return next(iter(found[0].values())) if found else None


def _unlock_then(
    then: Followup, key: int
) -> Batch[tuple[DictRow | None, list[DictRow] | None]]:
    """The unlock, and ``then``'s statement after it in one pipeline."""
    unlock_call = (fastpath.UNLOCK_SCOPE, (fastpath.int8(key),))

    def read(conn: Conn, results: list[PGresult | psycopg.Error]
             ) -> tuple[DictRow | None, list[DictRow] | None]:
        unlocked, followed = fastpath.succeeded(results)
        return _first(unlocked), fastpath.dicts(conn, followed)

    return Batch(lambda conn: [unlock_call, then(conn)], read)


async def _unlock_now(lock_conn: LockConnection[Lease], key: int) -> None:
    """Free ``key``'s session lock if ``lock_conn`` holds it, whatever cancels
    the caller (a lost connection has freed it already)."""
    with anyio.CancelScope(shield=True), contextlib.suppress(LockLost):
        await lock_conn.run(
            lambda conn: conn.execute(query("unlock_if_held"), {"key": key}), urgent=True
        )
