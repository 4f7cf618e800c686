"""A table read kept for a few seconds, for what every run or enqueue consults
and an operator changes rarely (model budgets, concurrency limits, the
limits an enqueue withholds requests by).

The read is made again once the last one is ``every`` seconds old, one
reader at a time: callers arriving while it is under way wait for it and take
what it read, so a burst of runs makes one statement, not one each. A read
that raises keeps the last value and stays stale, so the next caller tries
again. :class:`CachedRead` serves threads (the sync enqueue), and
:class:`AsyncCachedRead` tasks on one event loop (a worker's runs)."""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import anyio

T = TypeVar("T")


class _Kept(Generic[T]):
    """The value last read (``initial`` before any) and when, on ``clock``."""

    def __init__(self, initial: T, every: float, clock: Callable[[], float]) -> None:
        self.value = initial
        self.every = every
        self._clock = clock
        self._read_at: float | None = None

    def fresh(self) -> bool:
        """Whether the last read is under ``every`` seconds old."""
        return self._read_at is not None and self._clock() - self._read_at < self.every

    def forget(self) -> None:
        """Read again at the next :meth:`get`, however recent the last read."""
        self._read_at = None

    def _keep(self, value: T) -> None:
        self.value = value
        self._read_at = self._clock()


class CachedRead(_Kept[T]):
    """:class:`_Kept` for threads: :meth:`get` reads under a lock."""

    def __init__(self, initial: T, every: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(initial, every, clock)
        self._reading = threading.Lock()

    def get(self, read: Callable[[], T]) -> T:
        """The value, read with ``read()`` first when it is stale."""
        with self._reading:
            if not self.fresh():
                self._keep(read())
            return self.value


class AsyncCachedRead(_Kept[T]):
    """:class:`_Kept` for tasks: :meth:`get` reads under an async lock."""

    def __init__(self, initial: T, every: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(initial, every, clock)
        self._reading = anyio.Lock()

    async def get(self, read: Callable[[], Awaitable[T]]) -> T:
        """The value, read with ``await read()`` first when it is stale."""
        if not self.fresh():
            async with self._reading:
                if not self.fresh():
                    self._keep(await read())
        return self.value
