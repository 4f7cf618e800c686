"""A process of quarantine's places (pure logic: no process is started)."""

from __future__ import annotations

from loomflow_worker.tasks.groups import AloneRuns, Quarantine


def test_a_group_holds_at_most_its_capacity_at_once_and_refills() -> None:
    group = Quarantine(AloneRuns(), isolation=1, capacity=2, on_death=print)
    assert group.join("a") is not None and group.join("b") is not None
    assert group.join("c") is None  # full: a poison there takes one other with it
    assert group.first == "a"  # the request that starts its process
    group.members.pop("a")  # a left (handed back)
    assert group.join("c") is not None
    assert sorted(group.members) == ["b", "c"]


def test_a_closed_group_takes_nobody() -> None:
    group = Quarantine(AloneRuns(), isolation=1, capacity=8, on_death=print)
    assert group.join("a") is not None
    group.closed = True
    assert group.join("b") is None


def test_a_request_alone_has_its_process_to_itself() -> None:
    alone = Quarantine(AloneRuns(), isolation=2, capacity=1, on_death=print)
    assert alone.join("a") is not None
    assert alone.join("b") is None
