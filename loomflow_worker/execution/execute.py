"""One attempt of a request on a worker: take the scope, consult the ledger, run, finish.

Written once, async, on the pool child's loop; the Celery task around it
only turns the outcome into an ack, a retry or a stored result, and
publishes the handoff."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import anyio
from loomflow.core.types import Event
from loomflow.runtime.journaled import resuming_last_run
from psycopg.rows import DictRow

from .. import metrics, tracing
from ..runtime import (
    Diverged,
    InvalidInput,
    LockLost,
    PostgresRuntime,
    RunStopped,
    SessionBusy,
    run_options,
)
from ..runtime.lockconn import Batch
from ..runtime.runtime import signal_waits
from ..runtime.store import Lease, Liveness, OpenChoice
from ..settings import Settings
from . import budgets, ledger
from .attempt import Attempt, pooled
from .host import Host
from .limits import Bound
from .limits import take as take_limits
from .outcome import (
    Ending,
    Outcome,
    OutcomeKind,
    Retry,
    ended,
    ending_before_run,
    ending_of_error,
    time_limit_ending,
)
from .pacing import RunPacing, pacing_run
from .pending import Pending
from .registry import agent_time_limit
from .request import Kind, RunRequest, check_request, refuse_message
from .request_errors import AttemptLost, HandedBack, Paused

# Failures stored by earlier versions name this module as their error's: it
# still offers them (Celery's result backend looks them up here).
from .request_errors import RunCancelled as RunCancelled
from .request_errors import RunDead as RunDead
from .request_errors import RunFailed as RunFailed
from .runnables import run_request
from .statuses import TERMINAL, QuarantineLevel
from .usage import AttemptUsage
from .versions import queue_suffix

log = logging.getLogger(__name__)


#: How long a request at the head of its session waits for its lock (the
#: request before it releasing it, or the locks of a crashed worker being freed)
#: before it parks.
HANDOFF_LOCK_WAIT = 2.0

#: How often a start whose request's previous attempt may still be running
#: looks again (at most: half a heartbeat interval when that is shorter).
PREVIOUS_POLL = 0.25


#: What a request's message carried besides its arguments, as JSON, read
#: when the request parks (most requests never do).
MessageOptions = Callable[[], dict[str, Any] | None]


#: A request's last events are in its stream this long after it ends, at
#: most, and before its result is stored: the requests that end meanwhile
#: send theirs in the same call to Redis.
END_SENT_WITHIN = 0.01


async def _noop_emit(event: Event) -> None:
    return None


def _emitter(ctx: Host, request_id: str, attempt_no: int, lease: Lease) -> Any:
    """The run's ``emit``: every event to the request's live stream."""
    events = ctx.events
    if events is None:
        return _noop_emit

    async def emit(event: Event) -> None:
        events.publish(
            request_id, attempt_no, str(event.kind),
            event.model_dump_json(fallback=repr), replayed=lease.last_replayed,
        )

    return emit


async def execute(
    ctx: Host,
    request_id: str,
    args: dict[str, Any],
    kind: Kind,
    node: str | None = None,
    *,
    time_limit: float | None = None,
    options: MessageOptions | None = None,
    arrival: ledger.Arrival | None = None,
) -> Outcome:
    """One attempt of ``request_id``; ``node`` is the Celery node running it;
    ``time_limit`` (seconds), the caller's, when shorter than the agent's;
    ``options()``, what its message carried besides its arguments (JSON),
    read only when the request parks: the ledger keeps them, and the message
    published for it at its turn carries them; ``arrival``, the message's eta
    and routing, recorded when the ledger has no row for it."""
    runtime = await ctx.runtime()
    try:
        req = check_request(ctx.settings, kind=kind, **args)
    except (InvalidInput, TypeError) as exc:
        return await _refuse_invalid(ctx, runtime, request_id, args, kind, exc)
    asked = Attempt(pooled(runtime), request_id, req.scope)
    turn = await _take_turn(ctx, runtime, asked, req, options, arrival)
    if isinstance(turn, Outcome):
        return turn
    lease, pre = turn
    outcome: Outcome | None = None
    bounds: list[Bound] = []
    try:
        held = asked.holding(lease)
        key = pre.fairness_key if pre is not None else None
        if await _spent_budget(ctx, held, req, key, options) is not None:
            outcome = Outcome(OutcomeKind.PARKED)
        else:
            bounds = await _bounds(ctx, req, key)
            outcome = await _within_limits(ctx, runtime, lease, held, req, bounds, node,
                                           time_limit, options, pre)
    finally:
        # A request enqueued while this one finished may have parked on the
        # lock after the finish chose no one: look once more, unlocked (in the
        # unlock's round trip).
        look = outcome is not None and outcome.kind.ended and not outcome.handed
        followed = await runtime.journal.release(
            lease, then=ledger.hand_off_followup(req.scope) if look else None
        )
    if look:
        await _look_after_unlock(asked, followed, outcome)
    await _free_slots(runtime, lease, bounds, outcome)
    await _fair_turns(ctx, runtime, outcome)
    if ctx.events is not None:
        # Its events are in its stream before its result is stored.
        await ctx.events.sent(END_SENT_WITHIN)
    return outcome


async def _refuse_invalid(
    ctx: Host, runtime: PostgresRuntime, request_id: str, args: dict[str, Any],
    kind: Kind, exc: Exception,
) -> Outcome:
    """A request whose arguments are not valid fails unrun (recorded so); a
    message whose arguments are not its request's own is refused."""
    async with runtime.pool.connection() as conn:
        differ = await ledger.record_invalid(conn, request_id, {**args, "kind": kind}, exc)
    if differ:
        return _not_its_own(request_id, differ)
    if ctx.events is not None:
        ctx.events.end(request_id, 0, "failed", str(exc))
        await ctx.events.sent(END_SENT_WITHIN)
    log.warning(
        "request %s refused: %s", request_id, exc,
        extra={"action": "refused", "request": request_id},
    )
    return Outcome(OutcomeKind.FAILED, error=str(exc))


async def _take_turn(
    ctx: Host, runtime: PostgresRuntime, asked: Attempt, req: RunRequest,
    options: MessageOptions | None, arrival: ledger.Arrival | None,
) -> tuple[Lease, ledger.Precheck | None] | Outcome:
    """The scope's lock and the ledger's look at the request; or, without the
    lock, what the request does instead: refused, sent to quarantine, answered
    as a duplicate, or parked behind the request that holds its session."""
    try:
        lease, pre = await _lock_at_head(ctx, runtime, asked, req, arrival)
    except SessionBusy:
        return await _park_busy(asked, req, options)
    if pre is not None and pre.differ:
        return _not_its_own(asked.request_id, pre.differ)
    if lease is not None:
        return lease, pre
    assert pre is not None
    if pre.quarantine:
        return await _to_quarantine(asked, req, pre.quarantine)
    if pre.status in TERMINAL:
        return await _duplicate(asked, req, pre.status, result=pre.result, error=pre.error)
    assert pre.older is not None
    if await _park_behind(asked, req, pre.older, pre.older_stale, options):
        return Outcome(OutcomeKind.PARKED, dispatch=[pre.older] if pre.older_stale else [])
    # Handed the session since the look above: its turn, go on.
    try:
        return await runtime.journal.acquire(req.scope, wait=HANDOFF_LOCK_WAIT), pre
    except SessionBusy:
        return await _park_busy(asked, req, options)


async def _lock_at_head(
    ctx: Host, runtime: PostgresRuntime, asked: Attempt, req: RunRequest,
    arrival: ledger.Arrival | None,
) -> tuple[Lease | None, ledger.Precheck | None]:
    """The ledger's look at the request (``None``: no row) with the scope's
    lock tried in the same statement. A request at the head of its session
    waits a moment for a lock still held: usually the request before it
    finished and is releasing it, and published nothing for this one, whose
    message this is. A request published by name, from a process with no
    database access, gets its row first."""
    pre: ledger.Precheck | None = None

    def precheck_and_lock(key: int, may_lock: bool) -> Batch[bool | None]:
        def keep(found: ledger.Precheck | None) -> bool | None:
            nonlocal pre
            pre = found
            return None if found is None else found.locked

        return ledger.precheck(asked.request_id, req, ctx.settings.redispatch_after, key,
                               may_lock, quarantine=ctx.quarantine).then(keep)

    lease = await runtime.journal.acquire_if(req.scope, HANDOFF_LOCK_WAIT, precheck_and_lock)
    if lease is None and pre is None:
        await asked.ensure_row(req, arrival)
        lease = await runtime.journal.acquire_if(req.scope, HANDOFF_LOCK_WAIT, precheck_and_lock)
    return lease, pre


class _Said:
    """The requests this process said it hands to quarantine, and at which
    level (the last few thousand): a request that finds no room there comes
    back every few hundred milliseconds, and its reason is said once."""

    def __init__(self, keep: int = 4096) -> None:
        self._keep = keep
        self._said: collections.OrderedDict[str, QuarantineLevel] = collections.OrderedDict()
        self._guard = threading.Lock()

    def first(self, request_id: str, level: QuarantineLevel) -> bool:
        """Whether this is the first time ``request_id`` is said at ``level``."""
        with self._guard:
            if self._said.get(request_id) == level:
                self._said.move_to_end(request_id)
                return False
            self._said[request_id] = level
            self._said.move_to_end(request_id)
            if len(self._said) > self._keep:
                self._said.popitem(last=False)
            return True


_QUARANTINE_SAID = _Said()


async def _to_quarantine(asked: Attempt, req: RunRequest, level: QuarantineLevel
                         ) -> Outcome:
    """Handed to a process of quarantine, as a dispatch would: the sweeper
    leaves it to that process (for REDISPATCH_AFTER, should it die)."""
    await asked.mark_quarantined()
    if not _QUARANTINE_SAID.first(asked.request_id, level):
        # Handed on again: no room for it on the last worker that took it.
        log.debug("request %s handed on to run in quarantine (%s) again", asked.request_id,
                  level.name.lower(), extra={"action": "quarantine",
                                             **_log_fields(asked.request_id, req)})
        return Outcome(OutcomeKind.QUARANTINE, quarantine=level)
    log.warning(
        "request %s runs %s, without completing a step", asked.request_id,
        "alone: its attempts died in quarantine too, or lost their lock twice in a row"
        if level == QuarantineLevel.ALONE else "in quarantine among a few suspects: its attempts "
        "died with other runs of their process twice in a row",
        extra={"action": "quarantine", **_log_fields(asked.request_id, req)})
    return Outcome(OutcomeKind.QUARANTINE, quarantine=level)


async def _spent_budget(
    ctx: Host, attempt: Attempt, req: RunRequest, key: str | None,
    options: MessageOptions | None,
) -> budgets.Spent | None:
    """Park the request when a budget of its fairness key (``key``, as its
    enqueue recorded it) or its agent is spent for the period (one statement,
    only for a request that has budgets); the budget, or ``None``: it runs. It
    holds no worker slot and counts no retry while it waits; the sweeper's
    leader, or ``limits budget``, publishes it again once the budget has room."""
    if ctx.cost_budgets is None:
        return None
    names = await ctx.cost_budgets.applying(key or req.fairness_key, req.agent)
    if not names:
        return None
    spent = await attempt.park_if_spent(names, options() if options is not None else None)
    if spent is not None:
        _count_parked("budget")
        log.info("request %s waits for %s", attempt.request_id, spent.said,
                 extra={"action": "parked", "budget": spent.budget,
                        **_log_fields(attempt.request_id, req)})
    return spent


async def _bounds(ctx: Host, req: RunRequest, key: str | None) -> list[Bound]:
    """The concurrency limits the request counts toward (``key``: its fairness
    key, as its enqueue recorded it)."""
    if ctx.limits is None:
        return []
    return await ctx.limits.bounds(req, key)


async def _within_limits(
    ctx: Host, runtime: PostgresRuntime, lease: Lease, attempt: Attempt,
    req: RunRequest, bounds: list[Bound], node: str | None, time_limit: float | None,
    options: MessageOptions | None, pre: ledger.Precheck | None,
) -> Outcome:
    """The run, once each of its limits gave it a slot; parked on the first full one."""
    worker = ledger.worker_name(node or ctx.node, os.getpid())
    full = await take_limits(functools.partial(runtime.journal.take_slot, lease), bounds)
    if full is not None:
        return await _park_on_limit(attempt, req, full, options)
    return await _run_holding(ctx, runtime, lease, attempt, req, worker, time_limit, options,
                              pinned=pre.pinned if pre is not None else None)


async def _look_after_unlock(
    asked: Attempt, followed: list[DictRow] | None, outcome: Outcome
) -> None:
    """What the look after the unlock found (looked now, when it could not go
    with the unlock): the request it handed the scope to, to publish."""
    handoff = (ledger.hand_off_rows(followed) if followed is not None
               else await asked.hand_off())
    if handoff is not None:
        outcome.dispatch.extend(handoff.dispatch)


async def _free_slots(
    runtime: PostgresRuntime, lease: Lease, bounds: list[Bound], outcome: Outcome
) -> None:
    """Each limit slot the run held goes to the oldest request parked on its limit."""
    freed = [bound for bound in bounds if set(bound.slots) & set(lease.slots)]
    if freed:
        async with runtime.pool.connection() as conn:
            for bound in freed:
                outcome.dispatch.extend(await ledger.next_on_limit(conn, bound.reason, 1))


async def _fair_turns(ctx: Host, runtime: PostgresRuntime, outcome: Outcome) -> None:
    """Its message left the broker: room for a request withheld for its fair turn
    (the process's looks publish it, one at a time; without them, its caller)."""
    turns = ctx.fair_turns()
    if turns is not None:
        turns.poke()
    elif ctx.limits is not None and await ctx.limits.fair():
        async with runtime.pool.connection() as conn:
            outcome.dispatch.extend(await ledger.fair_next(conn))


async def _park_on_limit(
    attempt: Attempt, req: RunRequest, full: Bound, options: MessageOptions | None
) -> Outcome:
    """Park the request: its limit ``full`` has no free slot. It holds no
    worker slot and counts no retry while it waits; a run that frees a slot
    of that limit publishes it again (or the sweeper does)."""
    kept = options() if options is not None else None
    await attempt.park_on_limit(kept, full.reason, full.slots)
    _count_parked("limit")
    log.info("request %s parked: %s full", attempt.request_id, full.reason,
             extra={"action": "parked", "limit": full.instance,
                    **_log_fields(attempt.request_id, req)})
    return Outcome(OutcomeKind.PARKED)


def _not_its_own(request_id: str, differ: Sequence[str]) -> Outcome:
    """A message under ``request_id`` whose arguments (``differ``) are not
    those the ledger accepted for it: refused, unrun, its request untouched
    (its own message, or the sweeper, runs it)."""
    problem = (
        f"its {', '.join(differ)} {'differs' if len(differ) == 1 else 'differ'} from the "
        "request the runs ledger holds under that id"
    )
    refuse_message(request_id, problem, "mismatch")
    return Outcome(OutcomeKind.REFUSED, error=problem)


async def _duplicate(
    attempt: Attempt, req: RunRequest, status: str, *, result: Any, error: str | None
) -> Outcome:
    """A duplicate of a finished request: its stored outcome, nothing run. It
    may have been cancelled while queued, never handing its session on: that
    is done now."""
    log.info("request %s already %s", attempt.request_id, status,
             extra={"action": "duplicate", **_log_fields(attempt.request_id, req)})
    return ended(status, await attempt.hand_off(), result=result, error=error)


async def _park_behind(
    attempt: Attempt,
    req: RunRequest,
    older: Pending,
    older_stale: bool,
    options: MessageOptions | None,
) -> bool:
    """Park behind ``older`` (the request that hands the session on publishes
    this one again, with ``options``), marking ``older`` dispatched when its
    message looks lost. ``False``: the session was handed to this request
    meanwhile; go on."""
    kept = options() if options is not None else None
    if not await attempt.park(kept):
        return False
    _count_parked("behind")
    log.info("request %s parked behind %s", attempt.request_id, older.request_id,
             extra={"action": "parked", **_log_fields(attempt.request_id, req)})
    if older_stale:
        await attempt.mark_dispatched(older.request_id)
    return True


async def _park_busy(asked: Attempt, req: RunRequest, options: MessageOptions | None
                     ) -> Outcome:
    """Park the request: its session's lock stays held by a request that runs."""
    await asked.park(options() if options is not None else None)
    _count_parked("busy")
    log.info(
        "request %s parked: session busy", asked.request_id,
        extra={"action": "parked", "request": asked.request_id, "session": req.session_id},
    )
    return Outcome(OutcomeKind.PARKED)


async def _run_holding(
    ctx: Host,
    runtime: PostgresRuntime,
    lease: Lease,
    attempt: Attempt,
    req: RunRequest,
    worker: str,
    time_limit: float | None = None,
    options: MessageOptions | None = None,
    *,
    pinned: int | None = None,
) -> Outcome:
    """Start the attempt and run it, holding the scope's lock. ``pinned``: the
    epoch an earlier attempt pinned, as the precheck read it: the run's open
    query goes with the start, for that epoch (or the one the start pins
    now), and the run opens from what it read."""
    opening = OpenChoice(pinned, req.kind == "resume")
    version = await ctx.version(req.agent)
    try:
        started = await _start(ctx, attempt, req, worker, opening, version)
    except LockLost as exc:
        # The start may have committed (its attempt counted) before the answer
        # was lost: this worker's open attempt is lost, not crashed.
        raise AttemptLost(attempt.request_id, None, exc, worker) from exc
    if started.opened is not None:
        lease.prefetched = (opening, started.opened)
    unstarted = await _not_started(ctx, attempt, req, started, version, options)
    if unstarted is not None:
        return unstarted
    usage = AttemptUsage(req.agent, ctx.prices,
                         req.fairness_key if ctx.settings.usage_metrics_by_key else None)
    try:
        ending: Ending | Retry | Paused | None = ending_before_run(started, ctx.settings, worker)
        if ending is None:
            ending = await _run(ctx, runtime, lease, attempt, req, started, time_limit, usage)
        return await _settle(ctx, lease, attempt, req, started, ending, usage, options)
    except LockLost as exc:
        # Fenced while this worker lives: not a crash (see AttemptLost).
        raise AttemptLost(attempt.request_id, started.attempt, exc, worker) from exc
    except HandedBack:
        await _record_usage(attempt, usage)
        return Outcome(OutcomeKind.HANDED_BACK)


async def _not_started(
    ctx: Host, attempt: Attempt, req: RunRequest, started: ledger.Started,
    version: str, options: MessageOptions | None,
) -> Outcome | None:
    """What a start that runs nothing comes to: a duplicate of a finished
    request, a request pinned to another version, or one behind an older
    request of its session. ``None``: it started; run it."""
    if started.status in TERMINAL:
        return await _duplicate(attempt, req, started.status, result=started.result,
                                error=started.error)
    if started.status == ledger.OTHER_VERSION:
        assert started.other_version is not None
        return await _send_to_version(ctx, attempt, req, version, started.other_version,
                                      options)
    if started.status == "parked":
        assert started.older is not None
        await _park_behind(attempt, req, started.older, started.older_stale, options)
        return Outcome(OutcomeKind.PARKED,
                       dispatch=[started.older] if started.older_stale else [])
    assert started.epoch is not None
    return None


async def _settle(
    ctx: Host, lease: Lease, attempt: Attempt, req: RunRequest,
    started: ledger.Started, ending: Ending | Retry | Paused, usage: AttemptUsage,
    options: MessageOptions | None,
) -> Outcome:
    """The attempt's end as its run decided it: paused, retried, or its request ended."""
    if isinstance(ending, Paused):
        await _record_usage(attempt, usage)
        return await _pause(attempt, req, ending, options)
    if isinstance(ending, Retry):
        await _record_usage(attempt, usage)
        return await _retry(attempt, req, ending)
    return await _conclude(ctx, lease, attempt, req, started, ending, usage)


async def _retry(attempt: Attempt, req: RunRequest, retry: Retry) -> Outcome:
    """The run raised an error that is not final: it runs again after its backoff."""
    await attempt.schedule_retry(retry.error, retry.countdown)
    log.warning("request %s failed (%s); retry %d in %.1fs", attempt.request_id, retry.error,
                retry.failures, retry.countdown,
                extra={"action": "retry", **_log_fields(attempt.request_id, req)})
    return Outcome(OutcomeKind.RETRY, error=f"{type(retry.error).__name__}: {retry.error}",
                   countdown=retry.countdown)


async def _record_usage(attempt: Attempt, usage: AttemptUsage) -> None:
    """The attempt's model calls, recorded as it ends without finishing its
    request (a retry, a pause, a hand-back): one statement, none without calls."""
    if usage:
        params = usage.params()
        with anyio.CancelScope(shield=True):
            await attempt.record_usage(params)


async def _send_to_version(
    ctx: Host, attempt: Attempt, req: RunRequest, version: str, pinned: str,
    options: MessageOptions | None,
) -> Outcome:
    """The request is pinned to version ``pinned`` of its agent, and this
    worker runs ``version``: nothing of it runs here. It waits, queued, for a
    worker of its version, its message published to that version's queue."""
    kept = options() if options is not None else None
    pending = await attempt.await_version(kept, ctx.settings.queue,
                                          queue_suffix(req.agent, pinned))
    queue = (pending.routing or {}).get("queue") if pending is not None else None
    log.warning(
        "request %s is pinned to version %s of agent %r, and this worker runs version %s: "
        "it waits in queue %s for a worker of its version (or `loomflow-worker upgrade`)",
        attempt.request_id, pinned, req.agent, version, queue,
        extra={"action": "other_version", "agent": req.agent, "version": pinned,
               **_log_fields(attempt.request_id, req)})
    return Outcome(OutcomeKind.PARKED, dispatch=[pending] if pending is not None else [])


async def _start(
    ctx: Host,
    attempt: Attempt,
    req: RunRequest,
    worker: str,
    opening: OpenChoice,
    version: str | None = None,
) -> ledger.Started:
    """Start the attempt under the scope lock, once the request's previous
    attempt has ended. Holding the lock is not enough: when a lock connection
    alone ends (a Postgres restart, a killed backend), its worker learns it at
    its next statement or heartbeat and may be in the middle of a tool call
    until then, while a duplicate of the message already holds the freed
    lock. The start waits until that attempt records its end, or its worker
    is seen gone (see ``start_request``), so two attempts of one request
    never run at once."""
    settings = ctx.settings
    waited: float | None = None
    while True:
        started = await attempt.start(
            worker, settings.redispatch_after, opening, lease=settings.lease_timeout,
            interval=settings.heartbeat_interval, quarantine=ctx.quarantine,
            version=version,
        )
        if started.status != ledger.WAITING:
            if waited is not None:
                log.info("request %s: its previous attempt ended after %.1fs; starting",
                         attempt.request_id, time.monotonic() - waited,
                         extra={"action": "previous_ended",
                                **_log_fields(attempt.request_id, req)})
            return started
        if waited is None:
            waited = time.monotonic()
            log.info(
                "request %s: its previous attempt may still be running on %s (its lock "
                "connection ended before it stopped); waiting for it to end",
                attempt.request_id, started.previous_worker,
                extra={"action": "previous_running", "worker": started.previous_worker,
                       **_log_fields(attempt.request_id, req)},
            )
        await anyio.sleep(min(PREVIOUS_POLL, settings.heartbeat_interval / 2))


async def _pause(
    attempt: Attempt, req: RunRequest, paused: Paused, options: MessageOptions | None = None,
) -> Outcome:
    """The run gives its slot back until its model key can take its call (see
    :class:`.errors.Paused`), the place its call booked going to its next
    attempt; or until the signal it waits for arrives (its message acked, the
    sweeper publishes it again then)."""
    request_id = attempt.request_id
    if paused.signal is not None:
        (session, signal), kept = paused.signal, options() if options is not None else None
        await attempt.park_on_signal(session, signal, paused.reason, kept)
        log.info("request %s gives its slot back, %s; it resumes from its journal when the "
                 "signal arrives", request_id, paused.reason,
                 extra={"action": "paused", "signal": signal, **_log_fields(request_id, req)})
        _count_parked("signal")
        return Outcome(OutcomeKind.PARKED)
    await attempt.pause(paused.wait, paused.reason, paused.key if paused.booked else None,
                        paused.wait if paused.booked else None)
    log.info("request %s gives its slot back for %.1fs, %s; it resumes then from its journal",
             request_id, paused.wait, paused.reason,
             extra={"action": "paused", "model_key": paused.key, **_log_fields(request_id, req)})
    return Outcome(OutcomeKind.PAUSED, error=paused.reason, countdown=paused.wait)


def _signal_wait(park_after: float | None) -> Callable[[str, str, float], None]:
    """What a run's wait for a signal calls each time it is not there yet: past
    ``park_after`` seconds (``None`` or 0: never) the run gives its slot back."""

    def waited(session_id: str, name: str, seconds: float) -> None:
        if park_after and seconds > park_after:
            raise Paused("signal", 0.0, f"waiting for signal {name!r} of session {session_id!r}",
                         False, signal=(session_id, name))

    return waited


def _log_fields(request_id: str, req: RunRequest) -> dict[str, Any]:
    return {"request": request_id, "session": req.session_id, "user": req.user_id}


async def _conclude(
    ctx: Host,
    lease: Lease,
    attempt: Attempt,
    req: RunRequest,
    started: ledger.Started,
    ending: Ending,
    usage: AttemptUsage | None = None,
) -> Outcome:
    """The one way a request ends: finished in the ledger (status, result,
    epoch advance, the next request chosen, in one statement; the attempt's
    model-call usage in the same round trip), its live events closed, logged
    and counted; the outcome says what to hand over."""
    assert started.epoch is not None
    request_id = attempt.request_id
    await lease.flush_last_run()
    with anyio.CancelScope(shield=True):
        chosen = await attempt.finish(
            started.epoch or 0, usage.params() if usage else None, status=ending.status,
            result=ending.result, error=ending.error, error_type=ending.error_type,
        )
    if ctx.events is not None:
        ctx.events.end(request_id, started.attempt, ending.status, ending.error)
    meter = metrics.get()
    if meter is not None:
        meter.requests.labels(ending.status).inc()
    level = logging.ERROR if ending.status in ("failed", "dead") else logging.INFO
    log.log(level, "request %s %s%s", request_id, ending.status, ending.note,
            extra={"action": ending.status, **_log_fields(request_id, req)})
    return ended(ending.status, chosen, result=ending.result, error=ending.error)


def _count_start(request_id: str, req: RunRequest, started: ledger.Started) -> None:
    """The attempt's start, logged, traced and counted (a first one, a retry,
    or a recovery: how long its request went unstamped, and since its handoff)."""
    log.info("request %s attempt %d at epoch %d", request_id, started.attempt, started.epoch,
             extra={"action": "start", "attempt": started.attempt,
                    **_log_fields(request_id, req)})
    tracing.attempt_started(started.attempt, started.epoch or 0, started.since_heartbeat)
    meter = metrics.get()
    if meter is not None:
        how = "recovery" if started.since_heartbeat is not None else (
            "retry" if started.failures else "first")
        meter.attempts.labels(how).inc()
        if started.since_heartbeat is not None:
            meter.recovery.observe(started.since_heartbeat)
        if started.since_handoff is not None:
            meter.handoff.observe(started.since_handoff)


def _time_limit(ctx: Host, req: RunRequest, call_limit: float | None
                ) -> tuple[float, bool]:
    """The run's time limit (the agent's, else the settings'; the caller's when
    shorter), and whether it is the caller's."""
    time_limit = agent_time_limit(req.agent) or ctx.settings.run_time_limit
    if call_limit is not None and call_limit < time_limit:
        return call_limit, True
    return time_limit, False


def _lend_lease(ctx: Host, lease: Lease, attempt: Attempt, started: ledger.Started,
                usage: AttemptUsage | None, fence: anyio.CancelScope) -> None:
    """The lease carries the attempt while it runs: the process's heartbeat
    stamps the request from now on, and when the lock connection is lost the
    run stops at once, mid-step (``fence``)."""
    lease.request_id, lease.attempt = attempt.request_id, started.attempt
    lease.upgraded = started.upgraded
    lease.usage = usage
    if started.suspicion or started.lost_streak:
        # Its first completed step clears it of suspicion (and, running in
        # quarantine, sends it back to its shared process, unless a cancel
        # stops it there).
        async def cleared() -> None:
            await attempt.clear_suspicion()
            if ctx.in_quarantine:
                lease.request_stop(HandedBack())

        lease.on_executed = cleared
    lease.on_fenced.append(lambda _: _fenced(fence))


def _take_lease_back(lease: Lease) -> None:
    """The run ended: the lease carries no attempt."""
    lease.request_id = lease.attempt = None
    lease.upgraded = False
    lease.usage = None


async def _call_agent(
    ctx: Host, runtime: PostgresRuntime, lease: Lease, request_id: str,
    req: RunRequest, started: ledger.Started, agent: Any,
    stops: tuple[anyio.CancelScope, anyio.CancelScope, anyio.CancelScope],
) -> dict[str, Any] | None:
    """The agent's run of the request, inside what can stop it (``stops``:
    the fence, the halt and the deadline; ``None`` when one of them did),
    paced, its waits for a signal parked past ``PARK_AFTER``."""
    fence, halt, deadline = stops
    pacing = RunPacing(request_id, ctx.settings.park_after if ctx.parks else None)
    if started.booked_key is not None and started.booked_in is not None:
        pacing.booked[started.booked_key] = time.monotonic() + started.booked_in
    with fence, halt, run_options(lease=lease, epoch=started.epoch), deadline, \
            pacing_run(pacing), signal_waits(_signal_wait(pacing.park_after)):
        emit = _emitter(ctx, request_id, started.attempt, lease)
        if req.kind == "resume":
            with resuming_last_run():
                return await run_request(agent, runtime, request_id, req, emit)
        return await run_request(agent, runtime, request_id, req, emit)
    return None


async def _run(
    ctx: Host,
    runtime: PostgresRuntime,
    lease: Lease,
    attempt: Attempt,
    req: RunRequest,
    started: ledger.Started,
    call_limit: float | None = None,
    usage: AttemptUsage | None = None,
) -> Ending | Retry | Paused:
    """Run the agent; what happened, as an ending, a retry or a pause. A lost
    lock raises :class:`LockLost`; an outside stop (a shutdown) is re-raised
    once the attempt is recorded as interrupted. ``usage`` is told of the
    run's model calls as their steps are journaled or replayed."""
    assert started.epoch is not None
    request_id = attempt.request_id
    _count_start(request_id, req, started)
    executed, replayed = runtime.stats.steps_executed, runtime.stats.steps_replayed
    agent = await ctx.agent(req.agent)
    time_limit, per_call = _time_limit(ctx, req, call_limit)
    fence = anyio.CancelScope()
    _lend_lease(ctx, lease, attempt, started, usage, fence)
    # A revoke with terminate stops it at once, mid-step; Celery's soft time
    # limit ends it as its own time limit does.
    halt = anyio.CancelScope()
    halted: list[str] = []
    deadline = anyio.move_on_after(time_limit)

    def stop_now(reason: str, timed_out: bool) -> None:
        if timed_out:
            deadline.cancel()
            return
        halted.append(reason)
        halt.cancel()

    ctx.run_started(request_id, stop_now)
    try:
        try:
            result = await _call_agent(ctx, runtime, lease, request_id, req, started, agent,
                                       (fence, halt, deadline))
            if fence.cancelled_caught:
                raise lease.fenced or LockLost(req.scope, "the heartbeat failed")
        finally:
            _take_lease_back(lease)
            ctx.run_ended(request_id)
            _count_steps(runtime, executed, replayed)
    except LockLost:
        raise
    except Exception as exc:  # the run raised: not a crash, so retry or fail
        if lease.fenced is not None:
            raise lease.fenced from exc
        return ending_of_error(exc, started, ctx.settings, ctx.backoff)
    except BaseException as exc:
        stopped = await _ending_of_stop(ctx, lease, attempt, req, exc)
        if stopped is None:
            raise
        return stopped
    if halt.cancelled_caught:
        return Ending("cancelled", error=halted[0], error_type="Revoked", note=f": {halted[0]}")
    if deadline.cancelled_caught:
        if lease.fenced is not None:
            raise lease.fenced
        return time_limit_ending(time_limit, per_call=per_call)
    assert result is not None
    return Ending("succeeded", result={**result, "request_id": request_id})


async def _ending_of_stop(
    ctx: Host, lease: Lease, attempt: Attempt, req: RunRequest, exc: BaseException
) -> Ending | Paused | None:
    """What a run stopped by other than an error of its own comes to: handed
    back from quarantine (raised), paused, failed as diverged, or cancelled
    at a step boundary. ``None``: the stop goes on up (a shutdown's attempt
    recorded as interrupted first)."""
    if _found(exc, HandedBack) is not None:
        with anyio.CancelScope(shield=True):
            await attempt.end("handed_back")
        log.info("request %s cleared running alone; handed back", attempt.request_id,
                 extra={"action": "handed_back", **_log_fields(attempt.request_id, req)})
        raise HandedBack() from exc
    paused = _found(exc, Paused)
    if paused is not None and lease.fenced is None:
        return paused
    diverged = _found(exc, Diverged)
    if diverged is not None:
        # The request is pinned to this worker's version: the version said
        # the code had not changed (declared, and left unchanged).
        said = (f"{diverged} (both under version {ctx.versions.get(req.agent)} of agent "
                f"{req.agent!r}: the agent changed in a way its version does not show, "
                "e.g. a declared version left as it was)")
        return Ending("failed", error=f"Diverged: {said}", error_type="Diverged",
                      note=f": {said}")
    stopped = _found(exc, RunStopped)
    if stopped is not None:
        return Ending("cancelled", error=stopped.reason, error_type="Cancelled",
                      note=" at a step boundary")
    if isinstance(exc, asyncio.CancelledError) and lease.fenced is None:
        # Stopped from outside (a shutdown): this attempt was interrupted,
        # which the next one must not count as a crash, and its message goes
        # back to the broker (the request is queued again). Recorded under
        # the lock, before the next attempt can start.
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await attempt.requeue_interrupted()
        log.info("request %s interrupted", attempt.request_id,
                 extra={"action": "interrupted", **_log_fields(attempt.request_id, req)})
    return None


def _count_steps(runtime: PostgresRuntime, executed: int, replayed: int) -> None:
    """The run's steps, executed and replayed since ``executed`` and ``replayed``."""
    meter = metrics.get()
    if meter is not None:
        meter.steps.labels("executed").inc(runtime.stats.steps_executed - executed)
        meter.steps.labels("replayed").inc(runtime.stats.steps_replayed - replayed)


def _fenced(fence: anyio.CancelScope) -> None:
    """A run whose lock connection was lost stops at once, mid-step."""
    fence.cancel()
    meter = metrics.get()
    if meter is not None:
        meter.fenced.inc()


def _count_parked(reason: str) -> None:
    meter = metrics.get()
    if meter is not None:
        meter.parked.labels(reason).inc()


E = TypeVar("E", bound=BaseException)


def _found(exc: BaseException, kind: type[E]) -> E | None:
    """The ``kind`` exception that ended a run, also from inside a task group."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _found(inner, kind)
            if found is not None:
                return found
    return None


def fence_after(settings: Settings) -> float:
    """How long a lock connection's runs may go without a heartbeat before the
    process fences them itself: well before the sweeper, which ends the lock connections
    of a worker silent for ``LEASE``, may act, and never sooner than an interval and a
    half (a stamp comes an interval after the last, later on a busy loop: a bound of
    one interval fenced healthy runs on every late tick). The bound is checked each
    interval, so the process fences within an interval after it; ``LEASE``, at least
    three intervals (the settings check it), leaves the sweeper half an interval after
    that at the soonest."""
    margin = max(2 * settings.heartbeat_interval, settings.lease_timeout / 5)
    return max(settings.lease_timeout - margin, 1.5 * settings.heartbeat_interval)


def confirm_within(settings: Settings) -> float:
    """How long after a heartbeat was sent a run may start a step without
    waiting for another: two heartbeat intervals (a busy loop fires them
    late), and never more than half of :func:`fence_after`, so a step starts
    at least half the lease before the sweeper could resume its run elsewhere."""
    return min(2 * settings.heartbeat_interval, fence_after(settings) / 2)


def liveness(settings: Settings) -> Liveness:
    """How a worker's running requests are kept alive and fenced (see :class:`Liveness`)."""
    return Liveness(
        fence_after=fence_after(settings), confirm_within=confirm_within(settings),
        lease_timeout=settings.lease_timeout, stamp=ledger.heartbeat, on_cancelled=_cancelled,
    )


def _cancelled(lease: Lease) -> None:
    """A cancel was requested for the request ``lease`` runs (its heartbeat
    said so): it stops at its next step."""
    lease.request_stop(RunStopped("cancelled while running"))
