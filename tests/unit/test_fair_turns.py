"""A process's looks for requests whose fair turn came: many run ends, few looks,
and no end left unanswered."""

from __future__ import annotations

import asyncio
from typing import Any

from loomflow_worker.worker.fair_turns import FairTurns


class Looks:
    """Stands in for the fair shares check: counts the looks, says "off" so
    that no look reaches the database."""

    def __init__(self) -> None:
        self.count = 0

    async def __call__(self) -> bool:
        self.count += 1
        await asyncio.sleep(0.005)
        return False


def _turns(looks: Looks) -> FairTurns:
    pool: Any = None  # never reached: every look finds fair shares off
    return FairTurns(pool, looks, publish=lambda turn: None, every=0.05)


def test_a_burst_of_ends_makes_two_looks() -> None:
    async def main() -> int:
        looks = Looks()
        turns = _turns(looks)
        for _ in range(500):
            turns.poke()
            await asyncio.sleep(0)
        await asyncio.sleep(0.3)
        await turns.aclose()
        return looks.count

    # The first end's look, then one for every end that came meanwhile.
    assert asyncio.run(main()) == 2


def test_an_end_after_a_look_gets_its_own() -> None:
    async def main() -> list[int]:
        looks = Looks()
        turns = _turns(looks)
        seen = []
        for _ in range(3):
            turns.poke()
            await asyncio.sleep(0.2)  # past the look and its pause
            seen.append(looks.count)
        await turns.aclose()
        return seen

    assert asyncio.run(main()) == [1, 2, 3]
