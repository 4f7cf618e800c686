"""loomflow-worker: durable loomflow agent runs on Postgres and Celery."""

from typing import TYPE_CHECKING

from .lazy import exports

if TYPE_CHECKING:
    from .execution.registry import register_agent
    from .execution.request_errors import OverBudget, RequestNotFound
    from .memory import NoMemory
    from .runtime import (
        DatabaseUnavailable,
        InvalidInput,
        LockLost,
        LoomflowWorkerError,
        PostgresRuntime,
        SessionBusy,
    )
    from .tasks.cancel import cancel_queued, cancel_request, cancel_run

__version__ = "0.1.0"

# Each imported on first use: the runtime loads loomflow, cancelling loads Celery.
__getattr__ = exports(__name__, {
    "DatabaseUnavailable": ".runtime.errors",
    "InvalidInput": ".runtime.errors",
    "LockLost": ".runtime.errors",
    "LoomflowWorkerError": ".runtime.errors",
    "NoMemory": ".memory",
    "OverBudget": ".execution.request_errors",
    "PostgresRuntime": ".runtime.runtime",
    "RequestNotFound": ".execution.request_errors",
    "SessionBusy": ".runtime.errors",
    "cancel_queued": ".tasks.cancel",
    "cancel_request": ".tasks.cancel",
    "cancel_run": ".tasks.cancel",  # cancel_request's first name, kept: applications call it
    "register_agent": ".execution.registry",
})

__all__ = [
    "DatabaseUnavailable",
    "InvalidInput",
    "LockLost",
    "LoomflowWorkerError",
    "NoMemory",
    "OverBudget",
    "PostgresRuntime",
    "RequestNotFound",
    "SessionBusy",
    "__version__",
    "cancel_queued",
    "cancel_request",
    "cancel_run",
    "register_agent",
]
