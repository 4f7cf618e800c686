"""Cross-process signals: rows in ``signals``, woken by LISTEN/NOTIFY.

A signal is a row until a waiter takes it (``DELETE ... RETURNING``, so
each is taken once), until a prune or the retention deletes it (see
:mod:`.prune`), or until its scope holds ``keep`` newer undelivered signals:
each send drops the oldest past that bound (logged and counted), so signals
to sessions that never run can't grow the table without limit. NOTIFY only
wakes waiters early: a waiter also looks again every ``poll_interval``
seconds, so a notification lost while the listener reconnects (a Postgres
restart) delays a signal, never loses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import psycopg
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from .errors import InvalidInput
from .sql import query

if TYPE_CHECKING:
    from .store import Conn, Lease

log = logging.getLogger(__name__)

#: Undelivered signals kept per scope (``LOOMFLOW_WORKER_SIGNALS_PER_SCOPE``).
DEFAULT_SIGNALS_PER_SCOPE = 1000


def check_keep(keep: int) -> int:
    """``keep``, the undelivered signals kept per scope, if it is one (0: no bound)."""
    if keep < 0:
        raise InvalidInput(f"the signals kept per scope must be 0 (no bound) or more, not {keep}")
    return keep


def send_params(
    session_id: str, user_id: str | None, name: str, blob: bytes, keep: int
) -> dict[str, Any]:
    """The parameters of the ``send_signal`` query."""
    check_keep(keep)
    return {"session_id": session_id, "user_id": user_id, "name": name, "payload": blob,
            "keep": keep}


def report_dropped(
    dropped: int, session_id: str, user_id: str | None, keep: int,
    count: Callable[[int], None] | None = None,
) -> None:
    """Log the undelivered signals a send dropped past its scope's bound, and
    ``count`` them (a worker's metric)."""
    if not dropped:
        return
    log.warning(
        "dropped the %d oldest undelivered signal(s) of session %r, user %r: "
        "a scope keeps at most %d (LOOMFLOW_WORKER_SIGNALS_PER_SCOPE)",
        dropped, session_id, user_id, keep,
        extra={"action": "signals_dropped", "dropped": dropped, "keep": keep},
    )
    if count is not None:
        count(dropped)


#: What a process does after each signal one of its runtimes sends (and
#: committed): given a connection of that runtime's pool, the signal's session
#: and its name.
AfterSend = Callable[[AsyncConnection[Any], str, str], Awaitable[None]]


class _AfterSend:
    """The process's :data:`AfterSend`, if any (see :func:`after_send`)."""

    hook: AfterSend | None = None


def after_send(hook: AfterSend | None) -> None:
    """Call ``hook`` after each signal a runtime of this process sends
    (``None``: nothing). The Celery binding sets it as it is imported
    (:mod:`loomflow_worker.tasks.wake`): it publishes at once the requests
    parked waiting for the signal, which the sweeper would publish within a
    sweep."""
    _AfterSend.hook = hook


async def _after_send(pool: AsyncConnectionPool[Any], session_id: str, name: str) -> None:
    """The process's hook, if any, on a connection of ``pool``: what it raises
    is logged, not raised (the signal is sent, and the sweeper does what the
    hook could not)."""
    hook = _AfterSend.hook
    if hook is None:
        return
    try:
        async with pool.connection() as conn:
            await hook(conn, session_id, name)
    except Exception as exc:
        log.warning(
            "signal %r of session %r sent, but publishing the requests waiting for it "
            "failed (%s); the sweeper publishes them", name, session_id, exc,
            extra={"action": "signal_wake_failed"},
        )


def _mailbox(session_id: str) -> str:
    return hashlib.md5(session_id.encode("utf-8", "surrogatepass")).hexdigest()


class SignalListener:
    """Sends and takes signals; one LISTEN connection per runtime, opened on first wait."""

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        conninfo: str,
        conn_kwargs: dict[str, Any],
        *,
        poll_interval: float = 2.0,
        keep: int = DEFAULT_SIGNALS_PER_SCOPE,
        on_dropped: Callable[[int], None] | None = None,
    ) -> None:
        self._keep = check_keep(keep)  # a bad bound is refused now, not at a send
        self._on_dropped = on_dropped
        self._pool = pool
        self._conninfo = conninfo
        self._conn_kwargs = conn_kwargs
        self._poll_interval = poll_interval
        self._waiters: dict[str, set[anyio.Event]] = {}
        self._task: asyncio.Task[None] | None = None
        self._conn: AsyncConnection[Any] | None = None
        self._closed = False

    async def send(self, session_id: str, user_id: str | None, name: str, blob: bytes) -> None:
        async with self._pool.connection() as conn:
            cur = await conn.execute(
                query("send_signal"), send_params(session_id, user_id, name, blob, self._keep)
            )
            row = await cur.fetchone()
        assert row is not None
        report_dropped(int(row[2]), session_id, user_id, self._keep, self._on_dropped)
        await _after_send(self._pool, session_id, name)

    async def try_take(self, session_id: str, user_id: str | None, name: str) -> bytes | None:
        async with self._pool.connection() as conn:
            cur = await conn.execute(
                query("take_signal"), {"session_id": session_id, "user_id": user_id, "name": name}
            )
            row = await cur.fetchone()
        return None if row is None else bytes(row[0])

    async def take(self, session_id: str, user_id: str | None, name: str) -> bytes:
        """The oldest ``name`` signal for ``session_id`` that ``user_id`` may
        take (sent to that user or to none), waiting for one."""
        while True:
            with self._waiting(session_id) as woken:
                blob = await self.try_take(session_id, user_id, name)
                if blob is not None:
                    return blob
                await self._sleep(woken)

    async def take_into_journal(
        self, lease: Lease, session_id: str, user_id: str | None, name: str, scope: str,
        key: str, on_wait: Callable[[float], None] | None = None,
    ) -> bytes:
        """Take a signal and journal it under ``key`` in one transaction on the
        run's lock connection: consumed exactly when it is recorded.
        ``on_wait(seconds)`` is called each time the signal is not there yet,
        with how long the run has waited for it (it may raise, to stop waiting)."""
        params = {
            "session_id": session_id,
            "user_id": user_id,
            "name": name,
            "scope": scope,
            "key": key,
        }

        await lease.flush_last_run()

        async def take(conn: Conn) -> tuple[Any, ...] | None:
            cur = await conn.execute(query("take_signal_into_journal"), params)
            return await cur.fetchone()

        since = time.monotonic()
        while True:
            with self._waiting(session_id) as woken:
                row = await lease.io(take)
                if row is not None:
                    blob = bytes(row[0])
                    lease.remember_step(scope, key, blob)
                    return blob
                if on_wait is not None:
                    on_wait(time.monotonic() - since)
                await self._sleep(woken)

    @contextlib.contextmanager
    def _waiting(self, session_id: str) -> Any:
        self._ensure_listener()
        woken = anyio.Event()
        box = self._waiters.setdefault(_mailbox(session_id), set())
        box.add(woken)
        try:
            yield woken
        finally:
            box.discard(woken)
            if not box:
                self._waiters.pop(_mailbox(session_id), None)

    async def _sleep(self, woken: anyio.Event) -> None:
        with anyio.move_on_after(self._poll_interval):
            await woken.wait()

    def _ensure_listener(self) -> None:
        if self._task is None and not self._closed:
            self._task = asyncio.get_running_loop().create_task(
                self._listen(), name="loomflow-worker signal listener"
            )

    async def _listen(self) -> None:
        backoff = 0.1
        while not self._closed:
            try:
                conn = await AsyncConnection.connect(
                    self._conninfo,
                    **{**self._conn_kwargs, "autocommit": True,
                       "application_name": "loomflow-worker signals"},
                )
                self._conn = conn
                async with conn:
                    await conn.execute(query("listen_signals"))
                    backoff = 0.1
                    self._wake_all()  # anything sent while we were away
                    async for note in conn.notifies():
                        for event in list(self._waiters.get(note.payload, ())):
                            event.set()
            except psycopg.Error as exc:
                if self._closed:
                    return
                log.warning(
                    "signal listener lost its connection (%s); reconnecting in %.1fs",
                    exc,
                    backoff,
                    extra={"action": "signal_listener_reconnect"},
                )
                self._wake_all()
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                self._conn = None

    def _wake_all(self) -> None:
        for box in self._waiters.values():
            for event in box:
                event.set()

    async def aclose(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, psycopg.Error):
                await task
