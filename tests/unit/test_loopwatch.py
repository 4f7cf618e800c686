"""The loop watch names what held an event loop (a real loop and thread, no services)."""

from __future__ import annotations

import asyncio
import threading
import time

from loomflow_worker.runtime.loopwatch import LoopWatch, Stall


async def _watched(hold: object, build_codes: tuple[object, ...] = ()) -> list[Stall]:
    stalls: list[Stall] = []
    reported = threading.Event()

    def on_stall(stall: Stall) -> None:
        stalls.append(stall)
        reported.set()

    watch = LoopWatch(stall=0.3, build_codes=build_codes,  # type: ignore[arg-type]
                      on_stall=on_stall)
    watch.start()
    try:
        await asyncio.sleep(0.2)
        await hold()  # type: ignore[operator]
        await asyncio.to_thread(reported.wait, 5)
    finally:
        watch.stop()
    return stalls


def _blocking_tool() -> None:
    time.sleep(0.8)


async def tool() -> None:
    _blocking_tool()


async def agent(name: str) -> None:
    """Stands for WorkerContext.agent: a factory that holds the loop."""
    _blocking_tool()


def test_a_stall_names_the_code_that_held_the_loop() -> None:
    stalls = asyncio.run(_watched(tool))
    assert len(stalls) == 1 and not stalls[0].frozen
    culprit = stalls[0].culprit
    assert culprit is not None and culprit.agent is None
    assert "_blocking_tool" in culprit.where and culprit.request_id is None
    assert stalls[0].held >= 0.3


def test_a_stall_while_an_agent_is_built_names_the_agent() -> None:
    stalls = asyncio.run(_watched(lambda: agent("research"), (agent.__code__,)))
    assert len(stalls) == 1
    culprit = stalls[0].culprit
    assert culprit is not None and culprit.agent == "research"
    assert "_blocking_tool" in culprit.where
