"""Live events of a run: a bounded Redis stream per request.

Workers append every event of a run (model chunks, tool calls and results,
completion, errors) to ``lfw:events:<request_id>``, each marked with the
attempt that produced it and whether it came from a replayed step, and
close the stream with an ``end`` event when the request reaches a terminal
status. A reader attached at any time sees the run from its start, in
order, and stops at the end: :func:`iter_events` (sync) and
:func:`aiter_events` (async), for a web server to forward to its clients.

Events are a view, not the record: the journal and the ledger are. A Redis
outage drops events (counted and logged) and never fails a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aredis

from .settings import Settings

log = logging.getLogger(__name__)

END = "end"
# Kinds that describe the attempt itself, never a replayed step.
_ATTEMPT_KINDS = {"started", "completed", "error", END}
# Kinds that close a step: sent step_end_delay after them, not with the next batch.
_STEP_ENDS = {"tool_result", "completed", "error", END}


# The fields of a stream entry, in the order _APPEND takes them.
_FIELDS = ("attempt", "replayed", "kind", "data", "at")
# For each stream (KEYS[k]): how many events it gets, then theirs, 5 arguments
# apiece (after every stream's bound and lifetime); XADD each event, then renew
# the stream's lifetime. One call appends a whole batch, whatever streams it spans.
_APPEND = """
local a = 3
for k = 1, #KEYS do
    local n = tonumber(ARGV[a])
    a = a + 1
    for _ = 1, n do
        redis.call('XADD', KEYS[k], 'MAXLEN', '~', ARGV[1], '*',
                   'attempt', ARGV[a], 'replayed', ARGV[a + 1], 'kind', ARGV[a + 2],
                   'data', ARGV[a + 3], 'at', ARGV[a + 4])
        a = a + 5
    end
    redis.call('EXPIRE', KEYS[k], ARGV[2])
end
"""


def stream_key(prefix: str, request_id: str) -> str:
    return f"{prefix}lfw:events:{request_id}"


def events_url(settings: Settings) -> str | None:
    """Where events go: ``EVENTS_URL``, else the result backend or broker if Redis
    (``None``: events are off)."""
    if not settings.events:
        return None
    for url in (settings.events_url, settings.result_backend, settings.broker_url):
        if url is not None and url.get_secret_value().startswith(("redis://", "rediss://")):
            return url.get_secret_value()
    return None


@dataclass(frozen=True)
class RunEvent:
    """One event of a run, as read back from its stream."""

    id: str
    request_id: str
    attempt: int
    replayed: bool
    kind: str
    data: dict[str, Any]
    at: float

    @property
    def is_end(self) -> bool:
        return self.kind == END


def _parse(request_id: str, entry_id: bytes | str, fields: dict[Any, Any]) -> RunEvent:
    def text(key: str) -> str:
        value = fields.get(key.encode(), fields.get(key, b""))
        return value.decode() if isinstance(value, bytes) else str(value)

    return RunEvent(
        id=entry_id.decode() if isinstance(entry_id, bytes) else entry_id,
        request_id=request_id,
        attempt=int(text("attempt") or 0),
        replayed=text("replayed") == "1",
        kind=text("kind"),
        data=json.loads(text("data") or "{}"),
        at=float(text("at") or 0),
    )


def describe_event(kind: str, data: dict[str, Any]) -> str:
    """A one-line account of an event of a run (what `loomflow-worker tail` and the
    console print); a prompt is cut to 80 characters."""
    payload = data.get("payload") if isinstance(data.get("payload"), dict) else {}
    assert isinstance(payload, dict)
    if kind == "end":
        status = str(data.get("status"))
        return status + (f": {data['error']}" if data.get("error") else "")
    if kind == "started":
        return "prompt " + repr(_cut(str(payload.get("prompt", "")), 80))
    if kind == "model_chunk":
        chunk = payload.get("chunk") or {}
        part = chunk.get("kind")
        if part in ("text", "thinking"):
            return f"{part} {chunk.get('text')!r}"
        if part == "tool_call":
            call = chunk.get("tool_call") or {}
            return f"calls {call.get('tool')}({json.dumps(call.get('args'), sort_keys=True)})"
        if part == "finish":
            usage = chunk.get("usage") or {}
            return (f"finish {chunk.get('finish_reason')} (tokens in "
                    f"{usage.get('input_tokens', '?')}, out {usage.get('output_tokens', '?')})")
    if kind == "tool_call":
        call = payload.get("call") or {}
        return f"{call.get('tool')}({json.dumps(call.get('args'), sort_keys=True)})"
    if kind == "tool_result":
        result = payload.get("result") or {}
        if result.get("ok"):
            return f"ok: {result.get('output')}"
        return f"error: {result.get('error') or result.get('reason')}"
    if kind == "completed":
        result = payload.get("result")
        output = result.get("output") if isinstance(result, dict) else result
        return f"output {output!r}"
    if kind == "error":
        return f"{payload.get('type')}: {payload.get('message')}"
    return json.dumps(payload, sort_keys=True, default=str)


def _cut(text: str, width: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


class EventPublisher:
    """Appends a worker's run events to Redis, batched, never failing a run.

    Events are buffered and sent together, one call to Redis for a batch
    (and at :meth:`flush`), so a busy process costs a few round trips a
    second, not one per event. How long a batch gathers grows with the load:
    ``per_run`` seconds for each run the process carries (``load()``), at
    most ``interval`` (an event that closes a step: at most
    ``step_end_delay``). A process carrying one run sends its events about a
    millisecond after them, and the end of its last one at once; one
    carrying a hundred or more gathers them for ``interval``. A worker that
    dies later than that has lost none of a step's events; one that dies
    sooner loses them, and the next attempt sends them again, marked
    replayed."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str,
        maxlen: int,
        retention: float,
        interval: float = 0.1,
        step_end_delay: float = 0.05,
        per_run: float = 0.001,
        load: Callable[[], int] = lambda: 1,
    ) -> None:
        self._client: aredis.Redis = aredis.Redis.from_url(url, socket_timeout=5)
        self._append = self._client.register_script(_APPEND)
        self._prefix = prefix
        self._maxlen = maxlen
        self._retention = max(1, int(retention))
        self._interval = interval
        self._step_end_delay = step_end_delay
        self._per_run = per_run
        self._load = load
        # Events to send, by request: the arguments of _APPEND, five per event.
        self._buffer: dict[str, list[str]] = {}
        self._sending = asyncio.Lock()
        # The next flush: when it is due, and its timer.
        self._due = math.inf
        self._timer: asyncio.TimerHandle | None = None
        self._flushes: set[asyncio.Task[None]] = set()
        # Resolved once the events buffered now are sent (or dropped), and
        # once the batch being sent is: what sent() waits for.
        self._buffered_done: asyncio.Future[None] | None = None
        self._sending_done: asyncio.Future[None] | None = None
        self.dropped = 0

    def publish(
        self, request_id: str, attempt: int, kind: str, data: str, *, replayed: bool
    ) -> None:
        """Queue one event; ``data`` is its payload as JSON text."""
        flag = "1" if replayed and kind not in _ATTEMPT_KINDS else "0"
        entry = (str(attempt), flag, kind, data, f"{time.time():.6f}")  # as _FIELDS
        events = self._buffer.get(request_id)
        if events is None:
            self._buffer[request_id] = list(entry)
        else:
            events += entry
        # A step is done: send soon, so a crash after it loses nothing of it.
        self._schedule(self.delay(kind in _STEP_ENDS))

    def delay(self, step_end: bool = False) -> float:
        """How long an event published now waits for others to join its
        batch: ``per_run`` per run in flight, within ``interval`` (a step's
        end: ``step_end_delay``). No wait once no run is in flight (a request's
        end, its run over, on an otherwise idle process): nothing would
        join it, and its caller waits for it before its result is stored."""
        ceiling = self._step_end_delay if step_end else self._interval
        return min(ceiling, self._per_run * self._load())

    def end(self, request_id: str, attempt: int, status: str, error: str | None) -> None:
        data = json.dumps({"status": status, "error": error}, separators=(",", ":"))
        self.publish(request_id, attempt, END, data, replayed=False)

    def _schedule(self, delay: float) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + delay
        if due >= self._due:
            return
        self._cancel_timer()
        self._due = due
        self._timer = loop.call_at(due, self._flush_due)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._due = None, math.inf

    def _flush_due(self) -> None:
        self._timer, self._due = None, math.inf
        task = asyncio.get_running_loop().create_task(self.flush())
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def sent(self, within: float) -> None:
        """Return once every event published so far is sent (or dropped),
        sending them within ``within`` seconds (sooner when the process is
        not busy, see :meth:`delay`): the requests that end meanwhile go in
        the same call to Redis, rather than one call each."""
        within = min(within, self.delay(step_end=True))
        if self._buffer:
            if self._buffered_done is None:
                self._buffered_done = asyncio.get_running_loop().create_future()
            done = self._buffered_done
            self._schedule(within)
        elif self._sending_done is not None:
            done = self._sending_done
        else:
            return
        await asyncio.shield(done)

    async def flush(self) -> None:
        """Send every event published so far (or drop them, counted, if Redis fails)."""
        async with self._sending:
            batch, self._buffer = self._buffer, {}
            done, self._buffered_done = self._buffered_done, None
            if not batch:
                _resolve(done)
                return
            self._cancel_timer()  # this sends what it was set for
            # What a sent() called while this batch is on its way waits for.
            done = done or asyncio.get_running_loop().create_future()
            self._sending_done = done
            try:
                await self._send(batch)
            except (redis.RedisError, OSError) as exc:
                dropped = sum(len(events) for events in batch.values()) // len(_FIELDS)
                self.dropped += dropped
                log.warning("events: dropped %d events (%s)", dropped, exc,
                            extra={"action": "events_dropped"})
            finally:
                self._sending_done = None
                _resolve(done)

    async def _send(self, batch: dict[str, list[str]]) -> None:
        args = [str(self._maxlen), str(self._retention)]
        for events in batch.values():
            args.append(str(len(events) // len(_FIELDS)))
            args += events
        keys = [stream_key(self._prefix, request_id) for request_id in batch]
        await self._append(keys=keys, args=args)

    async def aclose(self) -> None:
        self._cancel_timer()
        for task in list(self._flushes):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(Exception):
            await self.flush()
        await self._client.aclose()


def _resolve(done: asyncio.Future[None] | None) -> None:
    if done is not None and not done.done():
        done.set_result(None)


def _reader_args(settings: Settings | None, url: str | None) -> tuple[str, str]:
    if settings is None:
        settings = Settings()  # the environment's LOOMFLOW_WORKER_* settings
    found = url or events_url(settings)
    if found is None:
        raise RuntimeError(
            "no Redis to read events from: set LOOMFLOW_WORKER_EVENTS_URL (or use Redis as "
            "the result backend or broker)"
        )
    return found, settings.redis_key_prefix


class _Follow:
    """Where a reader is in a stream, and when it is done (shared by sync and async)."""

    def __init__(
        self, request_id: str, follow: bool, idle_timeout: float | None, after: str
    ) -> None:
        self.request_id = request_id
        self.follow = follow
        self.idle_timeout = idle_timeout
        self.last = after
        self.idle_since = time.monotonic()
        self.done = False

    @property
    def block(self) -> int | None:
        return 1000 if self.follow else None

    def take(self, reply: Any) -> list[RunEvent]:
        """The events of one XREAD reply; sets ``done`` at the end or when idle."""
        if not reply:
            idle = time.monotonic() - self.idle_since
            self.done = not self.follow or (
                self.idle_timeout is not None and idle > self.idle_timeout
            )
            return []
        self.idle_since = time.monotonic()
        events = []
        for entry_id, fields in reply[0][1]:
            event = _parse(self.request_id, entry_id, fields)
            self.last = event.id
            events.append(event)
            if event.is_end:
                self.done = True
                break
        return events


def iter_events(
    request_id: str,
    *,
    settings: Settings | None = None,
    url: str | None = None,
    follow: bool = True,
    idle_timeout: float | None = None,
    after: str = "0-0",
) -> Iterator[RunEvent]:
    """The events of a request from its start (or those after the event whose id
    is ``after``); with ``follow``, new ones as they come, until its ``end`` event
    (or ``idle_timeout`` seconds without one)."""
    found, prefix = _reader_args(settings, url)
    key = stream_key(prefix, request_id)
    cursor = _Follow(request_id, follow, idle_timeout, after)
    client = redis.Redis.from_url(found)
    try:
        while not cursor.done:
            yield from cursor.take(client.xread({key: cursor.last}, count=500, block=cursor.block))
    finally:
        client.close()


async def aiter_events(
    request_id: str,
    *,
    settings: Settings | None = None,
    url: str | None = None,
    follow: bool = True,
    idle_timeout: float | None = None,
    after: str = "0-0",
) -> AsyncIterator[RunEvent]:
    """:func:`iter_events` for an event loop."""
    found, prefix = _reader_args(settings, url)
    key = stream_key(prefix, request_id)
    cursor = _Follow(request_id, follow, idle_timeout, after)
    client: aredis.Redis = aredis.Redis.from_url(found)
    try:
        while not cursor.done:
            reply = await client.xread({key: cursor.last}, count=500, block=cursor.block)
            for event in cursor.take(reply):
                yield event
    finally:
        await client.aclose()
