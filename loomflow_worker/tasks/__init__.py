"""Agent runs as Celery tasks: ``celery -A loomflow_worker.tasks worker``.

The binding, by job: :mod:`.application` (the app and its configuration),
:mod:`.task` (the tasks' class: record, then publish), :mod:`.perform`
(what a worker's task does), :mod:`.dispatch` (publishing what the ledger
recorded), :mod:`.wake` (a signal's sender publishing the requests waiting
for it), :mod:`.cancel`, :mod:`.revoke`, :mod:`.results`, :mod:`.eta`,
:mod:`.hooks` (the worker's Celery signals), :mod:`.old_names` (what lets
failures stored by earlier versions read as their classes). What a worker
process is (its context, loop, pool, state and quarantine's processes) is in
:mod:`loomflow_worker.worker`."""

from ..execution.registry import register_agent, registered_agents
from ..execution.request_errors import RunCancelled, RunDead, RunFailed
from . import hooks as _hooks  # noqa: F401  (connects the worker's signal receivers)
from . import wake as _wake  # noqa: F401  (a signal sent publishes the requests it wakes)
from .application import AgentTask, app, configure, resume_agent, run_agent, settings
from .old_names import install as _install_old_names

# Stored failures that name a module of an earlier version read as our classes.
_install_old_names()

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
