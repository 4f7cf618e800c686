"""One long-lived event loop per pool child, in a thread of its own.

Celery tasks are sync; the runtime is async and its connections are bound
to the loop that made them. Each pool child makes one loop at
``worker_process_init`` (or at its first task, in a solo pool) and keeps
it, with its connection pool and agents, until ``worker_process_shutdown``.
Nothing is opened before the fork."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ..runtime.loopwatch import claim_thread_for_asyncio

T = TypeVar("T")

#: How long an interrupted coroutine gets to unwind (release its session
#: lock, close its cursor) before the caller goes on without it.
UNWIND_TIMEOUT = 5.0


def serve_forever(loop: asyncio.AbstractEventLoop) -> None:
    """The loop thread's work: ``loop`` until it is stopped."""
    claim_thread_for_asyncio()
    loop.run_forever()


class ChildLoop:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._lock = threading.Lock()
        self._running: dict[str, concurrent.futures.Future[Any]] = {}

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=serve_forever, args=(loop,), name="loomflow-worker loop", daemon=True
                )
                thread.start()
                self._loop, self._thread, self._pid = loop, thread, os.getpid()
            return self._loop

    @property
    def running(self) -> bool:
        return self._loop is not None and self._pid == os.getpid()

    def cancel(self, key: str) -> bool:
        """Cancel the coroutine run under ``key``; ``False`` when none is."""
        future = self._running.get(key)
        return future is not None and future.cancel()

    def run(
        self,
        coro: Coroutine[Any, Any, T],
        timeout: float | None = None,
        key: str | None = None,
        interrupt: Callable[[BaseException], bool] | None = None,
    ) -> T:
        """Run ``coro`` on the loop and wait for its result.

        When the wait ends early (``timeout``, or the ``SystemExit`` that
        billiard raises in a pool child told to terminate), ``coro`` is
        cancelled and given :data:`UNWIND_TIMEOUT` to unwind, so a run
        stopped by a shutdown releases its session lock at once instead of
        going on in the loop's thread while the process exits. Unless
        ``interrupt`` takes the exception that ended the wait (it returns
        ``True`` once it told ``coro`` to end on its own, as for Celery's soft
        time limit): then the wait goes on, and the next one cancels."""
        started, unwound = threading.Event(), threading.Event()

        async def guarded() -> T:
            started.set()
            try:
                return await coro
            finally:
                unwound.set()

        future = asyncio.run_coroutine_threadsafe(guarded(), self.loop)
        if key is not None:
            self._running[key] = future
        try:
            while True:
                try:
                    return future.result(timeout)
                except BaseException as exc:
                    if interrupt is None or not interrupt(exc):
                        raise
                    interrupt = None
        except BaseException:
            if future.cancel() and started.is_set():
                unwound.wait(UNWIND_TIMEOUT)
            raise
        finally:
            if key is not None and self._running.get(key) is future:
                del self._running[key]

    def stop(self) -> None:
        with self._lock:
            loop, thread = self._loop, self._thread
            if loop is None or self._pid != os.getpid():
                return
            loop.call_soon_threadsafe(loop.stop)
            if thread is not None:
                thread.join(timeout=10)
            loop.close()
            self._loop = self._thread = None
