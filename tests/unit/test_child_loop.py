"""The pool child's event loop: a wait cut short stops the coroutine it waited for."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Iterator
from types import FrameType

import pytest

from loomflow_worker.tasks.loop import ChildLoop


@pytest.fixture
def loop() -> Iterator[ChildLoop]:
    child = ChildLoop()
    yield child
    child.stop()


def test_run_returns_the_coroutines_result(loop: ChildLoop) -> None:
    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    assert loop.run(answer()) == 42


def test_a_terminate_signal_cancels_the_coroutine_and_waits_for_it_to_unwind(
    loop: ChildLoop,
) -> None:
    # billiard's terminate handler raises SystemExit in the child's main
    # thread, which is waiting for the run: the run must stop and unwind
    # (release its lock) before the exception goes on, not run on in the
    # loop's thread while the process exits.
    unwound = threading.Event()

    async def run_forever() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.2)  # an unlock round trip
            unwound.set()

    def terminate(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(-15)

    previous = signal.signal(signal.SIGALRM, terminate)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(SystemExit):
            loop.run(run_forever())
        assert unwound.is_set()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_timeout_cancels_the_coroutine(loop: ChildLoop) -> None:
    cancelled = threading.Event()

    async def hang() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError):
        loop.run(hang(), timeout=0.1)
    assert cancelled.is_set()
