"""``PostgresRuntime``: loomflow's journaled runtime, made safe across processes.

It keeps loomflow's journal layout and step keys (a journal written by
``loomflow.runtime.PostgresRuntime`` resumes here) and changes what a
multi-process fleet needs changed:

- the outermost run on a (session, user) scope holds a session-level
  advisory lock on a dedicated connection for its whole life, so runs on
  one scope take turns across every process and host;
- the epoch is read, pinned and advanced under that lock, the advance a
  forward-only compare-and-set in one transaction;
- every journal read and write of the run goes through the lock
  connection (fencing), and the run's namespace is loaded in one query,
  so a replayed step costs no round trip and a fresh one a single INSERT;
- a replayed tool result carries the caller's ``call_id``, and the
  episode a run persists replays instead of being written twice;
- signals are rows plus LISTEN/NOTIFY, so they cross processes and
  survive restarts.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from types import CodeType
from typing import Any, TypedDict, Unpack

import anyio
from loomflow.core.context import get_run_context
from loomflow.core.types import Episode, ToolResult
from loomflow.runtime.journal import journal_scope
from loomflow.runtime.journaled import (
    JournaledRuntime,
    JournaledSession,
    _current_session_var,
    _open_run_var,
    _OpenRun,
    _resume_last_run_var,
    _step_key,
)
from psycopg_pool import AsyncConnectionPool

from .. import tracing
from .codec import Serializer
from .errors import Diverged, InvalidInput
from .signals import DEFAULT_SIGNALS_PER_SCOPE, SignalListener, check_keep
from .sql import query
from .store import (
    LAST_RUN_KEY,
    Conn,
    Lease,
    LockSettings,
    OpenChoice,
    PostgresJournalStore,
    RunStats,
    open_pool,
)
from .validate import check_id, check_signal_name

log = logging.getLogger(__name__)

_lease_var: ContextVar[Lease | None] = ContextVar("_loomflow_worker_lease", default=None)
#: Called, inside a run, with a signal's session and name and how long the run has waited
#: for it (a wait with no timeout): the worker's way to stop a long wait and
#: give the run's slot back (see :func:`signal_waits`).
_signal_wait_var: ContextVar[Callable[[str, str, float], None] | None] = ContextVar(
    "_loomflow_worker_signal_wait", default=None)


@contextlib.contextmanager
def signal_waits(hook: Callable[[str, str, float], None]) -> Iterator[None]:
    """Inside, a run's ``wait_for_signal`` with no timeout calls ``hook(session,
    name, seconds waited)`` each time the signal is not there yet; what it
    raises ends the wait (the signal stays in its mailbox)."""
    token = _signal_wait_var.set(hook)
    try:
        yield
    finally:
        _signal_wait_var.reset(token)

_UNSET: Any = object()


#: How long a run made outside Celery waits, at most, for its record in
#: ``direct_runs`` to be written (seconds): a healthy database answers in
#: milliseconds; past it the run goes on (or ends, or raises) unrecorded.
DIRECT_RECORD_WAIT = 0.5


class RuntimeOptions(TypedDict, total=False):
    """How a runtime behaves whatever its pool: the keyword arguments of
    :class:`PostgresRuntime`, which :meth:`PostgresRuntime.connect` passes on
    (the defaults are the constructor's)."""

    max_checkpoints_per_session: int
    serializer: Serializer
    lock_wait_timeout: float | None
    lock_io_timeout: float
    lock_connections: int
    signal_poll_interval: float
    signals_per_scope: int
    on_signals_dropped: Callable[[int], None] | None
    record_direct_runs: bool


@dataclass(frozen=True)
class RunOptions:
    """How the next outermost run opened in this context behaves."""

    epoch: int | None = None
    lock_wait: float | None = _UNSET
    on_open: Callable[[Lease, int], Awaitable[None]] | None = None
    on_finish: Callable[[Conn, int], Awaitable[None]] | None = None
    lease: Lease | None = None


_DEFAULT_OPTIONS = RunOptions()
_options_var: ContextVar[RunOptions | None] = ContextVar(
    "_loomflow_worker_run_options", default=None
)


#: The largest epoch a scope can have: epochs are stored as Postgres integers.
MAX_EPOCH = 2**31 - 1


@contextmanager
def run_options(
    *,
    epoch: int | None = None,
    lock_wait: float | None = _UNSET,
    on_open: Callable[[Lease, int], Awaitable[None]] | None = None,
    on_finish: Callable[[Conn, int], Awaitable[None]] | None = None,
    lease: Lease | None = None,
) -> Iterator[None]:
    """Options for outermost runs opened inside this context.

    ``epoch`` pins the run's namespace: a crashed request resumes in its
    own epoch even after later requests on its scope have run.
    ``lock_wait`` overrides how long to wait for a busy scope (``0``: not
    at all, ``None``: forever). ``on_open(lease, epoch)`` runs under the
    lock before the first step; ``on_finish(conn, new_epoch)`` runs inside
    the transaction that advances the epoch.

    ``lease`` hands the run a scope lock the caller already holds
    (``runtime.journal.acquire``): the run uses it, and leaves both the
    epoch advance (``lease.finish``) and the release to the caller, who
    can then record the run's result in the same transaction."""
    if epoch is not None and (
        not isinstance(epoch, int) or isinstance(epoch, bool) or not 0 <= epoch <= MAX_EPOCH
    ):
        raise InvalidInput(
            f"epoch must be an integer from 0 to {MAX_EPOCH} (a scope's epochs are Postgres "
            f"integers), not {epoch!r}"
        )
    token = _options_var.set(
        RunOptions(
            epoch=epoch, lock_wait=lock_wait, on_open=on_open, on_finish=on_finish,
            lease=lease,
        )
    )
    try:
        yield
    finally:
        _options_var.reset(token)


def current_lease() -> Lease | None:
    """The lease (lock connection and scope) of the run open in this context."""
    return _lease_var.get()


def _scope(session_id: str) -> str:
    return _checked_scope(session_id, get_run_context().user_id)


@functools.lru_cache(maxsize=4096)
def _checked_scope(session_id: str, user_id: str | None) -> str:
    check_id("session_id", session_id)
    if user_id is not None:
        check_id("user_id", str(user_id))
    return journal_scope(session_id, user_id)


def _waiter(user_id: str | None) -> str | None:
    """The user a signal waiter waits as: ``user_id``, else the run's user."""
    if user_id is None:
        user_id = get_run_context().user_id
    if user_id is not None:
        check_id("user_id", str(user_id))
        return str(user_id)
    return None


def _episode_identity(episode: Episode) -> dict[str, Any]:
    # The episode's id and timestamp are new on every attempt; what it says is not.
    return episode.model_dump(mode="json", exclude={"id", "occurred_at", "embedding"})


def _check_converges(lease: Lease, scope: str, key: str, args: tuple[Any, ...]) -> None:
    """Raise :class:`Diverged` when a tool call missing from the journal meets,
    at its position, a completed call of other content."""
    diverged = lease.diverged(scope, key)
    if diverged is None:
        return
    position, journaled = diverged
    if isinstance(journaled, ToolResult):
        answer = journaled.output if journaled.ok else journaled.error
        done = f"a call of other content that answered {str(answer)[:200]!r}"
    else:
        done = "a call of other content"
    tool, arguments = (*args, None, None)[:2]
    attempted = f"{tool!r} with {json.dumps(arguments, default=repr, sort_keys=True)[:200]}"
    raise Diverged(position.rsplit("/", 1)[-1], done, attempted)


class PostgresSession:
    """The handle ``runtime.session(session_id)`` yields (loomflow's
    ``RuntimeSession``): its signals are the runtime's durable ones, so a
    signal delivered through it reaches a waiter in any process, now or
    after a restart."""

    def __init__(self, session_id: str, runtime: PostgresRuntime) -> None:
        self.id = session_id
        self._runtime = runtime
        # Opened by a run (Agent.run sets its context first): that run's user.
        self.user_id: str | None = get_run_context().user_id

    async def deliver(self, name: str, payload: Any) -> None:
        await self._runtime.signal(self.id, name, payload, user_id=self.user_id)

    async def wait_signal(self, name: str) -> Any:
        return await self._runtime.wait_for_signal(self.id, name, user_id=self.user_id)


class PostgresRuntime(JournaledRuntime):
    """A loomflow runtime whose journal lives in Postgres, safe across processes.

    ``Agent(..., runtime=await PostgresRuntime.connect(dsn))``. A scope keeps
    its newest ``signals_per_scope`` undelivered signals (0: no bound); a send
    drops the oldest past that, logs it and calls ``on_signals_dropped(n)``.
    ``record_direct_runs``: each run it opens outside a worker (no request) is
    recorded in ``direct_runs``, where ``requests --direct`` and the console
    find it with its journal (two statements a run)."""

    name = "postgres"

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        *,
        max_checkpoints_per_session: int = 20,
        serializer: Serializer = "json",
        lock_wait_timeout: float | None = 60.0,
        lock_io_timeout: float = 30.0,
        lock_connections: int = 2,
        signal_poll_interval: float = 2.0,
        signals_per_scope: int = DEFAULT_SIGNALS_PER_SCOPE,
        on_signals_dropped: Callable[[int], None] | None = None,
        record_direct_runs: bool = True,
        _owns_pool: bool = False,
        _connect_timeout: int = LockSettings.connect_timeout,
    ) -> None:
        if lock_wait_timeout is not None and lock_wait_timeout < 0:
            raise InvalidInput(
                f"lock_wait_timeout must be >= 0 seconds or None, not {lock_wait_timeout}"
            )
        if lock_io_timeout <= 0:
            raise InvalidInput(f"lock_io_timeout must be > 0 seconds, not {lock_io_timeout}")
        store = PostgresJournalStore(
            pool,
            max_checkpoints_per_session=max_checkpoints_per_session,
            serializer=serializer,
            lock=LockSettings(wait_timeout=lock_wait_timeout, io_timeout=lock_io_timeout,
                              connect_timeout=_connect_timeout),
            lock_connections=lock_connections,
            owns_pool=_owns_pool,
        )
        super().__init__(store=store)
        self._pg = store
        self._records_direct = record_direct_runs
        # A run made outside Celery could not be recorded (said once).
        self._direct_unrecorded = False
        self._signals = SignalListener(
            pool, store.conninfo, store.conn_kwargs, poll_interval=signal_poll_interval,
            keep=signals_per_scope, on_dropped=on_signals_dropped,
        )

    @classmethod
    async def connect(
        cls,
        dsn: str,
        *,
        min_size: int = 1,
        max_size: int = 10,
        connect_timeout: int = 10,
        **options: Unpack[RuntimeOptions],
    ) -> PostgresRuntime:
        """Open a connection pool on ``dsn`` and return the runtime rooted at it
        (``options``: the constructor's, with its defaults).

        Raises :class:`DatabaseUnavailable`, naming the server, when
        Postgres can't be reached within ``connect_timeout`` seconds."""
        if "signals_per_scope" in options:
            check_keep(options["signals_per_scope"])  # before a pool is opened
        pool = await open_pool(dsn, min_size=min_size, max_size=max_size,
                               connect_timeout=connect_timeout)
        try:
            return cls(pool, _owns_pool=True, _connect_timeout=connect_timeout, **options)
        except BaseException:
            await pool.close()
            raise

    @property
    def pool(self) -> AsyncConnectionPool[Any]:
        return self._pg.pool

    @property
    def journal(self) -> PostgresJournalStore:
        return self._pg

    @property
    def stats(self) -> RunStats:
        return self._pg.stats

    async def init_schema(self) -> None:
        """Apply the schema migrations this database lacks (safe to run concurrently)."""
        await self._pg.init_schema()

    async def aclose(self) -> None:
        """Stop the signal listener and close the connections."""
        await self._signals.aclose()
        await self._pg.aclose()

    async def prune(
        self,
        before: datetime | None = None,
        session_id: str | None = None,
        *,
        batch_size: int = 5000,
    ) -> int:
        """Delete what matches every filter, in batches (returns how many rows):
        journal entries, streams and checkpoints written before ``before``,
        undelivered signals sent before it, and requests finished before it,
        of the scope ``session_id``. A scope with an unfinished request keeps
        its journal and the signals its runs may take; unless one scope is
        named, each keeps its epoch bookkeeping; and, with no scope named,
        fairness keys at rest whatever their age (a look takes such a key for a
        new one). The rules of ``loomflow-worker prune`` and of the sweeper's
        retention."""
        return await self._pg.prune_rows(
            before=before, session_id=session_id, batch_size=batch_size
        )

    # ---- sessions -------------------------------------------------------------------------

    @asynccontextmanager
    async def session(self, session_id: str) -> AsyncIterator[JournaledSession]:
        """Open a run on ``session_id`` for the current user.

        The outermost run takes the scope's lock (waiting up to
        ``lock_wait_timeout``, then :class:`SessionBusy`); a run opened
        inside another run journals under it and takes no lock."""
        scope = _scope(session_id)
        parent = _open_run_var.get()
        if parent is None:
            async with self._outermost(scope, session_id) as sess:
                yield sess
            return
        if not parent.container and parent.scope == scope and parent.session_id == session_id:
            async with self._enter(session_id) as sess:
                yield sess
            return
        k = parent.children.get(scope, 0) + 1
        parent.children[scope] = k
        ns = hashlib.sha256(f"{parent.ns}|{scope}|{k}".encode()).hexdigest()[:16]
        async with self._run(_OpenRun(scope, session_id, ns, parent), session_id) as sess:
            yield sess

    @asynccontextmanager
    async def _outermost(self, scope: str, session_id: str) -> AsyncIterator[JournaledSession]:
        opts = _options_var.get() or _DEFAULT_OPTIONS
        choice = OpenChoice(opts.epoch, _resume_last_run_var.get())
        given = opts.lease
        if given is not None:
            if given.scope != scope or given.released:
                raise InvalidInput(
                    f"run_options(lease=...) holds scope {given.scope!r}"
                    f"{' (released)' if given.released else ''}, but the run opened {scope!r}"
                )
            lease = given
        else:
            wait = (
                self._pg.lock_settings.wait_timeout if opts.lock_wait is _UNSET else opts.lock_wait
            )
            lease = await self._pg.acquire(scope, wait, opening=choice)
        try:
            current, _last, epoch = await lease.open(
                pinned=choice.pinned, resume_last=choice.resume_last
            )
            run = _OpenRun(
                scope, session_id, str(epoch) if epoch else "", None,
                epoch=epoch, next_epoch=current,
            )
            if opts.on_open is not None:
                await opts.on_open(lease, epoch)
            direct = None
            if given is None and self._records_direct:
                direct = await self._direct_run_opened(scope, session_id, epoch)
            run_token = _open_run_var.set(run)
            lease_token = _lease_var.set(lease)
            try:
                async with self._enter(session_id) as sess:
                    yield sess
            except BaseException as exc:
                if direct is not None:
                    with anyio.CancelScope(shield=True):
                        await self._direct_run_ended(direct, exc)
                raise
            finally:
                _lease_var.reset(lease_token)
                _open_run_var.reset(run_token)
            if direct is not None:
                await self._direct_run_ended(direct, None)
            if given is None:
                with anyio.CancelScope(shield=True):
                    if opts.on_finish is None:
                        await self._pg.finish_and_release(lease, epoch, advance=run.touched)
                    else:
                        await lease.finish(epoch, advance=run.touched, on_finish=opts.on_finish)
        finally:
            if given is None:
                await self._pg.release(lease)

    async def _direct_run_opened(self, scope: str, session_id: str, epoch: int) -> str | None:
        """Record a run opened outside a worker (no request: a web process's
        own ``agent.run``) in ``direct_runs``; its id, or ``None`` when it
        could not be recorded (logged once per process: the run goes on)."""
        context = get_run_context()
        run_id = context.run_id or f"direct_{uuid.uuid4().hex}"
        params = {"run_id": run_id, "scope": scope, "session_id": session_id,
                  "user_id": context.user_id, "epoch": epoch,
                  "process": f"{socket.gethostname()}:{os.getpid()}", "pid": os.getpid()}
        return run_id if await self._record_direct("direct_run_opened", params) else None

    async def _direct_run_ended(self, run_id: str, exc: BaseException | None) -> None:
        while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
            exc = exc.exceptions[0]  # what a task group raised: its first cause
        error = None if exc is None else (f"{type(exc).__name__}: {exc}".splitlines() or [""])[0]
        await self._record_direct("direct_run_ended", {
            "run_id": run_id, "outcome": "succeeded" if exc is None else "raised",
            "error": None if error is None else error[:500]})

    async def _record_direct(self, name: str, params: dict[str, Any]) -> bool:
        # A record for the console: it never holds a run up, however the
        # database answers (a frozen link, a full pool).
        try:
            with anyio.fail_after(DIRECT_RECORD_WAIT):
                async with self._pg.pool.connection(timeout=DIRECT_RECORD_WAIT) as conn:
                    await conn.execute(query(name), params)
        except Exception as exc:
            if not self._direct_unrecorded:
                log.warning("could not record a run made outside Celery in direct_runs "
                            "(is the schema migrated? `loomflow-worker migrate`): %s", exc,
                            extra={"action": "direct_run_record"})
            self._direct_unrecorded = True
            return False
        return True

    @asynccontextmanager
    async def _enter(self, session_id: str) -> AsyncIterator[Any]:
        token = _current_session_var.set(session_id)
        try:
            yield PostgresSession(session_id, self)
        finally:
            _current_session_var.reset(token)

    async def _run_key(self, scope: str, key: str) -> str:
        run = _open_run_var.get()
        if run is None or run.scope != scope:
            return key
        if not run.touched:
            run.touched = True
            if run.parent is None and not run.container:
                lease = _lease_var.get()
                if lease is not None and lease.scope == scope:
                    lease.mark_last_run(run.epoch)
                else:
                    await self._write_step(scope, LAST_RUN_KEY, run.epoch)
        return f"{run.ns}/{key}" if run.ns else key

    # ---- steps ------------------------------------------------------------------------------

    def _namespace(self, scope: str) -> str:
        run = _open_run_var.get()
        return run.ns if run is not None and run.scope == scope else ""

    async def _lookup_step(self, scope: str, key: str) -> tuple[bool, Any]:
        lease = _lease_var.get()
        if lease is not None:
            return await lease.lookup_step(scope, self._namespace(scope), key)
        entry = await self._pg.get_step(scope, key)
        return (False, None) if entry is None else (True, entry.value)

    async def _write_step(self, scope: str, key: str, value: Any, *, later: bool = False) -> None:
        lease = _lease_var.get()
        if lease is not None:
            await lease.write_step(scope, key, value, later=later)
        else:
            await self._pg.put_step(scope, key, value)

    async def step(
        self,
        name: str,
        fn: Callable[..., Awaitable[Any]],
        *args: Any,
        idempotency_key: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run ``fn`` once per journal key and journal its result (at-least-once:
        a crash between ``fn`` and the write runs it again on resume). In a
        worker, ``fn`` starts only while the run's lease is confirmed alive
        (:meth:`Lease.confirm`), with no await between that check and ``fn``.

        In a run holding its scope, the result is written with the run's next
        statement: the next step's ``fn`` starts only once it is committed,
        and the last step's goes in the round trip of the run's finish."""
        session_id = _current_session_var.get()
        if session_id is None:
            return await fn(*args, **kwargs)
        scope = _scope(session_id)
        if name.startswith("persist_episode_") and len(args) == 1 and isinstance(
            args[0], Episode
        ):
            base = _step_key(name, (_episode_identity(args[0]),), {}, None)
        else:
            base = _step_key(name, args, kwargs, idempotency_key)
        self._check_can_continue()
        run = _open_run_var.get()
        lease = _lease_var.get()
        if lease is not None and run is not None and run.touched and run.scope == scope:
            # The common case, with no await until the callable runs: the run's
            # namespace is in memory already.
            key = f"{run.ns}/{base}" if run.ns else base
            found, value = lease.cached_step(scope, run.ns, key)
            if found is None:
                found, value = await lease.lookup_step(scope, run.ns, key)
        else:
            key = await self._run_key(scope, base)
            found, value = await self._lookup_step(scope, key)
        self._mark_replayed(found)
        if not found and lease is not None and lease.request_id is not None and (
            not _resume_last_run_var.get()
        ):
            # A worker's request owns its namespace: another call at a completed
            # position is the request's own code changed (outside a worker a
            # session's next run may reuse a crashed run's namespace).
            _check_converges(lease, scope, key, args)
        if found:
            self.stats.steps_replayed += 1
            tracing.replayed_step(name)
            _tell_usage(lease, fn, value, replayed=True)
            call_id = kwargs.get("call_id")
            if isinstance(value, ToolResult) and isinstance(call_id, str) and (
                value.call_id != call_id
            ):
                # The model saw this call under a new id: answer under that id.
                value = value.model_copy(update={"call_id": call_id})
            return value
        if lease is not None:
            await lease.send_unsent()
            if not lease.live():
                await lease.confirm()
        # Nothing awaits between the lease's check and the step's callable.
        with tracing.executed_step(name):
            result = await fn(*args, **kwargs)
        await self._write_step(scope, key, result, later=True)
        self.stats.steps_executed += 1
        _tell_usage(lease, fn, result, replayed=False)
        if lease is not None and lease.on_executed is not None:
            await lease.executed()
        return result

    @staticmethod
    def step_codes() -> tuple[CodeType, ...]:
        """The code of the methods that run a journaled step: their frames name
        the step (``name``) and the run (``lease``) to a loop watch."""
        return (PostgresRuntime.step.__code__, PostgresRuntime._stream.__code__)

    @staticmethod
    def _mark_replayed(replayed: bool) -> None:
        lease = _lease_var.get()
        if lease is not None:
            lease.last_replayed = replayed

    def _check_can_continue(self) -> None:
        """At a step boundary: a fenced run stops here, and so does one asked to
        stop, or one whose lease may have lapsed (its process was stopped or
        its loop held past the heartbeats' bound: :meth:`Lease.check_lapsed`)."""
        lease = _lease_var.get()
        if lease is not None:
            lease.check_lapsed()
            if lease.stop is not None:
                raise lease.stop

    def stream_step(
        self,
        name: str,
        fn: Callable[..., AsyncIterator[Any]],
        *args: Any,
        **kwargs: Any,
    ) -> AsyncIterator[Any]:
        return self._stream(name, fn, *args, **kwargs)

    async def _stream(
        self,
        name: str,
        fn: Callable[..., AsyncIterator[Any]],
        *args: Any,
        **kwargs: Any,
    ) -> AsyncIterator[Any]:
        session_id = _current_session_var.get()
        if session_id is None:
            async for chunk in fn(*args, **kwargs):
                yield chunk
            return
        scope = _scope(session_id)
        self._check_can_continue()
        key = await self._run_key(scope, _step_key(name, args, kwargs))
        lease = _lease_var.get()
        if lease is not None:
            found, cached = await lease.lookup_stream(scope, self._namespace(scope), key)
        else:
            stored = await self._pg.get_stream(scope, key)
            found, cached = stored is not None, stored
        self._mark_replayed(found)
        if found:
            self.stats.steps_replayed += 1
            tracing.replayed_step(name)
            _tell_usage(lease, fn, cached, replayed=True)
            for chunk in cached:
                yield chunk
            return
        recorded: list[Any] = []
        if lease is not None:
            await lease.send_unsent()
            if not lease.live():
                await lease.confirm()
        with tracing.executed_step(name, current=False):
            async for chunk in fn(*args, **kwargs):
                recorded.append(chunk)
                yield chunk
        if lease is not None:
            await lease.write_stream(scope, key, recorded, later=True)
        else:
            await self._pg.put_stream(scope, key, recorded)
        self.stats.steps_executed += 1
        _tell_usage(lease, fn, recorded, replayed=False)
        if lease is not None and lease.on_executed is not None:
            await lease.executed()

    # ---- signals ------------------------------------------------------------------------------

    async def signal(
        self, session_id: str, name: str, payload: Any = None, *, user_id: str | None = None
    ) -> None:
        """Deliver a named signal to ``session_id``, in this process or any other.

        Signals are scoped like journals: with ``user_id`` only a waiter of
        that user on the session takes it; without (loomflow's session-only
        ``signal(session_id, ...)``), a waiter of any user on the session.
        The signal is a row until a waiter takes it: one sent before the
        waiter starts, or across a restart, is delivered when it does."""
        check_id("session_id", session_id)
        if user_id is not None:
            check_id("user_id", user_id)
        check_signal_name(name)
        blob = self._pg._encode(payload, f"signal {name}")
        if blob is None:
            raise InvalidInput(
                f"signal {name!r}: the payload can't be stored as JSON; send JSON-able "
                "values, pydantic models or dataclasses"
            )
        await self._signals.send(session_id, user_id, name, blob)

    async def wait_for_signal(
        self, session_id: str, name: str, *, timeout_s: float | None = None,
        user_id: str | None = None,
    ) -> Any:
        """Park until a ``name`` signal for ``session_id`` arrives; return its payload.

        The waiter is of ``user_id`` (inside a run: the run's user): it takes
        signals sent to that user or to no user on the session, never
        another user's. Inside a run the signal is taken and journaled in one
        transaction, so a resumed run replays it instead of waiting again.
        ``TimeoutError`` after ``timeout_s`` seconds (default: wait)."""
        check_id("session_id", session_id)
        check_signal_name(name)
        user_id = _waiter(user_id)
        with anyio.fail_after(timeout_s):
            lease = _lease_var.get()
            run = _open_run_var.get()
            if lease is None or run is None:
                blob = await self._signals.take(session_id, user_id, name)
                return self._decode_signal(blob, name)
            slot = (run.ns, f"{session_id}\x00{name}")
            n = lease.signal_counts.get(slot, 0) + 1
            lease.signal_counts[slot] = n
            key = await self._run_key(run.scope, _step_key(f"signal_{name}_{n}", (session_id,), {}))
            found, value = await lease.lookup_step(run.scope, run.ns, key)
            if found:
                self.stats.steps_replayed += 1
                return value
            hook = _signal_wait_var.get() if timeout_s is None else None
            blob = await self._signals.take_into_journal(
                lease, session_id, user_id, name, run.scope, key,
                on_wait=None if hook is None else functools.partial(hook, session_id, name),
            )
            return self._decode_signal(blob, name)

    def _decode_signal(self, blob: bytes, name: str) -> Any:
        ok, value = self._pg._decode(blob, f"signal {name}")
        if not ok:
            raise InvalidInput(f"signal {name!r}: its stored payload can't be decoded")
        return value

    @property
    def poll_signal(self) -> Any:
        """Not there: loomflow checks ``hasattr(runtime, "poll_signal")`` for a
        non-blocking pop, and signals that live in Postgres can't be taken
        without I/O. ``await runtime.try_signal(session_id, name)`` can."""
        raise AttributeError(
            "PostgresRuntime has no poll_signal: its signals live in Postgres and can't be "
            "taken without I/O; use `await runtime.try_signal(session_id, name)`"
        )

    async def try_signal(
        self, session_id: str, name: str, *, user_id: str | None = None
    ) -> Any | None:
        """Take the oldest queued ``name`` signal for ``session_id`` that
        ``user_id`` may take (as :meth:`wait_for_signal`), or ``None``."""
        check_id("session_id", session_id)
        check_signal_name(name)
        blob = await self._signals.try_take(session_id, _waiter(user_id), name)
        return None if blob is None else self._decode_signal(blob, name)


def _tell_usage(lease: Lease | None, fn: Any, value: Any, *, replayed: bool) -> None:
    """Tell the run's usage (``Lease.usage``) of a step's result, with the
    object whose method ``fn`` is (the model, for a model call)."""
    if lease is not None and lease.usage is not None:
        lease.usage(getattr(fn, "__self__", None), value, replayed)
