"""A process's looks for requests whose fair turn came: many run ends, few looks,
and no end left unanswered."""

from __future__ import annotations

import asyncio
from typing import Any

from loomflow_worker.execution import ledger
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


class Pages(FairTurns):
    """Looks that publish the pages given, one a look (no database)."""

    def __init__(self, pages: list[int]) -> None:
        super().__init__(None, Looks(), publish=lambda turn: None, every=0.01)  # type: ignore[arg-type]
        self.pages, self.looked = pages, 0

    async def look(self) -> int:
        self.looked += 1
        return self.pages.pop(0) if self.pages else 0


def test_a_look_that_publishes_a_full_page_looks_again_unpoked() -> None:
    async def main() -> int:
        turns = Pages([ledger.FAIR_PAGE, ledger.FAIR_PAGE, 7, ledger.FAIR_PAGE])
        turns.poke()
        await asyncio.sleep(0.3)
        await turns.aclose()
        return turns.looked

    # Two full pages and the one that was not: the fourth page waits for a poke.
    assert asyncio.run(main()) == 3
