"""One way to retry a short ledger write for a bounded time (a database that
restarts, a lock not free yet), used wherever a worker must record something
before it goes on."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import psycopg

T = TypeVar("T")

#: What is worth trying again: the database's errors, and a pool that gave no
#: connection in time.
RETRIABLE: tuple[type[BaseException], ...] = (psycopg.Error, TimeoutError)


def retry_within(
    within: float,
    attempt: Callable[[], T | None],
    *,
    pause: float = 0.2,
    max_pause: float = 2.0,
    failed: Callable[[BaseException], object] | None = None,
) -> T | None:
    """Call ``attempt`` until it returns something other than ``None``, for up
    to ``within`` seconds, and return that.

    ``None``, or one of :data:`RETRIABLE` (handed to ``failed`` first), means
    not yet: the next call comes after ``pause`` seconds, doubled each time up
    to ``max_pause``. Returns ``None`` when that call would come past
    ``within``; any other error is raised."""
    deadline = time.monotonic() + within
    while True:
        try:
            result = attempt()
        except RETRIABLE as exc:
            if failed is not None:
                failed(exc)
            result = None
        if result is not None:
            return result
        if time.monotonic() + pause > deadline:
            return None
        time.sleep(pause)
        pause = min(pause * 2, max_pause)
