"""What one attempt of a request came to (pure logic, no services): the
attempt's outcome for its caller, and how a run's end decides it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from ..runtime import InvalidInput
from ..settings import Settings
from .ledger import Handoff, Started
from .pending import Pending
from .statuses import QuarantineLevel, Status


class OutcomeKind(StrEnum):
    """What became of an attempt (equal to its text: traces and the
    quarantine process's pipe carry it as such)."""

    # Its request ended (the ledger's terminal statuses an attempt records).
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    DEAD = "dead"
    CANCELLED = "cancelled"
    # It waits, holding no slot: behind an older request of its session, on a
    # full limit, for a signal, or for a worker of its version.
    PARKED = "parked"
    # The run raised an error that is not final: it runs again after ``countdown``.
    RETRY = "retry"
    # It must run in quarantine (``Outcome.quarantine`` says at which level),
    # in a process of quarantine.
    QUARANTINE = "quarantine"
    # It ran in quarantine until it completed a step: run it again here.
    HANDED_BACK = "handed_back"
    # The message is not its request's own: nothing ran, nothing changed.
    REFUSED = "refused"
    # It gave its slot back to wait for its model key: publish it again
    # ``countdown`` seconds from now.
    PAUSED = "paused"

    @property
    def ended(self) -> bool:
        """Whether the request ended (a terminal status in the ledger)."""
        return self in _ENDED


_ENDED = frozenset({OutcomeKind.SUCCEEDED, OutcomeKind.FAILED, OutcomeKind.DEAD,
                    OutcomeKind.CANCELLED})


@dataclass
class Outcome:
    """One attempt's outcome: what its Celery task acks, retries or stores."""

    kind: OutcomeKind
    result: dict[str, Any] | None = None
    error: str | None = None
    countdown: float = 0.0
    dispatch: list[Pending] = field(default_factory=list)
    # The request ended and handed its scope on (whether or not it publishes
    # the request it handed the scope to).
    handed: bool = False
    # The quarantine it must run in (``QUARANTINE``).
    quarantine: QuarantineLevel = QuarantineLevel.NONE


def ended(kind: OutcomeKind | Status | str, handoff: Handoff | None, **fields: Any) -> Outcome:
    """A request's end: what it handed its scope to is published when needed."""
    return Outcome(
        OutcomeKind(kind),
        dispatch=handoff.dispatch if handoff is not None else [],
        handed=handoff is not None,
        **fields,
    )


@dataclass(frozen=True)
class Ending:
    """How an attempt ends its request: the terminal status and what it says."""

    status: Literal["succeeded", "failed", "dead", "cancelled"]
    result: dict[str, Any] | None = None
    error: str | None = None
    error_type: str | None = None
    # What the log line adds after "request <id> <status>" (": why", " when").
    note: str = ""


@dataclass(frozen=True)
class Retry:
    """The run raised an error that is not final: it runs again after ``countdown``."""

    error: Exception
    failures: int
    countdown: float


def ending_before_run(started: Started, settings: Settings, worker: str) -> Ending | None:
    """A request that must end without running: its worker died too often, or
    it was cancelled while it waited."""
    if started.crashes >= settings.max_crashes:
        error = (
            f"the worker died {started.crashes} times while running this request "
            f"(LOOMFLOW_WORKER_MAX_CRASHES={settings.max_crashes}); last attempt on {worker}"
        )
        return Ending("dead", error=error, error_type="WorkerDied", note=f": {error}")
    if started.lost_streak >= settings.max_lost:
        error = (
            f"its last {started.lost_streak} attempts lost their lock connection without "
            f"completing a step (LOOMFLOW_WORKER_MAX_LOST={settings.max_lost}): their process "
            "stopped heartbeating for longer than LEASE (a tool that holds the event loop? "
            f"the worker log names it) or their connection kept failing; last attempt on {worker}"
        )
        return Ending("dead", error=error, error_type="AttemptsLost", note=f": {error}")
    if started.cancel_requested:
        return Ending("cancelled", error="cancelled before it started", error_type="Cancelled",
                      note=" before it started")
    return None


def ending_of_error(
    exc: Exception, started: Started, settings: Settings, backoff: Callable[[int], float]
) -> Ending | Retry:
    """A run that raised (not a crash): retried with backoff, or failed once
    the input is at fault or the retries are spent."""
    failures = started.failures + 1
    if isinstance(exc, InvalidInput) or failures > settings.max_retries:
        error = f"{type(exc).__name__}: {exc}"
        return Ending("failed", error=error, error_type=type(exc).__name__,
                      note=f" after {started.attempt} attempts: {error}")
    return Retry(exc, failures, backoff(failures))


def time_limit_ending(time_limit: float, *, per_call: bool = False) -> Ending:
    """``per_call``: the limit was the caller's (Celery's ``time_limit`` or
    ``soft_time_limit``), not the agent's."""
    source = ("apply_async's time_limit or soft_time_limit" if per_call
              else "register_agent(time_limit=...) or LOOMFLOW_WORKER_RUN_TIME_LIMIT")
    error = f"TimeLimitExceeded: the run took longer than its {time_limit:g}s time limit ({source})"
    return Ending("failed", error=error, error_type="TimeLimitExceeded", note=f": {error}")
