"""Live events of a run, read before, during and after it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import NamedTuple

import pytest
import redis

from loomflow_worker.events import EventPublisher, RunEvent, iter_events, stream_key
from loomflow_worker.settings import Settings
from loomflow_worker.tasks import run_agent, settings

from .celery_harness import REDIS_URL, Fleet
from .helpers import calls, wait_for_execution, wait_until_async


def _summary(events: list[RunEvent]) -> list[tuple[int, str, bool]]:
    return [(e.attempt, e.kind, e.replayed) for e in events]


class Streams(NamedTuple):
    """A test's own key prefix on the test Redis, and a client to read its streams."""

    prefix: str
    client: redis.Redis


@pytest.fixture
def streams() -> Iterator[Streams]:
    """A key prefix of the test's own; its keys are deleted afterwards."""
    prefix = f"lfwtest:{uuid.uuid4().hex[:8]}:"
    client = redis.Redis.from_url(REDIS_URL)
    try:
        yield Streams(prefix, client)
    finally:
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)
        client.close()


@pytest.mark.slow
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
    wait_for_execution(fleet.dsn, "e2")
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


@pytest.mark.slow
def test_events_of_a_resumed_attempt_say_what_replayed(fleet: Fleet) -> None:
    fleet.start("w1", concurrency=1, TEST_TOOL_SLEEP="0.4")
    result = run_agent.delay(calls("r1", "r2"), "s")
    _, pid, _, _ = wait_for_execution(fleet.dsn, "r2")
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


def test_requests_that_end_together_send_their_events_in_one_call(streams: Streams) -> None:
    """Each request's end waits until its events are in its stream (its result
    is stored after that), and on a busy process those ending within the
    wait share one call to Redis: a process ending a hundred requests a
    second makes far fewer."""
    prefix, client = streams
    url = REDIS_URL
    calls_made: list[int] = []
    found: dict[str, list[str]] = {}

    async def end_all() -> None:
        publisher = EventPublisher(url, prefix=prefix, maxlen=1000, retention=600,
                                   interval=60, step_end_delay=60, load=lambda: 1000)
        send = publisher._send

        async def counted(batch: dict[str, list[str]]) -> None:
            calls_made.append(len(batch))
            await send(batch)

        publisher._send = counted  # type: ignore[method-assign]

        async def end(request_id: str) -> None:
            publisher.publish(request_id, 1, "completed", "{}", replayed=False)
            publisher.end(request_id, 1, "succeeded", None)
            await publisher.sent(0.2)
            # Back from sent(): the stream holds the request's end.
            found[request_id] = [
                fields[b"kind"].decode()
                for _, fields in client.xrange(stream_key(prefix, request_id))]

        try:
            first = asyncio.create_task(end("r0"))
            await asyncio.sleep(0.05)
            await asyncio.gather(first, *(end(f"r{i}") for i in range(1, 6)))
            await publisher.sent(0.2)  # nothing left: at once
        finally:
            await publisher.aclose()

    asyncio.run(end_all())
    assert found == {f"r{i}": ["completed", "end"] for i in range(6)}, found
    assert calls_made == [6], calls_made


def test_a_request_ending_while_its_events_are_on_their_way_waits_for_them(
    streams: Streams,
) -> None:
    """A flush already sending a request's events (its timer fired first)
    holds that request's end until they are in its stream, as one it makes
    itself would."""
    prefix, client = streams
    url = REDIS_URL
    found: list[str] = []

    async def end() -> None:
        publisher = EventPublisher(url, prefix=prefix, maxlen=1000, retention=600,
                                   interval=60, step_end_delay=60)
        send = publisher._send
        sending = asyncio.Event()

        async def slow(batch: dict[str, list[str]]) -> None:
            sending.set()
            await asyncio.sleep(0.3)
            await send(batch)

        publisher._send = slow  # type: ignore[method-assign]
        try:
            publisher.end("r0", 1, "succeeded", None)
            flushing = asyncio.create_task(publisher.flush())
            await sending.wait()
            await publisher.sent(0.01)
            found.extend(fields[b"kind"].decode()
                         for _, fields in client.xrange(stream_key(prefix, "r0")))
            await flushing
        finally:
            await publisher.aclose()

    asyncio.run(end())
    assert found == ["end"], found


def test_one_flush_appends_each_requests_events_to_its_own_stream_in_order(
    streams: Streams,
) -> None:
    """A batch spanning many requests goes out in one call, and each stream
    gets exactly its own events, in the order they were published, with a
    lifetime."""
    prefix, client = streams
    url = REDIS_URL
    requests = [f"r{i}" for i in range(5)]

    async def publish() -> None:
        publisher = EventPublisher(url, prefix=prefix, maxlen=1000, retention=600,
                                   interval=60)
        try:
            for step in range(4):
                for i, request_id in enumerate(requests[: step + 2]):
                    publisher.publish(request_id, 1, "model_chunk",
                                      json.dumps({"step": step, "i": i}), replayed=False)
            await publisher.flush()
        finally:
            await publisher.aclose()

    asyncio.run(publish())
    for i, request_id in enumerate(requests):
        events = list(iter_events(request_id, url=url, follow=False,
                                  settings=Settings(redis_key_prefix=prefix)))
        steps = [e.data["step"] for e in events]
        assert steps == [s for s in range(4) if i < s + 2], (request_id, steps)
        assert all(e.data["i"] == i and e.kind == "model_chunk" for e in events)
        assert 0 < client.ttl(stream_key(prefix, request_id)) <= 600


def test_batches_gather_longer_only_as_the_process_carries_more_runs() -> None:
    runs = [1]
    publisher = EventPublisher(REDIS_URL, prefix="lfwtest:unused:", maxlen=10, retention=60,
                               interval=0.1, step_end_delay=0.05, load=lambda: runs[0])

    async def delays() -> list[tuple[float, float]]:
        found = []
        for runs[0] in (0, 1, 20, 100, 1000):
            found.append((publisher.delay(), publisher.delay(step_end=True)))
        await publisher.aclose()
        return found

    assert asyncio.run(delays()) == [
        (0.0, 0.0), (0.001, 0.001), (0.02, 0.02), (0.1, 0.05), (0.1, 0.05)]


def test_an_idle_process_sends_an_event_at_once_not_after_its_interval(
    streams: Streams,
) -> None:
    """One run in flight: its event is in the stream long before the (here
    minute-long) interval a busy process gathers a batch for."""
    prefix, client = streams

    async def exists() -> int:
        return int(client.exists(stream_key(prefix, "r0")))

    async def publish() -> float:
        publisher = EventPublisher(REDIS_URL, prefix=prefix, maxlen=1000, retention=600,
                                   interval=60, step_end_delay=60, load=lambda: 1)
        try:
            started = time.monotonic()
            publisher.publish("r0", 1, "tool_call", "{}", replayed=False)
            await wait_until_async(exists, "the event in the stream before the interval", 10,
                                   every=0.001)
            return time.monotonic() - started
        finally:
            await publisher.aclose()

    asyncio.run(publish())


def test_the_end_of_the_last_run_in_flight_is_sent_at_once(streams: Streams) -> None:
    """A request's end on a process with no other run in flight waits for no
    batch (none could join it), while the caller holds the request's result
    until it is in the stream: here a batch would gather for 5 s a run."""
    prefix, client = streams

    async def exists() -> int:
        return int(client.exists(stream_key(prefix, "r0")))

    async def end() -> None:
        publisher = EventPublisher(REDIS_URL, prefix=prefix, maxlen=1000, retention=600,
                                   interval=60, step_end_delay=60, per_run=5.0,
                                   load=lambda: 0)
        try:
            publisher.end("r0", 1, "succeeded", None)
            await wait_until_async(exists, "the end in the stream before a batch's wait", 2,
                                   every=0.001)
            await publisher.sent(60)
        finally:
            await publisher.aclose()

    asyncio.run(end())
