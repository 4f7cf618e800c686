"""Model calls paced for the whole fleet, and patient with their provider.

A fleet of hundreds of runs per process exceeds a provider key's requests
and tokens per minute within seconds. Every agent a worker builds calls its
model through :class:`PacedModel`:

- before each call it books the call's place in its model key's schedule
  (``model_budgets``, one row per key, shared by every process: see
  ``pacing.sql``) and waits for it, when the key has limits
  (``LOOMFLOW_WORKER_MODEL_LIMITS``, ``loomflow-worker limits``);
- a provider's rate limit (HTTP 429) or overload (529) pauses the call for
  as long as the provider asks (``retry-after``, else a jittered backoff),
  pauses the key for the whole fleet, and calls again. It never raises, so
  it never counts toward ``MAX_RETRIES``, never fails the run and never
  replays its journal: the model-call step simply takes longer.

Postgres holds the schedule rather than Redis: every worker already has it,
a booking is one short statement per model call (a model call takes seconds),
and limits changed at run time live beside the ledger that reports them.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import anyio
import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from .. import metrics
from ..runtime.sql import query
from ..settings import ModelLimit, Settings
from .cached import AsyncCachedRead
from .request_errors import Paused

log = logging.getLogger(__name__)

#: How often a process reads which keys have limits or a pause.
REFRESH = 2.0
#: The longest one wait for a provider lasts before the call is tried again.
MAX_PROVIDER_WAIT = 600.0
#: Backoff for a 429 or 529 that says nothing of when to come back.
BACKOFF_BASE = 1.0
BACKOFF_MAX = 60.0
#: HTTP statuses by which a provider says "later": rate limited, overloaded.
LATER = (429, 529)
#: Errors by which the database is out of reach (not a mistake in a statement).
UNREACHABLE = (psycopg.OperationalError, PoolTimeout)


def provider_wait(exc: BaseException, attempt: int) -> float | None:
    """How long to wait before calling again when a model call raised ``exc``
    (the ``attempt``-th time in a row): the provider's ``retry-after`` for a
    rate limit (429) or an overload (529), else a jittered exponential
    backoff; ``None`` for any other error, which fails the step as before."""
    # loomflow is imported where a run needs it: `loomflow-worker limits`
    # reads and writes the limits without loading the agent framework.
    from loomflow.core.errors import RateLimitError, TransientModelError
    from loomflow.governance.retry import classify_model_error

    classified = classify_model_error(exc)
    if not isinstance(classified, TransientModelError):
        return None
    if not isinstance(classified, RateLimitError) and _status(classified) not in LATER:
        return None
    if classified.retry_after is not None:
        return min(max(classified.retry_after, 0.0), MAX_PROVIDER_WAIT)
    ceiling = min(BACKOFF_MAX, BACKOFF_BASE * 2 ** (attempt - 1))
    return random.uniform(ceiling / 2, ceiling)


def _status(error: BaseException) -> int | None:
    """The HTTP status behind a classified model error (its cause's, or the
    cause's response's), also from an error event inside a stream."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        status = getattr(current, "status_code", None)
        if isinstance(status, int):
            return status
        body = getattr(current, "body", None)
        if isinstance(body, dict):
            kind = (body.get("error") or {}).get("type") if isinstance(
                body.get("error"), dict) else body.get("type")
            if kind == "overloaded_error":
                return 529
            if kind == "rate_limit_error":
                return 429
        current = getattr(current, "cause", None) or current.__cause__
    return None


def estimate_tokens(messages: Any) -> int:
    """A model call's input tokens before it is sent (four characters a
    token), booked against a token budget and corrected once the provider
    reports its usage."""
    chars = 0
    for message in messages or ():
        chars += len(getattr(message, "content", "") or "")
        for call in getattr(message, "tool_calls", ()) or ():
            chars += len(str(getattr(call, "arguments", "")))
    return max(1, chars // 4)


@dataclass
class RunPacing:
    """What the paced model knows of the run it serves (a context variable
    the worker sets around the run): its request, for the logs; how long a
    call may wait in the run's slot (``None``: always, outside a worker); and
    the places an earlier attempt booked, by key (monotonic times)."""

    request_id: str
    park_after: float | None = None
    booked: dict[str, float] = field(default_factory=dict)


_run: ContextVar[RunPacing | None] = ContextVar("loomflow_worker_run_pacing", default=None)


@contextmanager
def pacing_run(pacing: RunPacing) -> Iterator[None]:
    """Model calls made inside are ``pacing``'s run's."""
    token = _run.set(pacing)
    try:
        yield
    finally:
        _run.reset(token)


@dataclass(frozen=True)
class KeyState:
    """A model key as the process last read it."""

    rpm: int | None
    tpm: int | None
    # Until when (monotonic) its provider asked the fleet to pause.
    paused_until: float


class Budgets:
    """The fleet's model-call budgets as one process uses them."""

    def __init__(self, pool: AsyncConnectionPool[Any], clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.pool = pool
        self._clock = clock
        # Which keys have limits or a pause: read every REFRESH seconds.
        self._keys: AsyncCachedRead[dict[str, KeyState]] = AsyncCachedRead({}, REFRESH, clock)
        self._unreachable = False

    async def take(self, key: str, tokens: int) -> float:
        """Book one call of ``key`` estimated at ``tokens`` tokens; how many
        seconds it must wait for its place (0 for a key with no limit and no
        pause: no statement at all). Postgres out of reach books nothing: the
        provider's own limits still pause the call."""
        try:
            keys = await self._keys.get(self._read_keys)
            state = keys.get(key)
            if state is None or (state.rpm is None and state.tpm is None
                                 and state.paused_until <= self._clock()):
                return 0.0
            async with self.pool.connection() as conn:
                cur = await conn.execute(query("take_model_call"), {"key": key, "tokens": tokens})
                row = await cur.fetchone()
        except UNREACHABLE as exc:
            self._out_of_reach(exc)
            return 0.0
        self._unreachable = False
        return float(row[0]) if row is not None else 0.0

    async def charge(self, key: str, tokens: int) -> None:
        """``tokens`` more (fewer, when negative) than the call of ``key`` booked."""
        state = self._keys.value.get(key)
        if tokens == 0 or state is None or state.tpm is None:
            return
        try:
            async with self.pool.connection() as conn:
                await conn.execute(query("charge_model_tokens"), {"key": key, "tokens": tokens})
        except UNREACHABLE as exc:
            self._out_of_reach(exc)

    async def pause(self, key: str, seconds: float) -> None:
        """The provider asked ``key``'s calls to wait ``seconds``: every process's."""
        keys = self._keys.value
        state = keys.get(key, KeyState(None, None, 0.0))
        until = max(state.paused_until, self._clock() + seconds)
        keys[key] = KeyState(state.rpm, state.tpm, until)
        try:
            async with self.pool.connection() as conn:
                await conn.execute(query("pause_model_key"), {"key": key, "seconds": seconds})
        except UNREACHABLE as exc:
            self._out_of_reach(exc)

    async def _read_keys(self) -> dict[str, KeyState]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(query("model_budgets"))
            rows = await cur.fetchall()
        now = self._clock()
        return {key: KeyState(rpm, tpm, now + paused_for)
                for key, rpm, tpm, _, paused_for, _ in rows}

    def _out_of_reach(self, exc: Exception) -> None:
        if not self._unreachable:
            log.warning("model-call budgets out of reach (%s): calls go unbooked until the "
                        "database answers again", exc, extra={"action": "budgets_unreachable"})
        self._unreachable = True


class PacedModel:
    """An agent's model whose calls take their place in their key's budget
    and wait out a provider's rate limit or overload instead of failing.
    Every other attribute is the wrapped model's."""

    def __init__(self, inner: Any, key: str, budgets: Budgets) -> None:
        self._inner = inner
        self.key = key
        self._budgets = budgets

    @property
    def name(self) -> str:
        return str(getattr(self._inner, "name", "model"))

    @property
    def usage_key(self) -> str:
        """The key its calls' tokens and cost are counted under (see execution.usage)."""
        return self.key

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)

    async def complete(self, messages: Any, **kwargs: Any) -> Any:
        booked = estimate_tokens(messages)
        attempt = 0
        while True:
            await self._wait_for_place(booked)
            try:
                result = await self._inner.complete(messages, **kwargs)
            except Exception as exc:
                attempt += 1
                await self._later(exc, attempt)
                continue
            usage = result[2] if isinstance(result, tuple) and len(result) > 2 else None
            await self._charge(usage, booked)
            return result

    async def stream(self, messages: Any, **kwargs: Any) -> AsyncIterator[Any]:
        booked = estimate_tokens(messages)
        attempt = 0
        while True:
            await self._wait_for_place(booked)
            chunks = self._inner.stream(messages, **kwargs)
            try:
                first = await chunks.__anext__()
            except StopAsyncIteration:
                return
            except Exception as exc:
                # Nothing was passed on yet: the call can be made again.
                attempt += 1
                await self._later(exc, attempt)
                continue
            break
        usage = first.usage
        yield first
        async for chunk in chunks:
            usage = chunk.usage or usage
            yield chunk
        await self._charge(usage, booked)

    async def _wait_for_place(self, tokens: int) -> None:
        run = _run.get()
        booked = run.booked.pop(self.key, None) if run is not None else None
        if booked is not None:
            # The place an earlier attempt of the run booked: no second booking.
            wait = max(0.0, booked - time.monotonic())
        else:
            wait = await self._budgets.take(self.key, tokens)
        if wait <= 0:
            return
        _count_wait(self.key, "budget", wait)
        self._park_if_long(run, wait, f"model key {self.key!r} (its budget)", booked=True)
        await anyio.sleep(wait)

    async def _later(self, exc: Exception, attempt: int) -> None:
        wait = provider_wait(exc, attempt)
        if wait is None:
            raise exc
        run = _run.get()
        log.warning(
            "request %s: model key %r was rate limited or overloaded by its provider (%s); "
            "the call waits %.1fs and is made again (the run goes on, no retry counted)",
            run.request_id if run is not None else "(none)", self.key, type(exc).__name__,
            wait, extra={"action": "model_wait", "model_key": self.key, "wait": round(wait, 3),
                         "request": run.request_id if run is not None else None},
        )
        _count_wait(self.key, "provider", wait)
        await self._budgets.pause(self.key, wait)
        self._park_if_long(run, wait, f"model key {self.key!r} (its provider)", booked=False)
        await anyio.sleep(wait)

    def _park_if_long(self, run: RunPacing | None, wait: float, what: str, *, booked: bool
                      ) -> None:
        if run is not None and run.park_after is not None and 0 < run.park_after < wait:
            raise Paused(self.key, wait, f"waiting for {what}", booked)

    async def _charge(self, usage: Any, booked: int) -> None:
        if usage is None:
            return
        used = (getattr(usage, "input_tokens", 0) + getattr(usage, "cached_input_tokens", 0)
                + getattr(usage, "output_tokens", 0))
        await self._budgets.charge(self.key, used - booked)


def _count_wait(key: str, reason: str, seconds: float) -> None:
    meter = metrics.get()
    if meter is not None:
        meter.model_waits.labels(key, reason).inc()
        meter.model_wait_seconds.labels(key, reason).inc(seconds)


def pace(agent: Any, key: str | None, budgets: Budgets) -> None:
    """Make ``agent``'s model calls go through :class:`PacedModel`, under
    ``key`` (by default its model's name). loomflow's agent calls the model it
    keeps as ``_wrapped_model`` (its retry policy's view of ``_model``): the
    paced model goes between the two. An agent without them is left as it is."""
    from loomflow.model.retrying import RetryingModel

    wrapped, model = getattr(agent, "_wrapped_model", None), getattr(agent, "_model", None)
    if wrapped is None or model is None or isinstance(wrapped, PacedModel):
        return
    chosen = key or str(getattr(model, "name", None) or "model")[:64]
    if isinstance(wrapped, RetryingModel) and wrapped.inner is model:
        # Inside loomflow's retries: a 429 or 529 never reaches them (the paced
        # model waits it out and pauses the key fleet-wide), other transient
        # errors still do, and each call it sends is booked.
        agent._wrapped_model = RetryingModel(PacedModel(model, chosen, budgets), wrapped.policy)
    else:
        agent._wrapped_model = PacedModel(wrapped, chosen, budgets)


async def set_model_limits(pool: AsyncConnectionPool[Any], settings: Settings) -> None:
    """Write the model limits ``settings`` give (``MODEL_LIMITS``) to the
    fleet's budgets, as a worker starts: a deploy's limits replace those set
    at run time (``loomflow-worker limits``)."""
    if not settings.model_limits:
        return
    async with pool.connection() as conn:
        for key, limit in sorted(settings.model_limits.items()):
            await conn.execute(query("set_model_limits"), _limit_params(key, limit))


@dataclass(frozen=True)
class KeyLimits:
    """A model key's limits and pause, as ``loomflow-worker limits`` lists them."""

    key: str
    rpm: int | None
    tpm: int | None
    burst: float
    paused_for: float
    updated_at: Any


def read_limits(conn: psycopg.Connection[Any]) -> list[KeyLimits]:
    """Every model key the fleet books calls of, or was asked to pause."""
    rows = conn.execute(query("model_budgets")).fetchall()
    return [KeyLimits(*row) for row in rows]


def write_limits(conn: psycopg.Connection[Any], key: str, limit: ModelLimit | None) -> None:
    """Set ``key``'s limits for the whole fleet at once (``None``: none);
    every process reads them within :data:`REFRESH` seconds."""
    conn.execute(query("set_model_limits"), _limit_params(key, limit))


def _limit_params(key: str, limit: ModelLimit | None) -> dict[str, Any]:
    limit = limit or ModelLimit.model_construct(rpm=None, tpm=None, burst=60.0)
    return {"key": key, "rpm": limit.rpm, "tpm": limit.tpm, "burst": limit.burst}
