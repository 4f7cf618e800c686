"""The pool child's event loop: a wait cut short stops the coroutine it waited for."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

import pytest
import sniffio

from loomflow_worker.worker.loop import ChildLoop


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


def test_the_loop_thread_tells_anyio_it_runs_asyncio_without_asking_asyncio(
    loop: ChildLoop,
) -> None:
    # anyio asks sniffio at each of its calls; sniffio otherwise asks
    # asyncio.current_task(), a getpid() system call each time.
    async def library() -> tuple[str | None, str]:
        return sniffio.thread_local.name, sniffio.current_async_library()

    assert loop.run(library()) == ("asyncio", "asyncio")
    assert sniffio.thread_local.name is None  # the caller's thread is untouched


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


@pytest.mark.parametrize("interrupt", [None, lambda exc: False],
                         ids=["no interrupt", "an interrupt that declines"])
def test_a_timeout_cancels_the_coroutine(
    loop: ChildLoop, interrupt: Callable[[BaseException], bool] | None
) -> None:
    cancelled = threading.Event()

    async def hang() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError):
        loop.run(hang(), timeout=0.1, interrupt=interrupt)
    assert cancelled.is_set()


def test_an_exception_the_interrupt_takes_lets_the_coroutine_end_on_its_own(
    loop: ChildLoop,
) -> None:
    # Celery's soft time limit raises SoftTimeLimitExceeded in the child's
    # main thread from a signal handler: the run is told to end (as past its
    # time limit) and the wait goes on for what it returns, instead of
    # cancelling it mid-attempt.
    from celery.exceptions import SoftTimeLimitExceeded

    told: list[BaseException] = []
    stop = asyncio.Event()

    async def run_until_told() -> str:
        await stop.wait()
        await asyncio.sleep(0.1)  # the finishing commit
        return "ended past its time limit"

    def interrupt(exc: BaseException) -> bool:
        if not isinstance(exc, SoftTimeLimitExceeded):
            return False
        told.append(exc)
        loop.loop.call_soon_threadsafe(stop.set)
        return True

    def soft_limit(signum: int, frame: FrameType | None) -> None:
        raise SoftTimeLimitExceeded()

    previous = signal.signal(signal.SIGALRM, soft_limit)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        assert loop.run(run_until_told(), interrupt=interrupt) == "ended past its time limit"
        assert len(told) == 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

