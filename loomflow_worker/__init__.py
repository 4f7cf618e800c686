"""loomflow-worker: durable loomflow agent runs on Postgres and Celery."""

from .runtime import (
    DatabaseUnavailable,
    InvalidInput,
    LockLost,
    LoomflowWorkerError,
    PostgresRuntime,
    SessionBusy,
)
from .tasks.registry import register_agent

__version__ = "0.1.0"

__all__ = [
    "DatabaseUnavailable",
    "InvalidInput",
    "LockLost",
    "LoomflowWorkerError",
    "PostgresRuntime",
    "SessionBusy",
    "__version__",
    "register_agent",
]
