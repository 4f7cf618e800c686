"""A process of quarantine's places (pure logic: no process is started)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import pytest

from loomflow_worker.execution.execute import _Said, _to_quarantine
from loomflow_worker.execution.request import RunRequest
from loomflow_worker.execution.statuses import QuarantineLevel
from loomflow_worker.worker.quarantine import attempts as alone
from loomflow_worker.worker.quarantine.processes import QuarantineProcess, QuarantineRuns

GROUP, ALONE = QuarantineLevel.GROUP, QuarantineLevel.ALONE


def test_a_group_holds_at_most_its_capacity_at_once_and_refills() -> None:
    group = QuarantineProcess(QuarantineRuns(), level=GROUP, capacity=2, on_death=print)
    assert group.join("a") is not None and group.join("b") is not None
    assert group.join("c") is None  # full: a poison there takes one other with it
    assert group.first == "a"  # the request that starts its process
    group.members.pop("a")  # a left (handed back)
    assert group.join("c") is not None
    assert sorted(group.members) == ["b", "c"]


def test_a_closed_group_takes_nobody() -> None:
    group = QuarantineProcess(QuarantineRuns(), level=GROUP, capacity=8, on_death=print)
    assert group.join("a") is not None
    group.closed = True
    assert group.join("b") is None


def test_a_request_alone_has_its_process_to_itself() -> None:
    alone = QuarantineProcess(QuarantineRuns(), level=ALONE, capacity=1, on_death=print)
    assert alone.join("a") is not None
    assert alone.join("b") is None


def test_suspects_placed_at_once_share_one_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group is listed before another suspect can look for one: two placed
    at the same moment join one process, however long making the group takes."""
    runs = QuarantineRuns()
    monkeypatch.setattr(alone.PROCESS, "quarantine", runs)

    class Slow(QuarantineProcess):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            time.sleep(0.2)  # the first suspect between its slot and its group
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(alone, "QuarantineProcess", Slow)
    places: dict[str, Any] = {}

    def place(request_id: str) -> None:
        places[request_id] = alone._place(request_id, level=GROUP, capacity=8, at_once=4)

    threads = [threading.Thread(target=place, args=(r,)) for r in ("a", "b")]
    threads[0].start()
    time.sleep(0.05)
    threads[1].start()
    for thread in threads:
        thread.join()
    assert places["a"] is not None and places["b"] is not None
    assert places["a"][0] is places["b"][0], places
    assert runs.taken == 1 and runs.groups == [places["a"][0]]


def test_a_request_handed_to_quarantine_again_at_its_level_is_said_once() -> None:
    # A request that finds no room to run alone comes back every few hundred
    # milliseconds: its reason is a warning once, not at each hand-on.
    said = _Said(keep=2)
    assert said.first("a", ALONE)
    assert not said.first("a", ALONE)
    assert said.first("a", GROUP) and said.first("a", ALONE)  # its level changed
    assert said.first("b", GROUP)
    assert said.first("a", GROUP)  # said again: "a" is now the newer of the two
    assert said.first("c", GROUP)  # "b", the oldest, forgotten
    assert not said.first("a", GROUP) and said.first("b", GROUP)


class _Asked:
    """An attempt's part that a hand-on to quarantine uses (no database)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.marked = 0

    async def mark_quarantined(self) -> None:
        self.marked += 1


def test_a_hand_on_to_quarantine_warns_once_and_marks_each_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    req = RunRequest(prompt="p", session_id="s", user_id=None, agent="a", metadata={})
    asked = _Asked("handed-on-twice")
    caplog.set_level(logging.DEBUG, logger="loomflow_worker.execution.execute")
    for _ in range(3):
        outcome = asyncio.run(_to_quarantine(asked, req, ALONE))  # type: ignore[arg-type]
        assert outcome.quarantine == ALONE
    assert asked.marked == 3  # dispatched now, each time: the sweeper leaves it be
    levels = [r.levelno for r in caplog.records if "handed-on-twice" in r.getMessage()]
    assert levels == [logging.WARNING, logging.DEBUG, logging.DEBUG], caplog.text
