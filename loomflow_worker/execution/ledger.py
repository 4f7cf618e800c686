"""The ``runs`` ledger: the queue of record, read and written under the scope lock."""

from __future__ import annotations

import functools
import hashlib
import os
import secrets
import threading
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Literal

import psycopg
from loomflow.runtime import _codec
from psycopg.pq.abc import PGresult
from psycopg.rows import DictRow, dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool

from ..runtime import fastpath
from ..runtime.errors import InvalidInput, SessionBusy, translated
from ..runtime.keys import scope_lock_key, slot_lock_keys
from ..runtime.lockconn import Batch
from ..runtime.sql import query
from ..runtime.store import Conn, Followup, IdleCheck, OpenChoice
from ..runtime.validate import MAX_ID_BYTES, MAX_ID_LENGTH
from . import budgets
from .cached import CachedRead
from .pending import Pending
from .registry import FleetAgent
from .request import RunRequest
from .request_errors import RequestNotFound
from .statuses import TERMINAL, UNFINISHED, QuarantineLevel, Status

OnBusy = Literal["enqueue", "reject", "interrupt"]
ON_BUSY: tuple[OnBusy, ...] = ("enqueue", "reject", "interrupt")


def enqueue_lock_key(scope: str) -> int:
    # Scopes never hold a NUL, so this key space can't meet a scope's own.
    return scope_lock_key("\x00enqueue\x00" + scope)


def _pending(row: Mapping[str, Any] | None) -> Pending | None:
    """The request in ``row``, or ``None`` when the row holds none (no row,
    or the columns of an outer join that found nothing)."""
    return None if row is None or row["request_id"] is None else Pending.of(row)


@dataclass(frozen=True)
class Handoff:
    """The request a finishing one handed its scope to.

    It is dispatched again only when a worker already took the message it
    was enqueued with and parked it (``received``); otherwise that message
    is still on its way and runs it, and dispatching again would only make a
    duplicate for some worker to receive and drop."""

    pending: Pending
    received: bool

    @property
    def dispatch(self) -> list[Pending]:
        return [self.pending] if self.received else []


def _handoff(row: DictRow | None) -> Handoff | None:
    return None if row is None else Handoff(Pending.of(row), bool(row["received"]))


async def _fetchone(conn: Conn, name: str, params: Mapping[str, Any]) -> DictRow | None:
    """The first row of the query ``name``, by column name."""
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(query(name), params)
    return await cur.fetchone()


# The statements of every request's path on its lock connection, sent through
# libpq directly (see runtime.fastpath): the look before it starts, its start,
# its finish and the look for the next request once its scope is free.
_PRECHECK = fastpath.Query.of("precheck_run")
_START = fastpath.Query.of("start_request")
_FINISH = fastpath.Query.of("finish_request")
_RECORD_USAGE = fastpath.Query.of("record_usage")
_HAND_OFF = fastpath.Query.of("hand_off")


async def _fast_one(conn: Conn, statement: fastpath.Query,
                    params: Mapping[str, Any]) -> DictRow | None:
    """The first row of ``statement``; through libpq on a connection in
    autocommit (a lock connection), else through psycopg, in the transaction
    it has open."""
    if not conn.autocommit:
        return await _fetchone(conn, statement.name, params)
    rows = fastpath.dicts(conn, await fastpath.execute(conn, *statement.call(conn, params)))
    return rows[0] if rows else None


def _one(statement: fastpath.Query, params: Mapping[str, Any]) -> Batch[DictRow | None]:
    """``statement``'s first row, as a turn for the lock connection."""

    def read(conn: Conn, results: list[PGresult | psycopg.Error]) -> DictRow | None:
        rows = fastpath.dicts(conn, fastpath.succeeded(results)[0])
        return rows[0] if rows else None

    return Batch(lambda conn: [statement.call(conn, params)], read)


def _rows(conn: psycopg.Connection[Any], name: str, params: Mapping[str, Any]) -> list[DictRow]:
    """The rows of the query ``name``, by column name (a sync connection)."""
    return conn.cursor(row_factory=dict_row).execute(query(name), params).fetchall()


def _row_params(
    request_id: str, req: RunRequest, start: StartAt | None = None, ignore_result: bool = False,
    routing: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "ignore_result": ignore_result,
        "routing": _jsonb(routing),
        "countdown": start.countdown if start is not None else None,
        "eta": start.eta if start is not None else None,
        "request_id": request_id,
        "scope": req.scope,
        "session_id": req.session_id,
        "user_id": req.user_id,
        "agent": req.agent,
        "kind": req.kind,
        "prompt": req.prompt,
        "metadata": Jsonb(req.metadata),
        "lock_key": scope_lock_key(req.scope),
        "fairness_key": req.fairness_key,
        "hold_after": None,
        "fair_depth": None,
        "slots": None,
        "options": None,
        "priority_rank": 0,
    }


# ---- the enqueuing side (sync: web handlers and scripts call .delay) --------------------


@dataclass(frozen=True)
class StartAt:
    """When a request may start: ``countdown`` seconds from its acceptance (on
    the database's clock), or at ``eta``; the ledger records it as ``not_before``."""

    countdown: float | None = None
    eta: datetime | None = None

# What must be equal for a second enqueue under a request id to be the same request.
_IDENTITY = ("kind", "session_id", "user_id", "agent", "prompt", "metadata")


@dataclass(frozen=True)
class Enqueued:
    """What recording a request did: the requests it cancelled on the spot
    (``on_busy="interrupt"``, to publish so their results are stored), or
    nothing at all because the ledger had the request already."""

    cancelled: list[Pending] = field(default_factory=list)
    duplicate: bool = False
    # When the request may start, as the ledger recorded it (None: at once).
    not_before: datetime | None = None
    # Withheld on its fairness key's limit: not to be published now (the run
    # that frees a slot of the limit, or the sweeper, publishes it).
    held: bool = False


def _same_as_recorded(conn: psycopg.Connection[Any], request_id: str, req: RunRequest) -> bool:
    """``True`` when the ledger holds ``request_id`` with ``req``'s arguments,
    ``False`` when it does not hold it; :class:`InvalidInput` naming what
    differs when it holds another request under that id."""
    found = _rows(conn, "recorded_request", {"request_id": request_id})
    if not found:
        return False
    differ = differing(found[0], {name: getattr(req, name) for name in _IDENTITY})
    if differ:
        raise InvalidInput(
            f"task_id {request_id!r} is already the id of another request (its "
            f"{', '.join(differ)} {'differs' if len(differ) == 1 else 'differ'}): a task_id "
            "names one request, so sending it again only returns that request's handle; "
            "use a new task_id for a new request"
        )
    return True


def differing(row: Mapping[str, Any], values: Mapping[str, Any]) -> list[str]:
    """The arguments of a request (``kind``, ``session_id``, ``user_id``,
    ``agent``, ``prompt``, ``metadata``) whose ``values`` differ from those
    its ledger ``row`` recorded."""
    return [name for name in _IDENTITY if row[name] != values.get(name)]


def _insert_new(
    conn: psycopg.Connection[Any], request_id: str, req: RunRequest, start: StartAt | None,
    ignore_result: bool, routing: dict[str, Any] | None,
    options: dict[str, Any] | None = None,
    fairness_key: str | None = None,
    priority_rank: int = 0,
    fairness_weight: float | None = None,
) -> Enqueued:
    """Insert the request's row; a duplicate when the ledger had it already
    (the same request: :func:`_same_as_recorded` checks). Withheld when its
    fairness key has as many out as the per_key limit allows, or while the
    fair_queue limit makes requests wait their fair turn (and its message
    ``options`` are known)."""
    params = _row_params(request_id, req, start, ignore_result, routing)
    params["options"] = _jsonb(options)
    params["priority_rank"] = priority_rank
    key = params["fairness_key"] = fairness_key or req.fairness_key
    if fairness_weight is not None:
        conn.execute(query("set_call_weight"), {"fairness_key": key, "weight": fairness_weight})
    per_key, fair_depth = (HOLD_LIMITS.get(lambda: _read_hold_limits(conn))
                           if options is not None else (None, None))
    if per_key is not None:
        params["hold_after"] = per_key
        params["slots"] = slot_lock_keys(f"per_key:{key}", per_key)
    params["fair_depth"] = fair_depth
    row = conn.execute(query("insert_run"), params).fetchone()
    if row is None:
        if _same_as_recorded(conn, request_id, req):
            return Enqueued(duplicate=True)
        # Recorded and pruned between the two statements: the id is free again.
        row = conn.execute(query("insert_run"), params).fetchone()
        if row is None:
            return Enqueued(duplicate=True)
    return Enqueued(not_before=row[0], held=bool(row[1]))


def _read_hold_limits(conn: psycopg.Connection[Any]) -> tuple[int | None, int | None]:
    row = conn.execute(query("hold_limits")).fetchone()
    return (row[0], row[1]) if row is not None else (None, None)


#: The sizes of the per_key and fair_queue limits as enqueues read them (every
#: few seconds; ``forget()``: at the next enqueue).
HOLD_LIMITS: CachedRead[tuple[int | None, int | None]] = CachedRead((None, None))


def _generic_plans(conn: psycopg.Connection[Any]) -> None:
    """The enqueue pool's ``configure``: statements planned once (``generic_plans``
    in ledger.sql says why)."""
    conn.execute(query("generic_plans"))


class EnqueuePool:
    """A small sync pool for inserting ledger rows, made on first use in each process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ConnectionPool[Any] | None = None
        self._pid = 0
        self._dsn = ""

    def pool(self, dsn: str, connect_timeout: int) -> ConnectionPool[Any]:
        with self._lock:
            if self._pool is not None and (self._pid != os.getpid() or self._dsn != dsn):
                if self._pid == os.getpid():
                    self._pool.close()
                self._pool = None  # a forked child never touches its parent's sockets
            if self._pool is None:
                # One direct connection first: a refused one (a wrong password, an
                # unknown database) says why at once, where the pool would retry
                # quietly until its timeout and only say it got no connection.
                psycopg.connect(
                    dsn, autocommit=True, connect_timeout=connect_timeout,
                    application_name="loomflow-worker enqueue",
                ).close()
                idle = IdleCheck()
                self._pool = ConnectionPool(
                    dsn,
                    min_size=0,
                    max_size=4,
                    kwargs={"autocommit": True, "connect_timeout": connect_timeout,
                            "application_name": "loomflow-worker enqueue"},
                    check=idle.check,
                    configure=_generic_plans,
                    open=True,
                    name="loomflow-worker-enqueue",
                )
                self._pid = os.getpid()
                self._dsn = dsn
            return self._pool

    def connection(
        self, dsn: str, connect_timeout: int
    ) -> AbstractContextManager[psycopg.Connection[Any]]:
        return self.pool(dsn, connect_timeout).connection(timeout=connect_timeout)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None and self._pid == os.getpid():
                self._pool.close()
            self._pool = None

    def insert(
        self,
        dsn: str,
        connect_timeout: int,
        request_id: str,
        req: RunRequest,
        on_busy: OnBusy = "enqueue",
        start: StartAt | None = None,
        ignore_result: bool = False,
        routing: dict[str, Any] | None = None,
        options: dict[str, Any] | None = None,
        fairness_key: str | None = None,
        priority_rank: int = 0,
        fairness_weight: float | None = None,
    ) -> Enqueued:
        """Record the request (to start no sooner than ``start`` says;
        ``ignore_result``: its caller wants no result, Celery's
        ``ignore_result``, so the sweeper never stores one; ``routing``: where
        its messages go, see :attr:`Pending.routing`; ``options``: what its
        message carries besides, kept for a message published later when the
        request is withheld on its fairness key's limit, which it is not
        when they are ``None``; ``fairness_key``: whose request it is for
        concurrency limits and fair shares, by default its user, else its
        session; ``fairness_weight``: the weight it states for that key;
        ``priority_rank``: where its Celery priority puts it among requests
        waiting on a limit, lowest first).
        ``request_id`` is an idempotency key: when the ledger has it already,
        with the same arguments, nothing is written and the result says it is
        a duplicate; with other arguments, :class:`InvalidInput` names them."""
        with (translated("record the request in", dsn, then="nothing was enqueued"),
              self.connection(dsn, connect_timeout) as conn):
            # A budget that refuses requests while spent: before anything is written.
            budgets.refuse_if_spent(conn, fairness_key or req.fairness_key, req.agent)
            insert = functools.partial(
                _insert_new, conn, request_id, req, start, ignore_result, routing, options,
                fairness_key=fairness_key, priority_rank=priority_rank,
                fairness_weight=fairness_weight)
            if on_busy == "enqueue":
                return insert()
            with conn.transaction():
                if _same_as_recorded(conn, request_id, req):
                    return Enqueued(duplicate=True)
                # Enqueues on one scope take turns here, so "busy" is decided once.
                conn.execute(query("enqueue_lock"), {"key": enqueue_lock_key(req.scope)})
                if on_busy == "reject":
                    busy = _rows(conn, "scope_busy", {"scope": req.scope})
                    if busy:
                        raise SessionBusy(
                            req.scope, 0,
                            detail=f"request {busy[0]['request_id']} is "
                            f"{busy[0]['status']} on it and on_busy=\"reject\" was asked",
                        )
                    return insert()
                enqueued = insert()
                if enqueued.duplicate:
                    return enqueued
                rows = _rows(
                    conn, "cancel_requests",
                    {"request_id": None, "scope": req.scope, "by": request_id,
                     "reason": f"interrupted by request {request_id}"},
                )
                return Enqueued(
                    [Pending.of(row) for row in rows if row["status"] == Status.CANCELLED],
                    not_before=enqueued.not_before, held=enqueued.held,
                )

    def mark_undispatched(self, dsn: str, connect_timeout: int, request_id: str) -> None:
        """The broker refused ``request_id``'s message: the sweeper publishes it
        first once the broker is back. Best effort: without the mark the sweeper
        still finds it, later."""
        self._mark(dsn, connect_timeout, "mark_undispatched", request_id)

    def mark_result_unstored(self, dsn: str, connect_timeout: int, request_id: str) -> bool:
        """The result backend refused finished ``request_id``'s result: the
        sweeper stores it from the ledger once the backend is back. ``False``
        when the mark could not be written either (then the sweeper's check of
        recent results still finds it missing)."""
        return self._mark(dsn, connect_timeout, "mark_result_unstored", request_id)

    def _mark(self, dsn: str, connect_timeout: int, name: str, request_id: str) -> bool:
        try:
            with self.pool(dsn, connect_timeout).connection(timeout=connect_timeout) as conn:
                conn.execute(query(name), {"request_id": request_id})
        except (psycopg.Error, TimeoutError):
            return False
        return True

    def cancel(self, dsn: str, connect_timeout: int, request_id: str) -> tuple[str, Pending]:
        """Flag ``request_id`` cancelled; ``(status now, the request)``."""
        found = self._cancel(
            dsn, connect_timeout, "cancel_requests",
            {"request_id": request_id, "scope": None, "by": None,
             "reason": "cancelled before it started"},
        )
        if not found:
            raise RequestNotFound(request_id)
        return found[0]

    def cancel_queued(
        self, dsn: str, connect_timeout: int, session_id: str | None, user_id: str | None
    ) -> list[tuple[str, Pending]]:
        """Cancel every queued request (of ``session_id``, of ``user_id``);
        ``(status now, the request)`` for each."""
        return self._cancel(
            dsn, connect_timeout, "cancel_queued",
            {"session_id": session_id, "user_id": user_id,
             "reason": "cancelled while queued (cancel --queued)"},
        )

    def _cancel(
        self, dsn: str, connect_timeout: int, name: str, params: dict[str, Any]
    ) -> list[tuple[str, Pending]]:
        with translated("cancel in", dsn), self.connection(dsn, connect_timeout) as conn:
            rows = _rows(conn, name, params)
        return [(row["status"], Pending.of(row)) for row in rows]


# ---- the worker side (async, on the attempt's lock connection) ---------------------------


@dataclass(frozen=True)
class Arrival:
    """What a message says of its request beyond its arguments, for a row made
    on receipt: when it may start (its eta) and where it came (its queue)."""

    start: StartAt | None = None
    routing: dict[str, Any] | None = None


async def ensure_row(
    conn: Conn, request_id: str, req: RunRequest, arrival: Arrival | None = None
) -> None:
    """A message published by name, from a process with no database access,
    gets its ledger row on receipt: not to start before its eta, routed as it
    came (``arrival``)."""
    came = arrival or Arrival()
    await conn.execute(query("insert_run"), _row_params(request_id, req, came.start,
                                                        routing=came.routing))


async def record_invalid(
    conn: Conn, request_id: str, args: dict[str, Any], error: Exception
) -> list[str]:
    """Record that a worker refused the input of ``request_id``'s message
    (``args``, with its ``kind``): a request the ledger did not have is
    recorded failed; one it accepted with these arguments ends failed (a
    worker without its agent, say). The names of the arguments that differ
    from a row the ledger has under that id (then nothing is written: the
    message is not that request's, and that row is never changed)."""
    row = await _fetchone(conn, "recorded_request", {"request_id": request_id})
    ending = {"request_id": request_id, "error": str(error),
              "error_type": type(error).__name__}
    if row is None:
        await conn.execute(query("insert_failed_run"), {**_refused_row(request_id, args),
                                                        **ending})
        return []
    metadata = args.get("metadata")
    differ = differing(row, {**args, "metadata": {} if metadata is None else metadata})
    if not differ:
        await conn.execute(query("fail_invalid_run"), ending)
    return differ


#: How much of a refused request's prompt its row keeps.
REFUSED_PROMPT_CHARS = 10_000


def _refused_row(request_id: str, args: dict[str, Any]) -> dict[str, Any]:
    """The columns of a refused request's row: its arguments as far as they
    are text Postgres can store, and ids no longer than an id may be
    (:func:`_stored_id`)."""

    def text(value: Any, default: str) -> str:
        return _storable(value if isinstance(value, str) else default)

    user_id = args.get("user_id")
    return {
        "scope": f"invalid:{request_id}",
        "session_id": _stored_id(text(args.get("session_id"), "")),
        "user_id": _stored_id(text(user_id, "?")) if user_id is not None else None,
        "agent": _stored_id(text(args.get("agent"), "?")),
        "kind": args.get("kind") if args.get("kind") in ("run", "resume") else "run",
        "prompt": text(args.get("prompt"), "")[:REFUSED_PROMPT_CHARS],
        "metadata": Jsonb({}),
    }


def _storable(value: str) -> str:
    """``value`` with what Postgres can't store as text (a NUL, a lone
    surrogate) replaced by "?"."""
    return value.encode("utf-8", "replace").decode().replace("\x00", "?")


def _stored_id(value: str) -> str:
    """A refused request's session id, user id or agent name as its row keeps
    it: cut to MAX_ID_LENGTH characters and MAX_ID_BYTES bytes (marked with
    "..."), so the row fits the ledger's indexes on those columns (a B-tree
    entry holds about 2.7 kB; a 200,000-character id would fail the insert).
    The row's error says how long the id really was."""
    if len(value) <= MAX_ID_LENGTH and len(value.encode()) <= MAX_ID_BYTES:
        return value
    cut = value[: MAX_ID_LENGTH - 3].encode()[: MAX_ID_BYTES - 3]
    return cut.decode(errors="ignore") + "..."


@dataclass(frozen=True)
class Precheck:
    """The ledger read that decides whether to take the scope lock: only the
    oldest unfinished request of a scope tries, in the same statement, so a
    request that is bound to park never holds the lock, even for a moment,
    against the one that must run."""

    status: str
    result: Any
    error: str | None
    older: Pending | None
    older_stale: bool
    # Whether the scope's lock was taken (``None``: not tried).
    locked: bool | None = None
    # The epoch an earlier attempt pinned (``None``: none did).
    pinned: int | None = None
    # The quarantine it must run in, more than this process gives (see
    # precheck_run); NONE when it may run here.
    quarantine: QuarantineLevel = QuarantineLevel.NONE
    # The message's arguments that differ from the row (then nothing is tried).
    differ: tuple[str, ...] = ()
    # Whose request it is for concurrency limits, as its enqueue recorded it.
    fairness_key: str | None = None


def precheck(
    request_id: str,
    req: RunRequest,
    stale_after: float,
    lock_key: int,
    may_lock: bool = True,
    *,
    quarantine: int = QuarantineLevel.ALONE,
) -> Batch[Precheck | None]:
    """The ledger's view of ``request_id`` (``None``: it has no row), which of
    ``req``'s arguments (its message's) differ from the row, and the scope's
    lock (``lock_key``) tried in the same statement when it may run (and
    ``may_lock``: this process does not hold it already). A request that
    must run in more ``quarantine`` than this process gives (a
    :class:`.QuarantineLevel`) takes no lock and comes back
    with ``quarantine`` set to what it needs. A turn for the lock connection."""
    params = _row_params(request_id, req)
    return _one(_PRECHECK, {
        **{name: params[name] for name in _IDENTITY if name != "prompt"},
        "prompt_sha256": hashlib.sha256(req.prompt.encode()).digest(),
        "request_id": request_id, "stale": stale_after, "key": lock_key, "may_lock": may_lock,
        "isolation": int(quarantine),
    }).then(_precheck_of)


def _precheck_of(row: DictRow | None) -> Precheck | None:
    if row is None:
        return None
    return Precheck(row["status"], row["result"], row["error"], _pending(row),
                    bool(row["stale"]), None if row["locked"] is None else bool(row["locked"]),
                    row["pinned"], QuarantineLevel(row["quarantine"]), tuple(row["differ"]),
                    row["fairness_key"])


#: :attr:`Started.status` of a request whose previous attempt may still be
#: running on a worker that lives: it starts once that attempt has ended.
WAITING = "waiting"


@dataclass(frozen=True)
class Started:
    """What the ledger said when an attempt took its scope."""

    status: str
    seq: int
    epoch: int | None = None
    attempt: int = 0
    crashes: int = 0
    failures: int = 0
    result: Any = None
    error: str | None = None
    error_type: str | None = None
    older: Pending | None = None
    older_stale: bool = False
    cancel_requested: bool = False
    # Seconds since the request's last heartbeat (set when an attempt died),
    # and since the previous request of its session finished (a handoff).
    since_heartbeat: float | None = None
    since_handoff: float | None = None
    # Deaths of its attempts in a shared process, and lost attempts, in a row
    # without a completed step (see migration 0018).
    suspicion: int = 0
    lost_streak: int = 0
    # The rows of the run's open query, when it was sent with the start.
    opened: list[DictRow] | None = field(default=None, compare=False)
    # Status "waiting": the worker whose attempt of the request may still run.
    previous_worker: str | None = None
    # The place a paused attempt's model call booked in its key's schedule
    # (the key, and in how many seconds), for this attempt to take.
    booked_key: str | None = None
    booked_in: float | None = None
    # Status "other_version": the version of its agent the request is pinned
    # to, which is not the starting worker's.
    other_version: str | None = None
    # It was moved to another version of its agent on purpose (``upgrade``):
    # its model calls journaled before replay by position (see Lease.upgraded).
    upgraded: bool = False


#: start's status for a request pinned to a version its worker does not run.
OTHER_VERSION = "other_version"


def start(
    request_id: str,
    scope: str,
    worker: str,
    stale_after: float,
    opening: OpenChoice | None = None,
    *,
    lease: float,
    interval: float,
    quarantine: int,
    version: str | None = None,
) -> Batch[Started]:
    """Under the scope lock, in one statement: a duplicate of a finished request
    gets its stored outcome; a request behind an unfinished older one parks; a
    request whose previous attempt may still be running (its worker lives, see
    ``start_request``) waits (``interval``: this worker's heartbeat interval,
    ``lease``: the lease's timeout); otherwise the attempt is counted, with
    the quarantine it runs in (``quarantine``, a :class:`.QuarantineLevel`),
    and the request marked running, its epoch pinned on the first attempt
    (the scope's current one, or its last run's for a resume), and the
    request pinned to ``version`` of its agent (a request pinned to
    another version does not start: :data:`OTHER_VERSION`). With
    ``opening``, the run's open query follows in the same round trip (one
    pipeline; Postgres runs it after the start), its rows in ``opened`` for
    the lease to use when it opens that epoch."""
    params = {"request_id": request_id, "scope": scope, "worker": worker, "pid": os.getpid(),
              "boot": process_boot(), "stale": stale_after, "lease": lease,
              "interval": interval, "isolation": int(quarantine), "version": version}

    def build(conn: Conn) -> list[fastpath.Call]:
        calls = [_START.call(conn, params)]
        if opening is not None:
            calls.append(opening.call(scope))
        return calls

    def read(conn: Conn, results: list[PGresult | psycopg.Error]) -> Started:
        started, *reading = fastpath.succeeded(results)
        found = fastpath.dicts(conn, started)
        opened = fastpath.rows(reading[0]) if reading else None
        return _started_of(request_id, found[0] if found else None, opened)

    return Batch(build, read)


def _started_of(request_id: str, row: DictRow | None, opened: list[DictRow] | None) -> Started:
    if row is None:
        raise LookupError(f"request {request_id} has no ledger row")
    seq = row["seq"]
    if row["status"] in TERMINAL:
        return Started(row["status"], seq, result=row["result"], error=row["error"],
                       error_type=row["error_type"])
    # The columns of the oldest unfinished request before this one, if any.
    older = _pending(row)
    if older is not None:
        return Started("parked", seq, older=older, older_stale=bool(row["stale"]))
    if row["previous_worker"] is not None:
        return Started(WAITING, seq, previous_worker=row["previous_worker"])
    if row["other_version"] is not None:
        return Started(OTHER_VERSION, seq, other_version=row["other_version"])
    return Started(
        Status.RUNNING, seq, row["epoch"], row["attempts"], row["crashes"], row["failures"],
        cancel_requested=bool(row["cancel_requested"]),
        since_heartbeat=row["since_heartbeat"],
        since_handoff=row["since_handoff"],
        suspicion=row["suspicion"], lost_streak=row["lost_streak"],
        opened=opened, booked_key=row["booked_key"], booked_in=row["booked_in"],
        upgraded=bool(row["upgraded"]),
    )


async def finish_async(
    conn: Conn, request_id: str, scope: str, attempt: int, epoch: int, **ending: Any
) -> Handoff | None:
    """The request's end in one statement: the scope's epoch advanced past
    ``epoch`` (forward only), status, result and error recorded (``ending``:
    see :func:`_finish_params`), the attempt closed, and the scope handed to
    its next unfinished request."""
    return _handoff(await _fast_one(
        conn, _FINISH, _finish_params(request_id, scope, attempt, epoch, **ending)))


def finish_batch(
    request_id: str, scope: str, attempt: int, epoch: int,
    usage: Mapping[str, Any] | None = None, **ending: Any
) -> Batch[Handoff | None]:
    """:func:`finish_async` as a turn for the lock connection; with the attempt's
    ``usage`` (``AttemptUsage.params``) recorded ahead of it, in its round trip."""
    params = _finish_params(request_id, scope, attempt, epoch, **ending)
    if usage is None:
        return _one(_FINISH, params).then(_handoff)
    recorded = usage_params(request_id, attempt, usage)

    def read(conn: Conn, results: list[PGresult | psycopg.Error]) -> DictRow | None:
        rows = fastpath.dicts(conn, fastpath.succeeded(results)[1])
        return rows[0] if rows else None

    return Batch(lambda conn: [_RECORD_USAGE.call(conn, recorded), _FINISH.call(conn, params)],
                 read).then(_handoff)


def usage_params(request_id: str, attempt: int, usage: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters of ``record_usage``: the attempt's usage as ``AttemptUsage.params``."""
    return {**usage, "usage": Jsonb(usage["usage"]), "request_id": request_id,
            "attempt": attempt}


async def record_usage(
    conn: Conn, request_id: str, attempt: int, usage: Mapping[str, Any]
) -> None:
    """Record an attempt's model-call usage, and add it to its request's totals
    (see ``record_usage``), as the attempt ends without finishing its request."""
    await conn.execute(query("record_usage"), usage_params(request_id, attempt, usage))


def _finish_params(request_id: str, scope: str, attempt: int, epoch: int, *, status: str,
                   result: Any = None, error: str | None = None,
                   error_type: str | None = None) -> dict[str, Any]:
    return {"request_id": request_id, "scope": scope, "attempt": attempt,
            "new_epoch": epoch + 1, "epoch_value": _codec.dumps(epoch + 1),
            "status": status, "result": None if result is None else Jsonb(result),
            "error": error, "error_type": error_type}


async def schedule_retry(
    conn: Conn, request_id: str, attempt: int, error: Exception, countdown: float
) -> None:
    async with conn.transaction():
        await conn.execute(
            query("retry_run"),
            {"request_id": request_id, "error": str(error), "error_type": type(error).__name__,
             "countdown": countdown},
        )
        await conn.execute(
            query("end_attempt"),
            {"request_id": request_id, "attempt": attempt, "outcome": "retry"},
        )


async def await_version(
    conn: Conn, request_id: str, options: dict[str, Any] | None, default_queue: str,
    suffix: str,
) -> Pending | None:
    """The request is pinned to a version of its agent this worker does not
    run: queued again, waiting for that version, routed to its queue (its own
    queue's name, else ``default_queue``, then ``suffix``); the request to
    publish there (``None``: it finished meanwhile, or waited already, its
    message in that queue). See ``await_version``."""
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(query("await_version"), {
        "request_id": request_id, "options": _jsonb(options),
        "default_queue": default_queue, "suffix": suffix})
    row = await cur.fetchone()
    return _pending(row) if row is not None and row["first"] else None


@dataclass(frozen=True)
class Moved:
    """A request ``upgrade_requests`` moved to another version, to publish."""

    pending: Pending
    from_version: str


def upgrade_requests(
    conn: psycopg.Connection[Any], *, to: str, by: str, default_queue: str, suffix: str,
    request_id: str | None = None, agent: str | None = None, from_version: str | None = None,
) -> list[Moved]:
    """Move queued requests pinned to another version to version ``to``
    (``request_id``, or every one of ``agent`` pinned to ``from_version``),
    recorded with ``by``; routed to ``to``'s queue (its queue's name, else
    ``default_queue``, then ``suffix``). See ``upgrade_requests``."""
    rows = conn.cursor(row_factory=dict_row).execute(query("upgrade_requests"), {
        "request_id": request_id, "agent": agent, "from": from_version, "to": to, "by": by,
        "default_queue": default_queue, "suffix": suffix}).fetchall()
    return [Moved(Pending.of(row), row["from_version"]) for row in rows]


def waiting_for_version(
    conn: psycopg.Connection[Any], agent: str, version: str, limit: int
) -> list[str]:
    """Up to ``limit`` requests of ``agent`` waiting for a worker of ``version``."""
    return [row[0] for row in conn.execute(
        query("waiting_for_version"), {"agent": agent, "version": version, "limit": limit})]


def fleet_agent(conn: psycopg.Connection[Any], agent: str) -> tuple[FleetAgent | None, list[str]]:
    """``agent`` as the fleet's workers last recorded it (``None``: none did),
    and the names of every agent they recorded."""
    row = conn.execute(query("fleet_agent"), {"agent": agent}).fetchone()
    names = [r[0] for r in conn.execute(query("fleet_agent_names"))]
    if row is None:
        return None, names
    return FleetAgent(row[0], tuple(row[1] or ()), row[2], row[3]), names


def known_versions(conn: psycopg.Connection[Any], agent: str) -> list[DictRow]:
    """Each version of ``agent`` the fleet's registry knows, newest build
    first: ``version``, ``live``, ``built_at``."""
    return conn.cursor(row_factory=dict_row).execute(
        query("known_versions"), {"agent": agent}).fetchall()


async def park_on_limit(
    conn: Conn, request_id: str, options: dict[str, Any] | None, reason: str, slots: list[int]
) -> None:
    """Park the request: a concurrency limit of it is full (see ``park_on_limit``)."""
    await conn.execute(query("park_on_limit"), {
        "request_id": request_id, "options": _jsonb(options), "reason": reason,
        "slots": slots})


#: The most withheld requests one call publishes in their fair turn.
FAIR_PAGE = 500


@dataclass(frozen=True)
class LookerState:
    """What a worker process looking for fair turns says of itself first: its
    row in ``workers`` then holds it (the fleet's free slots bound what may wait
    in the broker)."""

    worker: str
    runs: int
    admitting: bool


async def fair_next(conn: Conn, looker: LookerState | None = None) -> list[Pending]:
    """Withheld requests whose fair turn came, to publish; none when another
    caller is publishing them (see ``loomflow_worker_fair_next``). ``looker``:
    the worker process looking, as its row should say first."""
    cur = conn.cursor(row_factory=dict_row)
    if looker is None:
        await cur.execute(query("fair_next"), {"wait": False, "page": FAIR_PAGE})
    else:
        await cur.execute(query("fair_next_stamped"),
                          {"wait": False, "page": FAIR_PAGE, **asdict(looker)})
    return [Pending.of(row) for row in await cur.fetchall()]


async def next_on_limit(conn: Conn, reason: str, count: int) -> list[Pending]:
    """The requests parked on the limit ``reason`` names, to publish again."""
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(query("next_on_limit"), {"reason": reason, "count": count})
    return [Pending.of(row) for row in await cur.fetchall()]


async def pause(
    conn: Conn, request_id: str, attempt: int, countdown: float, reason: str,
    booked_key: str | None, booked_in: float | None,
) -> None:
    """The attempt gives its slot back until ``countdown`` seconds from now
    (see ``pause_request``)."""
    await conn.execute(query("pause_request"), {
        "request_id": request_id, "attempt": attempt, "countdown": countdown,
        "reason": reason, "booked_key": booked_key, "booked_in": booked_in})


async def park_on_signal(
    conn: Conn, request_id: str, attempt: int, session_id: str, signal: str, reason: str,
    options: dict[str, Any] | None,
) -> None:
    """The attempt gives its slot back until ``signal`` arrives for
    ``session_id`` (see ``park_on_signal``)."""
    await conn.execute(query("park_on_signal"), {
        "request_id": request_id, "attempt": attempt, "session_id": session_id,
        "signal": signal, "reason": reason, "options": _jsonb(options)})


async def end_attempt(conn: Conn, request_id: str, attempt: int, outcome: str) -> None:
    await conn.execute(
        query("end_attempt"), {"request_id": request_id, "attempt": attempt, "outcome": outcome}
    )


async def requeue_interrupted(conn: Conn, request_id: str, attempt: int) -> None:
    """The worker stopped ``attempt`` (a shutdown) and puts its message back
    in the broker: the attempt ends ``interrupted`` and the request is queued
    again, so the sweeper finds its message there (or held by the worker that
    takes it) and does not publish another."""
    await conn.execute(query("requeue_interrupted"), {"request_id": request_id, "attempt": attempt})


async def hand_off_async(conn: Conn, scope: str) -> Handoff | None:
    """:func:`hand_off` on an async connection."""
    return _handoff(await _fast_one(conn, _HAND_OFF, _hand_off_statement(scope)[1]))


def hand_off(conn: psycopg.Connection[Any], scope: str) -> Handoff | None:
    """Hand ``scope`` to its oldest unfinished request, unless it was handed
    already (then whoever handed it published it, or its message runs it)."""
    return hand_off_rows(_rows(conn, *_hand_off_statement(scope)))


def hand_off_followup(scope: str) -> Followup:
    """:func:`hand_off` as a statement sent after the scope's unlock, in its
    round trip (``PostgresJournalStore.release(lease, then=...)``); read its
    rows with :func:`hand_off_rows`."""
    _, params = _hand_off_statement(scope)
    return lambda conn: _HAND_OFF.call(conn, params)


def _hand_off_statement(scope: str) -> tuple[str, dict[str, Any]]:
    return "hand_off", {"scope": scope}


def hand_off_rows(rows: list[DictRow]) -> Handoff | None:
    """What the ``hand_off`` statement's rows say: the request handed the scope."""
    return _handoff(rows[0] if rows else None)


def _jsonb(value: dict[str, Any] | None) -> Jsonb | None:
    return None if value is None else Jsonb(value)


async def park(conn: Conn, request_id: str, options: dict[str, Any] | None = None) -> bool:
    """Record that a worker took ``request_id``'s message and is parking it,
    with ``options`` (what the message carried besides its arguments), so the
    request that hands its scope on publishes it again as it was. ``False``
    when it was handed the scope already: it must not park then, nobody would
    publish it again."""
    cur = await conn.execute(
        query("park_request"), {"request_id": request_id, "options": _jsonb(options)}
    )
    row = await cur.fetchone()
    return not (row and row[0])


def mark_held(conn: psycopg.Connection[Any], request_ids: list[str]) -> set[str]:
    """Say that this worker holds these requests' messages, received but not
    started: the sweeper does not take them for lost meanwhile. Returns those
    stamped (queued in the ledger)."""
    rows = conn.execute(query("mark_held"), {"request_ids": request_ids}).fetchall()
    return {row[0] for row in rows}


def unknown(conn: psycopg.Connection[Any], request_ids: list[str]) -> list[str]:
    """Those of ``request_ids`` the ledger has no row for."""
    rows = conn.execute(query("known_requests"), {"request_ids": request_ids}).fetchall()
    known = {row[0] for row in rows}
    return [request_id for request_id in request_ids if request_id not in known]


def record_arrived(
    conn: psycopg.Connection[Any], request_id: str, req: RunRequest, arrival: Arrival
) -> None:
    """:func:`ensure_row` on a sync connection: a request a worker's consumer
    received with no row (sent by name) is recorded on receipt, with its eta
    and queue, not only when it starts."""
    conn.execute(query("insert_run"), _row_params(request_id, req, arrival.start,
                                                  routing=arrival.routing))


async def mark_dispatched(conn: Conn, request_id: str) -> None:
    await conn.execute(query("mark_dispatched"), {"request_id": request_id})


async def heartbeat(conn: Conn, request_ids: list[str]) -> set[str]:
    """Stamp running requests as alive in one statement; returns those whose
    cancel was requested."""
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(query("heartbeat"), {"request_ids": request_ids})
    return {row["request_id"] for row in await cur.fetchall() if row["cancel_requested"]}



def worker_name(node: str, pid: int) -> str:
    """How the ledger names a worker process (``runs.holder``, its attempts,
    its ``workers`` row): the Celery node it serves and its pid."""
    return f"{node}:{pid}"


#: This process's incarnation: its pid, and a token new in each process.
_boot: tuple[int, str] = (0, "")


def process_boot() -> str:
    """A token of this process's incarnation, new in each process (a forked
    pool child gets its own). Its worker id (node and pid) does not tell a
    process from the one before it when a container restarts in place: the
    same host name and, in a pid namespace of its own, the same pid."""
    global _boot
    pid = os.getpid()
    if _boot[0] != pid:
        _boot = (pid, secrets.token_hex(8))
    return _boot[1]


@dataclass(frozen=True)
class WorkerBeat:
    """What a worker process says of itself on each heartbeat (``workers``)."""

    worker: str
    hostname: str
    pid: int
    slots: int
    interval: float
    runs: int
    # The largest lag of its event loop over the last second, the statements
    # waiting for its lock connections, whether it takes new requests.
    loop_lag: float = 0.0
    lock_queue: int = 0
    admitting: bool = True
    # The finished requests whose result it stored since its last beat.
    stored: list[str] = field(default_factory=list)
    # This process's incarnation (see process_boot).
    boot: str = field(default_factory=process_boot)


async def worker_seen(conn: Conn, beat: WorkerBeat) -> None:
    """Stamp the process's row in ``workers`` (made on its first beat)."""
    await conn.execute(query("worker_seen"), asdict(beat))


@dataclass(frozen=True)
class BuiltAgent:
    """An agent a worker process built: its version, and what enqueuing needs of it."""

    worker: str
    agent: str
    version: str
    declared: bool
    fairness_key: str | None
    limits: list[str]
    time_limit: float | None
    model_key: str | None


async def agent_built(conn: Conn, built: BuiltAgent) -> None:
    """Record in ``worker_agents`` that the process serves this agent, at this version."""
    await conn.execute(query("agent_built"), asdict(built))


async def worker_stopped(conn: Conn, beat: WorkerBeat) -> None:
    """Mark the process's row stopped: it closes cleanly."""
    await conn.execute(query("worker_stopped"), {"worker": beat.worker, "stored": beat.stored})


def mark_worker_stopped(conn: psycopg.Connection[Any], worker: str) -> None:
    """Mark another process's row stopped: it died (a process of quarantine
    whose worker saw it end)."""
    conn.execute(query("worker_stopped"), {"worker": worker, "stored": []})


# ---- requests Celery revoked or let expire (sync: the worker's main process) --------------


@dataclass(frozen=True)
class OutsideEnding:
    """How a request that Celery ended outside its run ends in the ledger
    (``name`` says what happened, for the log)."""

    name: str
    status: Status
    error: str
    error_type: str
    #: How long to wait for the request's scope lock, in seconds, rather than
    #: try it once: its attempt's process is being killed this moment.
    lock_wait: float = 0.0


REVOKED = OutsideEnding("revoked", Status.CANCELLED, "revoked (Celery revoke)", "Revoked")
EXPIRED = OutsideEnding("expired", Status.EXPIRED, "expired before it started (Celery expires)",
                        "Expired")


#: How long the worker's main process waits for the scope lock of a request
#: whose pool child Celery kills at its hard time limit: Celery calls the task's
#: ``on_failure`` just before the kill, and the lock is free once the child is
#: gone (a loaded machine may take a moment to reap it).
KILLED_LOCK_WAIT = 5.0


def killed_at_time_limit(limit: float) -> OutsideEnding:
    """Celery's hard time limit killed the process running the request."""
    return OutsideEnding(
        "timed out", Status.FAILED,
        f"TimeLimitExceeded: the run took longer than its {limit:g}s hard time limit "
        "(Celery's time_limit), which killed its process", "TimeLimitExceeded",
        lock_wait=KILLED_LOCK_WAIT,
    )


def end_revoked(
    conn: psycopg.Connection[Any], request_id: str, how: OutsideEnding
) -> tuple[bool, Handoff | None]:
    """End a request Celery revoked, let expire or killed at its hard time
    limit, as ``how`` says. ``(True, handoff)`` once it is ended (or was
    already), ``(False, None)`` while an attempt still holds its scope: it is
    flagged and stops at its next step; call again once that attempt is gone."""
    found = _rows(conn, "revoked_request", {"request_id": request_id})
    if not found or found[0]["status"] not in UNFINISHED:
        return True, None
    scope, lock_key = found[0]["scope"], found[0]["lock_key"]
    ending = {"request_id": request_id, "status": how.status, "error": how.error,
              "error_type": how.error_type}
    if found[0]["status"] == Status.QUEUED and found[0]["epoch"] is None:
        # It never started: it journaled nothing, and ends without its lock.
        conn.execute(query("end_revoked"), ending)
        return True, hand_off(conn, scope)
    if not _take_lock(conn, lock_key, how.lock_wait):
        conn.execute(query("flag_cancel"), {"request_id": request_id})
        return False, None
    try:
        conn.execute(query("end_revoked"), ending)
        handoff = hand_off(conn, scope)
    finally:
        conn.execute(query("unlock"), {"key": lock_key})
    return True, handoff


def _take_lock(conn: psycopg.Connection[Any], lock_key: int, wait: float) -> bool:
    """Take a scope's lock on ``conn``: tried once, or waited for up to
    ``wait`` seconds; whether it is taken."""
    if wait <= 0:
        got = conn.execute(query("try_lock"), {"key": lock_key}).fetchone()
        return bool(got and got[0])
    try:
        with conn.transaction():
            conn.execute(query("wait_lock_within"), {"timeout_ms": str(int(wait * 1000))})
            conn.execute(query("wait_lock"), {"key": lock_key})
    except psycopg.errors.LockNotAvailable:
        return False
    return True


def mark_lost(
    conn: psycopg.Connection[Any], request_id: str, attempt: int | None, worker: str
) -> None:
    """Record that ``attempt`` (``None``: ``worker``'s open attempt, lost while
    it started) lost its lock connection while its worker lived."""
    conn.execute(query("mark_attempt_lost"),
                 {"request_id": request_id, "attempt": attempt, "worker": worker})


def mark_interrupted(conn: psycopg.Connection[Any], node: str) -> None:
    """A worker shutting down (a deploy): its attempts still running end
    ``interrupted``, so their next attempt does not count a crash. ``node`` is
    the worker's Celery node name (``celery@host``); its processes' attempts
    are recorded as ``node:pid``."""
    conn.execute(query("mark_interrupted"), {"node": f"{node}:"})


async def mark_quarantined(conn: Conn, request_id: str) -> None:
    """The request is handed to a process of its own (quarantine): the sweeper
    takes it for dispatched just now."""
    await conn.execute(query("mark_swept"), {"request_ids": [request_id], "again_after": None})


async def mark_lost_async(conn: Conn, request_id: str, attempt: int | None, worker: str) -> None:
    """:func:`mark_lost`, on an async connection."""
    await conn.execute(query("mark_attempt_lost"),
                       {"request_id": request_id, "attempt": attempt, "worker": worker})


async def clear_suspicion(conn: Conn, request_id: str) -> None:
    """A suspected request's attempt completed a step: its record is clean."""
    await conn.execute(query("clear_suspicion"), {"request_id": request_id})
