"""One long-lived event loop per pool child, in a thread of its own.

Celery tasks are sync; the runtime is async and its connections are bound
to the loop that made them. Each pool child makes one loop at
``worker_process_init`` (or at its first task, in a solo pool) and keeps
it, with its connection pool and agents, until ``worker_process_shutdown``.
Nothing is opened before the fork."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class ChildLoop:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._lock = threading.Lock()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=loop.run_forever, name="loomflow-worker loop", daemon=True
                )
                thread.start()
                self._loop, self._thread, self._pid = loop, thread, os.getpid()
            return self._loop

    @property
    def running(self) -> bool:
        return self._loop is not None and self._pid == os.getpid()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

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
