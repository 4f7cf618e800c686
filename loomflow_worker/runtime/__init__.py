"""The Postgres journal runtime: cross-process turn-taking, fencing, replay."""

from .errors import (
    DatabaseUnavailable,
    InvalidInput,
    LockLost,
    LoomflowWorkerError,
    RunStopped,
    SchemaError,
    SessionBusy,
    SessionPooler,
)
from .migrate import latest_version, migrate
from .runtime import PostgresRuntime, current_lease, run_options
from .store import Lease, LockSettings, PostgresJournalStore, RunStats, scope_lock_key

__all__ = [
    "DatabaseUnavailable",
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
