"""A request's statuses in the ``runs`` ledger, in a module that imports
nothing: the ``loomflow-worker`` command lists them in its help."""

from __future__ import annotations

from enum import IntEnum, StrEnum


class Status(StrEnum):
    """A request's status in the ``runs`` ledger (equal to its text in SQL)."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    DEAD = "dead"
    # Celery let it expire (``apply_async(expires=...)``) before it started.
    EXPIRED = "expired"


UNFINISHED = (Status.QUEUED, Status.RUNNING)
TERMINAL = tuple(s for s in Status if s not in UNFINISHED)
#: Their names, as the command's options and the console's filter take them.
STATUSES = tuple(str(s) for s in Status)


class QuarantineLevel(IntEnum):
    """How far apart from other runs a request runs: the ledger carries it as
    a number (the ``isolation`` of an attempt, the ``quarantine`` a request
    needs), as do the logs and metrics."""

    #: In a shared process, with the other runs of its worker.
    NONE = 0
    #: In a process of quarantine, among a few suspects (``QUARANTINE_GROUP``).
    GROUP = 1
    #: In a process of its own.
    ALONE = 2

    @classmethod
    def given(cls, quarantine: int, slots: int) -> QuarantineLevel:
        """The quarantine a process gives its runs: its own, as a process of
        quarantine; else alone when it carries one run at a time."""
        if quarantine:
            return cls(quarantine)
        return cls.ALONE if slots == 1 else cls.NONE
