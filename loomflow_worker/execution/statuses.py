"""A request's statuses in the ``runs`` ledger, in a module that imports
nothing: the ``loomflow-worker`` command lists them in its help."""

from __future__ import annotations

from enum import StrEnum


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
