"""Agent runs as Celery tasks: ``celery -A loomflow_worker.tasks worker``."""

from ..execution.errors import RunCancelled, RunDead, RunFailed
from ..execution.registry import register_agent, registered_agents
from . import execute as _stored_error_module  # noqa: F401  (see its docstring)
from .application import (
    AgentTask,
    app,
    configure,
    resume_agent,
    run_agent,
    settings,
)

__all__ = [
    "AgentTask",
    "RunCancelled",
    "RunDead",
    "RunFailed",
    "app",
    "configure",
    "register_agent",
    "registered_agents",
    "resume_agent",
    "run_agent",
    "settings",
]
