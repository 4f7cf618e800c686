"""The suite's one way to wait for something to happen: poll a condition until
it holds, and on timeout fail saying what did not happen and what was last
seen. No test writes its own deadline loop (``tests/unit/test_waiting.py``
checks it), so that every flaky wait reads the same way when it fails.

Only the standard library: the harness, the stand-in servers and the
documentation runner import it as well as the tests."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

# Longer than this, the last value seen is cut in the failure message.
SHOWN = 2000


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}... ({len(text)} characters)"


def timed_out(what: str, timeout: float, seen: object,
              detail: Callable[[], object] | None) -> AssertionError:
    """The failure of a wait: ``what`` did not happen within ``timeout``
    seconds, the last value seen, and ``detail()`` (a log, say) if given."""
    message = f"{what}: not within {timeout:g}s; last seen: {_shown(seen)}"
    if detail is not None:
        message += f"\n{detail()}"
    return AssertionError(message)


def wait_until(
    condition: Callable[[], T],
    what: str,
    timeout: float = 30,
    *,
    until: Callable[[T], object] = bool,
    every: float = 0.02,
    detail: Callable[[], object] | None = None,
) -> T:
    """Call ``condition`` every ``every`` seconds until ``until`` holds of what
    it returns (by default: until it returns a truthy value); that value.

    After ``timeout`` seconds, raise an AssertionError naming ``what`` (what
    was waited for), the last value ``condition`` returned and, if given,
    ``detail()`` (workers' logs, say: called only then)."""
    deadline = time.monotonic() + timeout
    while True:
        seen = condition()
        if until(seen):
            return seen
        if time.monotonic() >= deadline:
            raise timed_out(what, timeout, seen, detail)
        time.sleep(every)


async def wait_until_async(
    condition: Callable[[], Awaitable[T]],
    what: str,
    timeout: float = 30,  # noqa: ASYNC109 (the twin of wait_until, its deadline its own)
    *,
    until: Callable[[T], object] = bool,
    every: float = 0.02,
    detail: Callable[[], object] | None = None,
) -> T:
    """:func:`wait_until` for a condition that is a coroutine function
    (sleeping with ``anyio.sleep``, so the event loop runs meanwhile)."""
    import anyio

    deadline = time.monotonic() + timeout
    while True:
        seen = await condition()
        if until(seen):
            return seen
        if time.monotonic() >= deadline:
            raise timed_out(what, timeout, seen, detail)
        await anyio.sleep(every)

