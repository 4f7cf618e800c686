"""loomflow-worker: durable loomflow agent runs on Postgres and Celery."""

from typing import Any

from .execution.registry import register_agent
from .memory import NoMemory
from .runtime import (
    DatabaseUnavailable,
    InvalidInput,
    LockLost,
    LoomflowWorkerError,
    PostgresRuntime,
    SessionBusy,
)

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The Celery side is imported on first use, so the runtime alone stays light.
    if name in ("cancel_run", "cancel_queued"):
        from .tasks import cancel

        return getattr(cancel, name)
    raise AttributeError(f"module 'loomflow_worker' has no attribute {name!r}")


__all__ = [
    "DatabaseUnavailable",
    "InvalidInput",
    "LockLost",
    "LoomflowWorkerError",
    "NoMemory",
    "PostgresRuntime",
    "SessionBusy",
    "__version__",
    "cancel_queued",
    "cancel_run",
    "register_agent",
]
