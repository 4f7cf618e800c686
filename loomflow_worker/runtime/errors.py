"""What the runtime raises, each with what went wrong and what to do."""

from __future__ import annotations


class LoomflowWorkerError(Exception):
    """Base of every error this package raises."""


class InvalidInput(LoomflowWorkerError, ValueError):
    """An argument was refused before anything was read or written."""


class DatabaseUnavailable(LoomflowWorkerError):
    """Postgres could not be reached or refused the connection."""


class SessionPooler(InvalidInput):
    """The database URL leads to a pooler in transaction or statement mode,
    whose connections are not one server session each."""


class SchemaError(LoomflowWorkerError):
    """The database schema is missing, or newer than this package."""


class SessionBusy(LoomflowWorkerError):
    """Another run holds the (session, user) scope.

    Raised when the scope's lock could not be taken within the wait the
    caller allowed (``lock_wait_timeout``)."""

    def __init__(self, scope: str, waited_s: float | None, *, detail: str | None = None) -> None:
        self.scope = scope
        self.waited_s = waited_s
        if detail is not None:
            super().__init__(f"session scope {scope!r} is busy: {detail}; retry later")
            return
        if waited_s is None or waited_s <= 0:
            detail = "and the run was not allowed to wait"
        else:
            detail = f"for longer than {waited_s:g}s"
        super().__init__(
            f"session scope {scope!r} is busy: another run on it is in progress {detail}; "
            "retry later, or raise lock_wait_timeout to wait longer"
        )


class LockLost(LoomflowWorkerError):
    """The run's lock connection failed, so the run no longer owns its scope.

    Once raised, the run is fenced: no further journal entry is written
    and it cannot finish. Run the request again to resume it from the
    journal; completed steps replay."""

    def __init__(self, scope: str, cause: str) -> None:
        self.scope = scope
        super().__init__(
            f"lost the lock on session scope {scope!r} ({cause}); this attempt is fenced "
            "and wrote nothing more: run the request again to resume it from the journal"
        )


class RunStopped(BaseException):
    """Raised at a run's next step boundary after it was asked to stop.

    A ``BaseException`` so that no ``except Exception`` (loomflow turns a
    tool's exceptions into error results) keeps the run going."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"the run was stopped at a step boundary: {reason}")
