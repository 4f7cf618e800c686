"""Live events of a run, read before, during and after it."""

from __future__ import annotations

import os
import signal
import threading

from loomflow_worker.events import RunEvent, iter_events
from loomflow_worker.tasks import run_agent, settings

from .celery_harness import Fleet
from .helpers import calls
from .test_celery import _wait_for_execution


def _summary(events: list[RunEvent]) -> list[tuple[int, str, bool]]:
    return [(e.attempt, e.kind, e.replayed) for e in events]


def test_readers_attached_before_during_and_after_see_the_same_ordered_events(
    fleet: Fleet,
) -> None:
    fleet.start("w1", concurrency=1, TEST_TOOL_SLEEP="0.3")
    result = run_agent.delay(calls("e1", "e2", "e3"), "s")
    seen: dict[str, list[RunEvent]] = {}

    def read(name: str) -> None:
        seen[name] = list(iter_events(result.id, settings=settings(), idle_timeout=30))

    before = threading.Thread(target=read, args=("before",))
    before.start()
    _wait_for_execution(fleet.dsn, "e2")
    during = threading.Thread(target=read, args=("during",))
    during.start()
    result.get(timeout=60)
    before.join(30)
    during.join(30)
    read("after")
    assert seen["before"] == seen["during"] == seen["after"]
    kinds = [e.kind for e in seen["after"]]
    assert kinds[0] == "started" and kinds[-1] == "end"
    assert kinds.count("tool_call") == 3 and kinds.count("tool_result") == 3
    assert "model_chunk" in kinds and "completed" in kinds
    assert seen["after"][-1].data == {"status": "succeeded", "error": None}
    assert not any(e.replayed for e in seen["after"])
    assert [e.id for e in seen["after"]] == sorted(
        (e.id for e in seen["after"]), key=lambda i: tuple(map(int, i.split("-")))
    )


def test_events_of_a_resumed_attempt_say_what_replayed(fleet: Fleet) -> None:
    fleet.start("w1", concurrency=1, TEST_TOOL_SLEEP="0.4")
    result = run_agent.delay(calls("r1", "r2"), "s")
    _, pid, _, _ = _wait_for_execution(fleet.dsn, "r2")
    os.kill(pid, signal.SIGKILL)
    result.get(timeout=60)
    events = list(iter_events(result.id, settings=settings(), idle_timeout=30))
    first = [e for e in events if e.attempt == 1]
    second = [e for e in events if e.attempt == 2]
    assert first and second and events[-1].kind == "end"
    assert "end" not in [e.kind for e in first]  # the crash ended nothing
    def output(event: RunEvent) -> object:
        return event.data.get("payload", {}).get("result", {}).get("output")

    replayed = [(e.kind, output(e)) for e in second if e.replayed]
    # The second attempt replayed the first tool call (and the model calls around it)...
    assert ("tool_result", "recorded r1") in replayed
    # ...and ran the interrupted one for real.
    fresh = [e for e in second if not e.replayed and e.kind == "tool_result"]
    assert [output(e) for e in fresh] == ["recorded r2"]
