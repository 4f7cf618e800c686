"""What the execution layer raises: how a request ended, when not with a result,
an attempt lost while its worker lived, and a request the ledger does not have.

A request's stored failure names its error's module and class (Celery's
result backend looks them up when a caller reads the result); the modules
results stored by earlier versions name lead here (``tasks/old_names.py``,
and ``loomflow_worker.execution.execute``, which still offers these
classes)."""

from __future__ import annotations

from ..runtime.errors import InvalidInput, LockLost, LoomflowWorkerError


class RunFailed(LoomflowWorkerError):
    """The request ended ``failed``; the message says why."""


class RunDead(LoomflowWorkerError):
    """The request ended ``dead``: its worker died too many times running it."""


class RunCancelled(LoomflowWorkerError):
    """The request was cancelled."""


class AttemptLost(LoomflowWorkerError):
    """An attempt lost its lock connection (a Postgres restart, a network blip)
    while its worker lived: it is fenced, and the request runs again. Not a
    crash: :func:`~.ledger.mark_lost` records it so."""

    def __init__(
        self, request_id: str, attempt: int | None, cause: LockLost, worker: str = ""
    ) -> None:
        """``attempt``: ``None`` when it was lost while it started (``worker``'s
        open attempt, if the start committed)."""
        self.request_id = request_id
        self.attempt = attempt
        self.worker = worker
        super().__init__(str(cause))


class DiedAlone(LoomflowWorkerError):
    """The process of quarantine that ran a request died: when it ran the
    request alone, the death is the request's own, and its next attempt
    counts the crash; when it ran a few suspects, it is none's, and each
    runs its next attempt alone."""

    def __init__(self, message: str, *, alone: bool = True) -> None:
        super().__init__(message)
        #: Whether the process ran the request alone.
        self.alone = alone


class HandedBack(BaseException):
    """Raised at the step boundary after a request running alone completed a
    step: cleared of suspicion, it goes back to its worker's shared process,
    which runs its next attempt (replaying what it journaled). A
    ``BaseException``, as :class:`~loomflow_worker.runtime.RunStopped`."""

    def __init__(self) -> None:
        super().__init__("cleared of suspicion: handed back to the shared process")


class Paused(BaseException):
    """Raised out of a run whose model call would wait longer than
    ``PARK_AFTER`` for its key (see :mod:`.pacing`), or which has waited that
    long for a signal: the run gives its slot back and its request resumes in
    ``wait`` seconds, or once the signal is there (a BaseException, so
    that no ``except Exception`` of the agent's takes it for the call's
    error)."""

    def __init__(self, key: str, wait: float, reason: str, booked: bool,
                 signal: tuple[str, str] | None = None) -> None:
        super().__init__(reason)
        self.key = key
        self.wait = wait
        self.reason = reason
        # Whether the call booked its place (which the next attempt takes).
        self.booked = booked
        # The signal the run waits for, when it is one, as (session, name):
        # then it resumes when the signal arrives, not after ``wait``.
        self.signal = signal


class RequestNotFound(InvalidInput, LookupError):
    """No request with this id in the runs ledger: what ``show``, ``tail`` and
    ``cancel`` exit 4 with, what the console answers 404 with, and what
    cancelling an unknown request raises. ``listed_by`` says where to look
    for the recent ones (the console: its requests list)."""

    def __init__(
        self,
        request_id: str,
        *,
        listed_by: str = "`loomflow-worker requests` lists the recent ones",
    ) -> None:
        self.request_id = request_id
        super().__init__(
            f"no request {request_id!r} in the runs ledger (pruned, mistyped, or enqueued "
            f"against another database); {listed_by}"
        )


class OverBudget(LoomflowWorkerError):
    """The enqueue was refused: the request's fairness key (tenant) or agent
    has spent its budget for the period, and that budget refuses requests
    while spent (``"over": "refuse"``). Nothing was written or published."""

    def __init__(self, budget: str, said: str) -> None:
        self.budget = budget
        super().__init__(
            f"refused: {said} (`loomflow-worker limits budget {budget} ...` raises it)")
