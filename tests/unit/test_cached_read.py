"""A table read kept for a few seconds (execution/cached.py): read again once
stale, one reader at a time, a failed read retried by the next caller (pure
logic: a hand-driven clock, no services)."""

from __future__ import annotations

import threading

import anyio
import pytest

from loomflow_worker.execution.cached import AsyncCachedRead, CachedRead


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_read_is_kept_for_its_seconds_then_made_again() -> None:
    clock, reads = Clock(), []

    def read() -> int:
        reads.append(clock.now)
        return len(reads)

    kept = CachedRead(0, every=2.0, clock=clock)
    assert kept.value == 0 and not kept.fresh()
    assert kept.get(read) == 1
    clock.now += 1.9
    assert kept.get(read) == 1
    clock.now += 0.1
    assert kept.get(read) == 2
    kept.forget()
    assert kept.get(read) == 3
    assert reads == [100.0, 102.0, 102.0]


def test_a_failed_read_keeps_the_last_value_and_the_next_caller_reads() -> None:
    clock = Clock()
    kept = CachedRead("old", every=2.0, clock=clock)

    def fail() -> str:
        raise OSError("unreachable")

    with pytest.raises(OSError):
        kept.get(fail)
    assert kept.value == "old" and not kept.fresh()
    assert kept.get(lambda: "new") == "new" and kept.fresh()


def test_threads_arriving_during_a_read_wait_for_it_and_take_what_it_read() -> None:
    started, release, reads = threading.Event(), threading.Event(), []

    def slow() -> int:
        reads.append(1)
        started.set()
        assert release.wait(10)
        return 7

    kept = CachedRead(0, every=60.0)
    got: list[int] = []
    first = threading.Thread(target=lambda: got.append(kept.get(slow)))
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=lambda: got.append(kept.get(slow)))
    second.start()
    release.set()
    first.join(10)
    second.join(10)
    assert got == [7, 7] and reads == [1]


@pytest.mark.anyio
async def test_tasks_arriving_during_a_read_wait_for_it_and_take_what_it_read() -> None:
    clock, started, release, reads = Clock(), anyio.Event(), anyio.Event(), []

    async def slow() -> str:
        reads.append(clock.now)
        started.set()
        await release.wait()
        return f"read {len(reads)}"

    kept = AsyncCachedRead("none", every=2.0, clock=clock)
    got: list[str] = []

    async def get() -> None:
        got.append(await kept.get(slow))

    async with anyio.create_task_group() as tg:
        tg.start_soon(get)
        await started.wait()
        tg.start_soon(get)
        tg.start_soon(get)
        release.set()
    assert got == ["read 1"] * 3 and reads == [100.0]
    clock.now += 2.0
    release = anyio.Event()
    release.set()
    assert await kept.get(slow) == "read 2"
