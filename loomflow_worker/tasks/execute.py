"""One attempt of a request on a worker: take the scope, consult the ledger, run, finish.

Written once, async, on the pool child's loop; the Celery task around it
only turns the outcome into an ack, a retry or a stored result, and
publishes the handoff."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import anyio.to_thread
from loomflow.core.types import Event
from loomflow.memory.inmemory import InMemoryMemory
from loomflow.runtime.journaled import resuming_last_run

from .. import metrics
from ..events import EventPublisher, events_url
from ..runtime import (
    InvalidInput,
    LockLost,
    PostgresRuntime,
    RunStopped,
    SessionBusy,
    run_options,
)
from ..runtime.errors import LoomflowWorkerError
from ..runtime.lockconn import LockConnection
from ..runtime.store import Attempt, Conn
from ..settings import Settings
from . import ledger
from .registry import agent_factory, agent_time_limit
from .request import Kind, RunRequest, check_request

log = logging.getLogger("loomflow_worker.tasks")

#: How long a request at the head of its session waits for its lock (the
#: request before it releasing it, or a crashed holder's being freed)
#: before it parks.
HANDOFF_LOCK_WAIT = 2.0


class RunFailed(LoomflowWorkerError):
    """The request ended ``failed``; the message says why."""


class RunDead(LoomflowWorkerError):
    """The request ended ``dead``: its worker died too many times running it."""


class RunCancelled(LoomflowWorkerError):
    """The request was cancelled."""


@dataclass
class Outcome:
    kind: Literal["succeeded", "failed", "dead", "cancelled", "parked", "retry"]
    result: dict[str, Any] | None = None
    error: str | None = None
    countdown: float = 0.0
    dispatch: list[ledger.Pending] = field(default_factory=list)
    # The request ended and handed its scope on (whether or not it publishes
    # the request it handed the scope to).
    handed: bool = False


async def _noop_emit(event: Event) -> None:
    return None


def _emitter(ctx: WorkerContext, request_id: str, attempt_no: int, attempt: Attempt) -> Any:
    """The run's ``emit``: every event to the request's live stream."""
    events = ctx.events
    if events is None:
        return _noop_emit

    async def emit(event: Event) -> None:
        events.publish(
            request_id, attempt_no, str(event.kind),
            event.model_dump_json(fallback=repr), replayed=attempt.last_replayed,
        )

    return emit


class WorkerContext:
    """What one pool child owns: its runtime and the agents built with it."""

    def __init__(self, settings: Settings, slots: int = 1) -> None:
        """``slots``: how many runs this process carries at once."""
        self.settings = settings
        self.slots = slots
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self._runtime: PostgresRuntime | None = None
        self.events: EventPublisher | None = None
        self._agents: dict[str, Any] = {}
        self._connect_lock = anyio.Lock()
        self._beating: asyncio.Task[None] | None = None

    async def runtime(self) -> PostgresRuntime:
        async with self._connect_lock:
            if self._runtime is None:
                runtime = await PostgresRuntime.connect(
                    self.settings.database_url.get_secret_value(),
                    min_size=self.settings.pool_min_size,
                    max_size=self.settings.pool_max_size,
                    lock_wait_timeout=0,
                    lock_io_timeout=self.settings.lock_io_timeout,
                    lock_connections=min(self.settings.lock_connections, self.slots),
                    connect_timeout=self.settings.connect_timeout,
                )
                try:
                    await runtime.init_schema()
                except BaseException:
                    await runtime.aclose()
                    raise
                self._runtime = runtime
                # loomflow runs a synchronous tool in a worker thread, so it never
                # blocks the other runs; anyio's default of 40 such threads at once
                # would make the runs of a busy process queue for them.
                limiter = anyio.to_thread.current_default_thread_limiter()
                limiter.total_tokens = max(limiter.total_tokens, self.slots)
                self._beating = asyncio.get_running_loop().create_task(
                    self._heartbeats(runtime), name="loomflow-worker heartbeat"
                )
                meter = metrics.get()
                if meter is not None:
                    runtime.journal.on_write = meter.journal_write.observe
                url = events_url(self.settings)
                if url is not None:
                    self.events = EventPublisher(
                        url,
                        prefix=self.settings.redis_key_prefix,
                        maxlen=self.settings.events_maxlen,
                        retention=self.settings.events_retention,
                    )
            return self._runtime

    async def agent(self, name: str) -> Any:
        if name not in self._agents:
            agent = agent_factory(name)(await self.runtime())
            if type(getattr(agent, "_memory", None)) is InMemoryMemory:
                log.warning(
                    "agent %r keeps its memory in this process (loomflow's default): each "
                    "worker recalls a different history, and a request resumed on another "
                    "worker sends its model calls again. Give it a memory every worker "
                    "shares (loomflow's PostgresMemory or RedisMemory), or "
                    "loomflow_worker.NoMemory if it needs none.", name,
                    extra={"action": "memory_per_process", "agent": name},
                )
            self._agents[name] = agent
        return self._agents[name]

    async def _heartbeats(self, runtime: PostgresRuntime) -> None:
        """Stamp every running request of the process as alive: one statement
        per lock connection and interval. A frozen process stamps nothing,
        so its lease runs out and the sweeper fences it as a whole."""
        interval = self.settings.heartbeat_interval
        while True:
            await anyio.sleep(interval)
            async with anyio.create_task_group() as beats:
                for line in list(runtime.journal.lines):
                    running = [a for a in line.attempts if a.request_id is not None]
                    if running and line.fenced is None:
                        beats.start_soon(_beat, line, running, interval)

    async def aclose(self) -> None:
        beating, self._beating = self._beating, None
        if beating is not None:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating
        for agent in self._agents.values():
            closer = getattr(agent, "aclose", None)
            if closer is not None:
                await closer(timeout=5.0)
        self._agents.clear()
        if self.events is not None:
            await self.events.aclose()
            self.events = None
        if self._runtime is not None:
            await self._runtime.aclose()
            self._runtime = None

    def backoff(self, failures: int) -> float:
        """Full-jitter exponential backoff for the ``failures``-th retry."""
        cap = min(
            self.settings.retry_backoff_max, self.settings.retry_backoff * 2 ** (failures - 1)
        )
        return random.uniform(cap / 2, cap)


async def execute(
    ctx: WorkerContext,
    request_id: str,
    args: dict[str, Any],
    kind: Kind,
    node: str | None = None,
) -> Outcome:
    """One attempt of ``request_id``; ``node`` is the Celery node running it."""
    runtime = await ctx.runtime()
    try:
        req = check_request(ctx.settings, kind=kind, **args)
    except (InvalidInput, TypeError) as exc:
        async with runtime.pool.connection() as conn:
            await ledger.record_invalid(conn, request_id, {**args, "kind": kind}, exc)
        if ctx.events is not None:
            ctx.events.end(request_id, 0, "failed", str(exc))
            await ctx.events.flush()
        log.warning(
            "request %s refused: %s", request_id, exc,
            extra={"action": "refused", "request": request_id},
        )
        return Outcome("failed", error=str(exc))

    pre: ledger.Precheck | None = None

    async def precheck_and_lock(conn: Conn, key: int, may_lock: bool) -> bool | None:
        nonlocal pre
        pre = await ledger.precheck(
            conn, request_id, ctx.settings.redispatch_after, key, may_lock
        )
        return None if pre is None else pre.locked

    # A request at the head of its session waits a moment for a lock still
    # held: usually the request before it finished and is releasing it, and
    # published nothing for this one, whose message this is.
    try:
        attempt = await runtime.journal.acquire_if(req.scope, HANDOFF_LOCK_WAIT, precheck_and_lock)
        if attempt is None and pre is None:
            # Published by name, from a process with no database access.
            async with runtime.pool.connection() as conn:
                await ledger.ensure_row(conn, request_id, req)
            attempt = await runtime.journal.acquire_if(
                req.scope, HANDOFF_LOCK_WAIT, precheck_and_lock
            )
    except SessionBusy:
        return await _park_busy(runtime, request_id, req)
    if attempt is None:
        assert pre is not None
        if pre.status in ledger.TERMINAL:
            # A duplicate of a finished request: its stored outcome, nothing run.
            log.info("request %s already %s", request_id, pre.status,
                     extra={"action": "duplicate", "request": request_id})
            async with runtime.pool.connection() as conn:
                # It may have been cancelled while queued, never handing its
                # session on: pass it on.
                handoff = await ledger.hand_over(conn, req.scope)
            return _ended(pre.status, handoff, result=pre.result, error=pre.error)
        assert pre.older is not None
        async with runtime.pool.connection() as conn:
            if await ledger.park(conn, request_id):
                _count_parked("behind")
                log.info(
                    "request %s parked behind %s", request_id, pre.older.request_id,
                    extra={"action": "parked", "request": request_id, "session": req.session_id},
                )
                if pre.older_stale:
                    await ledger.mark_dispatched(conn, pre.older.request_id)
                    return Outcome("parked", dispatch=[pre.older])
                return Outcome("parked")
        # Handed the session since the look above: its turn, go on.
        try:
            attempt = await runtime.journal.acquire(req.scope, wait=HANDOFF_LOCK_WAIT)
        except SessionBusy:
            return await _park_busy(runtime, request_id, req)
    try:
        holder = f"{node or ctx.holder.rsplit(':', 1)[0]}:{os.getpid()}"
        outcome = await _run_holding(ctx, runtime, attempt, request_id, req, holder)
    finally:
        await runtime.journal.release(attempt)
    if outcome.kind in ledger.TERMINAL and not outcome.handed:
        async with runtime.pool.connection() as conn:
            # A request enqueued while this one finished may have parked on the
            # lock after the finish chose no one: look once more, unlocked.
            handoff = await ledger.hand_over(conn, req.scope)
        if handoff is not None:
            outcome.dispatch.extend(handoff.publish)
    if ctx.events is not None:
        await ctx.events.flush()
    return outcome


async def _park_busy(runtime: PostgresRuntime, request_id: str, req: RunRequest) -> Outcome:
    async with runtime.pool.connection() as conn:
        await ledger.park(conn, request_id)
    _count_parked("busy")
    log.info(
        "request %s parked: session busy", request_id,
        extra={"action": "parked", "request": request_id, "session": req.session_id},
    )
    return Outcome("parked")


def _ended(
    kind: str, handoff: ledger.Handoff | None, **fields: Any
) -> Outcome:
    """A request's end: what it handed its scope to is published when needed."""
    return Outcome(
        kind,  # type: ignore[arg-type]
        dispatch=handoff.publish if handoff is not None else [],
        handed=handoff is not None,
        **fields,
    )


async def _run_holding(
    ctx: WorkerContext,
    runtime: PostgresRuntime,
    attempt: Attempt,
    request_id: str,
    req: RunRequest,
    holder: str,
) -> Outcome:
    started = await attempt.io(
        lambda conn: ledger.start(
            conn, request_id, req.scope, holder, ctx.settings.redispatch_after
        )
    )
    log_fields = {"request": request_id, "session": req.session_id, "user": req.user_id}
    if started.status in ledger.TERMINAL:
        # A duplicate of a finished request: its stored outcome, nothing run.
        log.info("request %s already %s", request_id, started.status,
                 extra={"action": "duplicate", **log_fields})
        handoff = await attempt.io(lambda conn: ledger.hand_over(conn, req.scope))
        return _ended(started.status, handoff, result=started.result, error=started.error)
    if started.status == "parked":
        assert started.older is not None
        await attempt.io(lambda conn: ledger.park(conn, request_id))
        log.info("request %s parked behind %s", request_id, started.older.request_id,
                 extra={"action": "parked", **log_fields})
        return Outcome("parked", dispatch=[started.older] if started.older_stale else [])
    assert started.epoch is not None
    epoch = started.epoch

    async def finish_as(status: str, **outcome: Any) -> ledger.Handoff | None:
        return await _finish(
            attempt, request_id, req, started, epoch, events=ctx.events, status=status, **outcome
        )
    if started.crashes >= ctx.settings.max_crashes:
        error = (
            f"the worker died {started.crashes} times while running this request "
            f"(LOOMFLOW_WORKER_MAX_CRASHES={ctx.settings.max_crashes}); last attempt on "
            f"{holder}"
        )
        nxt = await finish_as("dead", error=error, error_type="WorkerDied")
        log.error("request %s dead: %s", request_id, error, extra={"action": "dead", **log_fields})
        return _ended("dead", nxt, error=error)

    if started.cancel_requested:
        nxt = await finish_as(
            "cancelled", error="cancelled before it started", error_type="Cancelled"
        )
        log.info("request %s cancelled before it started", request_id,
                 extra={"action": "cancelled", **log_fields})
        return _ended("cancelled", nxt, error="cancelled before it started")

    log.info("request %s attempt %d at epoch %d", request_id, started.attempt, epoch,
             extra={"action": "start", "attempt": started.attempt, **log_fields})
    meter = metrics.get()
    if meter is not None:
        how = "recovery" if started.since_heartbeat is not None else (
            "retry" if started.failures else "first")
        meter.attempts.labels(how).inc()
        if started.since_heartbeat is not None:
            meter.recovery.observe(started.since_heartbeat)
        if started.since_handoff is not None:
            meter.handoff.observe(started.since_handoff)
    executed, replayed = runtime.stats.steps_executed, runtime.stats.steps_replayed
    agent = await ctx.agent(req.agent)
    time_limit = agent_time_limit(req.agent) or ctx.settings.run_time_limit
    # The process's heartbeat stamps the request from now on; when the lock
    # connection is lost, the run stops at once, mid-step.
    fence = anyio.CancelScope()
    attempt.request_id = request_id
    attempt.on_fenced.append(lambda _: fence.cancel())
    timed_out = False
    try:
        try:
            with fence, run_options(attempt=attempt, epoch=epoch):
                with anyio.move_on_after(time_limit) as deadline:
                    emit = _emitter(ctx, request_id, started.attempt, attempt)
                    if req.kind == "resume":
                        with resuming_last_run():
                            result = await _run_agent(agent, request_id, req, emit)
                    else:
                        result = await _run_agent(agent, request_id, req, emit)
                timed_out = deadline.cancelled_caught
            if fence.cancelled_caught:
                raise attempt.fenced or LockLost(req.scope, "the heartbeat failed")
        finally:
            attempt.request_id = None
            if meter is not None:
                meter.steps.labels("executed").inc(runtime.stats.steps_executed - executed)
                meter.steps.labels("replayed").inc(runtime.stats.steps_replayed - replayed)
    except LockLost:
        raise
    except Exception as exc:  # the run raised: not a crash, so retry or fail
        if attempt.fenced is not None:
            raise attempt.fenced from exc
        failures = started.failures + 1
        if isinstance(exc, InvalidInput) or failures > ctx.settings.max_retries:
            error = f"{type(exc).__name__}: {exc}"
            nxt = await finish_as("failed", error=error, error_type=type(exc).__name__)
            log.error("request %s failed after %d attempts: %s", request_id, started.attempt,
                      error, extra={"action": "failed", **log_fields})
            return _ended("failed", nxt, error=error)
        countdown = ctx.backoff(failures)
        failure, attempt_no = exc, started.attempt
        await attempt.io(
            lambda conn: ledger.schedule_retry(conn, request_id, attempt_no, failure, countdown)
        )
        log.warning("request %s failed (%s); retry %d in %.1fs", request_id, exc, failures,
                    countdown, extra={"action": "retry", **log_fields})
        return Outcome("retry", error=f"{type(exc).__name__}: {exc}", countdown=countdown)
    except BaseException as exc:
        stopped = _stopped(exc)
        if stopped is None:
            if isinstance(exc, asyncio.CancelledError) and attempt.fenced is None:
                # Stopped from outside (a shutdown): this attempt was interrupted,
                # which the next one must not count as a crash. Recorded under
                # the lock, before the next attempt can start.
                attempt_no = started.attempt
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await attempt.io(
                        lambda conn: ledger.end_attempt(conn, request_id, attempt_no,
                                                        "interrupted")
                    )
                log.info("request %s interrupted", request_id,
                         extra={"action": "interrupted", **log_fields})
            raise
        nxt = await finish_as("cancelled", error=stopped.reason, error_type="Cancelled")
        log.info("request %s cancelled at a step boundary", request_id,
                 extra={"action": "cancelled", **log_fields})
        return _ended("cancelled", nxt, error=stopped.reason)

    if timed_out:
        if attempt.fenced is not None:
            raise attempt.fenced
        error = (
            f"TimeLimitExceeded: the run took longer than its {time_limit:g}s time limit "
            "(register_agent(time_limit=...) or LOOMFLOW_WORKER_RUN_TIME_LIMIT)"
        )
        nxt = await finish_as("failed", error=error, error_type="TimeLimitExceeded")
        log.error("request %s failed: %s", request_id, error,
                  extra={"action": "failed", **log_fields})
        return _ended("failed", nxt, error=error)

    payload = {**result.model_dump(mode="json"), "request_id": request_id}
    nxt = await finish_as("succeeded", result=payload)
    log.info("request %s succeeded", request_id, extra={"action": "succeeded", **log_fields})
    return _ended("succeeded", nxt, result=payload)


async def _run_agent(agent: Any, request_id: str, req: RunRequest, emit: Any) -> Any:
    return await agent.run(
        req.prompt,
        session_id=req.session_id,
        user_id=req.user_id,
        metadata={**req.metadata, "request_id": request_id},
        # Always pass emit: model calls then always journal to the same table.
        emit=emit,
    )


def _count_parked(reason: str) -> None:
    meter = metrics.get()
    if meter is not None:
        meter.parked.labels(reason).inc()


def _stopped(exc: BaseException) -> RunStopped | None:
    """The :class:`RunStopped` that ended a run, also from inside a task group."""
    if isinstance(exc, RunStopped):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _stopped(inner)
            if found is not None:
                return found
    return None


async def _beat(line: LockConnection, running: list[Attempt], interval: float) -> None:
    """One heartbeat of the requests running on ``line``. One that fails or
    gets no answer within two intervals means the locks are lost (or soon
    will be, when the server gives up on us): every run on the connection
    stops at once, mid-step, before the sweeper (which waits for a stale
    heartbeat) can start it elsewhere. A cancel request stops a run at its
    next step."""
    ids = [a.request_id for a in running if a.request_id is not None]
    try:
        with anyio.fail_after(2 * interval):
            cancelled = await line.run(lambda conn: ledger.heartbeat(conn, ids))
    except LockLost:
        return
    except TimeoutError:
        line.fence(f"no heartbeat answer within {2 * interval:g}s")
        return
    for attempt in running:
        if attempt.request_id in cancelled and attempt.stop is None:
            attempt.stop = RunStopped("cancelled while running")


async def _finish(
    attempt: Attempt,
    request_id: str,
    req: RunRequest,
    started: ledger.Started,
    epoch: int,
    *,
    status: str,
    result: Any = None,
    error: str | None = None,
    error_type: str | None = None,
    events: EventPublisher | None = None,
) -> ledger.Handoff | None:
    """Status, result, epoch advance and the choice of the next request: one
    statement. Then the request's live events end."""
    await attempt.flush_last_run()
    with anyio.CancelScope(shield=True):
        chosen = await attempt.io(
            lambda conn: ledger.finish(
                conn, request_id, req.scope, started.attempt, epoch,
                status=status, result=result, error=error, error_type=error_type,
            )
        )
    if events is not None:
        events.end(request_id, started.attempt, status, error)
    meter = metrics.get()
    if meter is not None:
        meter.requests.labels(status).inc()
    return chosen
