"""The Postgres journal runtime: cross-process turn-taking, fencing, replay."""

from typing import TYPE_CHECKING

from ..lazy import exports
from .errors import (
    DatabaseUnavailable,
    Diverged,
    InvalidInput,
    LockLost,
    LoomflowWorkerError,
    RunStopped,
    SchemaError,
    SessionBusy,
    SessionPooler,
)
from .migrate import latest_version, migrate

if TYPE_CHECKING:
    from .keys import scope_lock_key
    from .runtime import PostgresRuntime, current_lease, run_options
    from .store import Lease, LockSettings, PostgresJournalStore, RunStats

# Imported on first use: they load loomflow, which the operator tools never need.
__getattr__ = exports(__name__, {
    "PostgresRuntime": ".runtime",
    "current_lease": ".runtime",
    "run_options": ".runtime",
    "Lease": ".store",
    "LockSettings": ".store",
    "PostgresJournalStore": ".store",
    "RunStats": ".store",
    "scope_lock_key": ".keys",
})

__all__ = [
    "DatabaseUnavailable",
    "Diverged",
    "InvalidInput",
    "Lease",
    "LockLost",
    "LockSettings",
    "LoomflowWorkerError",
    "PostgresJournalStore",
    "PostgresRuntime",
    "RunStats",
    "RunStopped",
    "SchemaError",
    "SessionBusy",
    "SessionPooler",
    "current_lease",
    "latest_version",
    "migrate",
    "run_options",
    "scope_lock_key",
]
