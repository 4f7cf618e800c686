"""What a worker's task does with its request: one attempt on the process's
loop (or alone, in a process of its own), and the Celery outcome of each
ending (a result, a retry, a requeue, an ignored message, an error)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections.abc import Coroutine
from typing import Any

import psycopg
from celery.exceptions import Ignore, Reject, SoftTimeLimitExceeded

from .. import tracing
from ..execution import ledger
from ..execution.execute import execute
from ..execution.outcome import Outcome, OutcomeKind
from ..execution.registry import DEFAULT_AGENT
from ..execution.request import Kind
from ..execution.request_errors import AttemptLost, DiedAlone, RunCancelled, RunDead, RunFailed
from ..runtime.errors import DatabaseUnavailable, InvalidInput, LockLost
from ..worker.quarantine.attempts import run_in_quarantine
from ..worker.state import PROCESS
from .dispatch import dispatch_recorded, options_json
from .eta import arrival
from .retry import retry_within
from .task import AgentTask

log = logging.getLogger(__name__)

#: How long past the run time limit a request running alone may take before
#: its process is stopped.
QUARANTINE_GRACE = 60.0

#: How long a worker whose attempt lost its database connection tries to record
#: it (a Postgres restart takes seconds) before the request runs again.
MARK_LOST_WITHIN = 30.0


# Celery names each task's class after its function: ``_run_agent``,
# ``_resume_agent``, as they always were.


class RunAgentTask(AgentTask):
    kind: Kind = "run"


class ResumeAgentTask(AgentTask):
    kind: Kind = "resume"


def _run_agent(
    self: RunAgentTask,
    prompt: str,
    session_id: str,
    user_id: str | None = None,
    agent: str = DEFAULT_AGENT,
    metadata: dict[str, Any] | None = None,
) -> Any:
    """Run ``agent`` on ``prompt`` in ``session_id`` (for ``user_id``), durably.

    The result is the run's ``RunResult`` as JSON plus its ``request_id``."""
    return perform(
        self,
        {"prompt": prompt, "session_id": session_id, "user_id": user_id, "agent": agent,
         "metadata": metadata},
    )


def _resume_agent(
    self: ResumeAgentTask,
    prompt: str,
    session_id: str,
    user_id: str | None = None,
    agent: str = DEFAULT_AGENT,
) -> Any:
    """Continue the session's last run (``Agent.resume`` without a checkpoint):
    its completed steps replay, even if it finished."""
    return perform(
        self, {"prompt": prompt, "session_id": session_id, "user_id": user_id, "agent": agent}
    )


def perform(task: AgentTask, args: dict[str, Any]) -> Any:
    """Run the request ``task`` is running, and end the task as its outcome says."""
    if task.request.called_directly:
        raise InvalidInput(
            f"{task.name} was called directly, which skips the runs ledger; enqueue the "
            f"request with {task.name.rsplit('.', 1)[-1]}.delay(...) or .apply_async(...) "
            "and wait for it with .get() on the handle they return"
        )
    request_id = task.request.id
    try:
        outcome = _attempt(task, request_id, args)
        if outcome.kind == OutcomeKind.QUARANTINE:
            outcome = run_in_quarantine(
                request_id, args, task.kind, task.request.hostname or PROCESS.worker_context().node,
                level=outcome.quarantine, time_limit=_call_time_limit(task),
                options=_message_options(task, task.request),
                timeout=PROCESS.current_settings().run_time_limit + QUARANTINE_GRACE,
            )
            if outcome.kind == OutcomeKind.QUARANTINE:
                # No room to run it in quarantine here: again soon, on any worker
                # (a first retry's countdown, whatever its retries so far).
                raise task.retry(countdown=PROCESS.worker_context().backoff(1))
            if outcome.kind == OutcomeKind.HANDED_BACK:
                outcome = _attempt(task, request_id, args)
            if outcome.kind in (OutcomeKind.QUARANTINE, OutcomeKind.HANDED_BACK):
                raise task.retry(countdown=_backoff(task))
    except DiedAlone as exc:
        # Alone, its own death: its next attempt counts the crash, after a
        # backoff. Among suspects, nobody's: each runs its next attempt
        # alone, soon (as one that found no room does).
        countdown = _backoff(task) if exc.alone else PROCESS.worker_context().backoff(1)
        log.warning("request %s died in quarantine (%s); retrying in %.1fs", request_id, exc,
                    countdown, extra={"action": "retry", "request": request_id})
        raise task.retry(exc=exc, countdown=countdown) from exc
    except (concurrent.futures.CancelledError, asyncio.CancelledError) as exc:
        # Stopped by the worker (a shutdown): the run was interrupted and its
        # session lock released; the message goes back to the queue.
        log.info("request %s interrupted; requeued", request_id,
                 extra={"action": "interrupted", "request": request_id})
        raise Reject(exc, requeue=True) from exc
    except (LockLost, AttemptLost, DatabaseUnavailable, psycopg.OperationalError) as exc:
        if isinstance(exc, AttemptLost):
            mark_lost(exc)
        countdown = _backoff(task)
        log.warning("request %s: %s; retrying in %.1fs", request_id, exc, countdown,
                    extra={"action": "retry", "request": request_id})
        raise task.retry(exc=exc, countdown=countdown) from exc
    for pending in outcome.dispatch:
        # The handoff is committed: a broker that is down now does not make
        # this request fail (the sweeper publishes the next one).
        dispatch_recorded(pending, "handed the session")
    return _celery_outcome(task, outcome)


def _celery_outcome(task: AgentTask, outcome: Outcome) -> Any:
    """The task's result for an outcome, or what it raises to end otherwise."""
    if outcome.kind == OutcomeKind.SUCCEEDED:
        return outcome.result
    if outcome.kind in (OutcomeKind.PARKED, OutcomeKind.REFUSED):
        # Acked, and nothing stored under the id: a refused message's id may
        # be another request's, whose caller waits for its own result.
        raise Ignore()
    if outcome.kind == OutcomeKind.RETRY:
        raise task.retry(exc=RunFailed(outcome.error or "retry"), countdown=outcome.countdown)
    if outcome.kind == OutcomeKind.PAUSED:
        # Its slot given back, not a failure: Celery's retry publishes it again
        # for then (its state RETRY meanwhile), and no retry is counted.
        raise task.retry(countdown=outcome.countdown)
    if outcome.kind == OutcomeKind.DEAD:
        raise RunDead(outcome.error or "dead")
    if outcome.kind == OutcomeKind.CANCELLED:
        raise RunCancelled(outcome.error or "cancelled")
    raise RunFailed(outcome.error or "failed")


def _backoff(task: AgentTask) -> float:
    """How long the request waits before its next attempt."""
    countdown: float = PROCESS.worker_context().backoff(task.request.retries + 1)
    return countdown


def _attempt(task: AgentTask, request_id: str, args: dict[str, Any]) -> Outcome:
    """One attempt of the request on this process's loop."""
    ctx = PROCESS.worker_context()
    attempt = execute(ctx, request_id, args, task.kind,
                      task.request.hostname, time_limit=_call_time_limit(task),
                      options=functools.partial(_message_options, task, task.request),
                      arrival=arrival(task.request, task.app))
    outcome: Outcome = PROCESS.loop.run(
        traced(attempt, task.request.headers, request_id, args, task.request.hostname),
        key=request_id, interrupt=functools.partial(_soft_time_limit, request_id),
    )
    return outcome


async def traced(
    attempt: Coroutine[Any, Any, Outcome], headers: dict[str, Any] | None, request_id: str,
    args: dict[str, Any], worker: str | None,
) -> Outcome:
    """``attempt`` inside its span, which continues the trace its message's
    headers carry (on the loop: the span is current for the run's steps)."""
    agent, session_id = args.get("agent"), args.get("session_id")
    with tracing.attempt_span(headers, request_id, agent if isinstance(agent, str) else None,
                              session_id if isinstance(session_id, str) else None, worker):
        outcome = await attempt
        tracing.attempt_ended(outcome.kind, outcome.error)
        for pending in outcome.dispatch:
            tracing.event("handoff", to=pending.request_id)
        return outcome


def _call_time_limit(task: AgentTask) -> float | None:
    """The run's time limit from ``apply_async(time_limit=..., soft_time_limit=...)``:
    the soft limit, else a moment before the hard one, so that the run ends
    ``failed`` with ``TimeLimitExceeded`` before Celery would kill its process
    (which would count as a crash and resume it)."""
    hard, soft = (*(task.request.timelimit or ()), None, None)[:2]
    if soft:
        return float(soft)
    if hard:
        return max(float(hard) - min(1.0, 0.1 * float(hard)), 0.1)
    return None


def _soft_time_limit(request_id: str, exc: BaseException) -> bool:
    """Celery's soft time limit fired in this pool child (prefork, as a signal
    raising ``SoftTimeLimitExceeded`` wherever the task is): the run ends as
    past its own time limit, ``failed`` and handed on, rather than being
    cancelled mid-attempt (which would leave it for the sweeper to resume
    without its limits). ``True`` when ``exc`` is that limit."""
    if not isinstance(exc, SoftTimeLimitExceeded):
        return False
    ctx = PROCESS.context
    if ctx is not None and PROCESS.loop.running:
        PROCESS.loop.loop.call_soon_threadsafe(
            functools.partial(ctx.halt, request_id, "soft time limit", timed_out=True))
    log.info("request %s: Celery's soft time limit; the run ends past its time limit",
             request_id, extra={"action": "time_limit", "request": request_id})
    return True


def _message_options(task: AgentTask, request: Any) -> dict[str, Any]:
    """What the request's message carried besides its arguments, rebuilt as
    Celery's own retry rebuilds it (``Task.signature_from_request``): its chain
    and callbacks, errbacks, chord and group membership, root and parent ids,
    headers, priority and routing, expiry and time limits. As JSON (kombu's,
    so what the message decoded to is encoded back the same way)."""
    options = task.signature_from_request(request).options
    kept = {k: v for k, v in options.items() if v is not None and k != "task_id"}
    return options_json(kept)


def mark_lost(lost: AttemptLost) -> None:
    """Record, before the request runs again, that its attempt was lost by a
    worker that lived, so the next attempt does not count a crash. Bounded:
    past MARK_LOST_WITHIN the request goes on, and this attempt counts as one."""

    def attempt() -> bool:
        with PROCESS.ledger_connection() as conn:
            ledger.mark_lost(conn, lost.request_id, lost.attempt, lost.worker)
        return True

    if retry_within(MARK_LOST_WITHIN, attempt) is None:
        log.warning("request %s: could not record attempt %s as lost",
                    lost.request_id, lost.attempt,
                    extra={"action": "retry", "request": lost.request_id})
