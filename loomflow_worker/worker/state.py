"""What one process keeps of the Celery binding: one :class:`ProcessState`,
:data:`PROCESS`.

A process that only enqueues uses its settings, its app and its enqueue
pool; a worker's process also its loop, its worker context and the parts of
its worker (node, slots, sweeper, admission, the messages it holds). A
forked pool child inherits the object and makes its own loop, pool and
context (each checks the process id, or is made at ``worker_process_init``)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import psycopg
from celery import Celery
from pydantic import ValidationError
from pydantic_settings import SettingsError

from ..execution import budgets, ledger, limits
from ..execution.ledger import EnqueuePool
from ..execution.pending import Pending
from ..execution.registry import agent_registered, import_agent_modules, learn_fleet_agent
from ..runtime.errors import InvalidInput
from ..settings import Settings, validation_message
from .admission import Admission
from .context import WorkerContext
from .loop import ChildLoop
from .quarantine.processes import QuarantineRuns

log = logging.getLogger(__name__)

#: How often a process that enqueues for an agent it does not build reads the
#: agent again from the fleet's registry (seconds).
LEARN_EVERY = 10.0


class Stoppable(Protocol):
    """A background job the worker stops as it shuts down (its sweeper)."""

    def stop(self) -> None: ...


@dataclass
class ProcessState:
    """The process's settings, app and worker parts (one per process: :data:`PROCESS`)."""

    #: The settings the app was made with; ``None`` until configured, or when
    #: the environment's are invalid (then :attr:`settings_error` says why).
    settings: Settings | None = None
    settings_error: ValidationError | SettingsError | None = None
    #: The Celery app this process enqueues with, or its worker runs.
    app: Celery | None = None
    #: The worker's node name (``celery@host``), once its worker starts.
    node: str | None = None
    #: Runs this process carries at once on its loop when its worker's pool is
    #: the threads pool (which runs in this process); ``None``: one run per
    #: process (prefork children, solo) or no worker.
    slots: int | None = None
    #: The process's context for running requests (its runtime, its agents),
    #: made on first use and dropped when the settings change.
    context: WorkerContext | None = None
    #: The fleet's sweeper, when this worker runs one.
    sweeper: Stoppable | None = None
    admission: Admission | None = None
    #: The requests this worker's consumer received and has not started yet
    #: (held for a rate limit or an eta, or waiting for a free slot), by id.
    held: dict[str, Any] = field(default_factory=dict)
    #: The result backend that last answered a PING, and when (monotonic).
    backend_answered: tuple[object, float] | None = None
    #: The event loop the process's runs go on (a pool child's own).
    loop: ChildLoop = field(default_factory=ChildLoop)
    #: Connections to the ledger for enqueues, cancels and the worker's
    #: short ledger writes.
    enqueue: EnqueuePool = field(default_factory=EnqueuePool)
    #: The requests this process runs alone.
    quarantine: QuarantineRuns = field(default_factory=QuarantineRuns)
    #: Held while the app is made or replaced.
    lock: threading.RLock = field(default_factory=threading.RLock)
    #: Agents this process enqueues for without their code: when each is read
    #: again from the fleet's registry (monotonic), and the registry's names.
    fleet_checked: dict[str, float] = field(default_factory=dict)
    fleet_names: list[str] = field(default_factory=list)
    #: The queues of its agents' versions this worker takes messages from
    #: (``None``: not yet).
    version_queues: list[str] | None = None
    #: The settings whose limits and weights this process declared to the
    #: fleet (at its first enqueue with them).
    limits_declared: Settings | None = None
    #: How this worker process publishes the requests whose fair turn came, in
    #: batches from its loop: set once by the Celery binding as the worker boots
    #: (``None``: no worker; a run's end hands them to its caller). Each context
    #: the process makes is given it.
    publish_turns: Callable[[list[Pending]], None] | None = None

    def current_settings(self) -> Settings:
        """The settings the app runs with (raises if the environment's are invalid)."""
        if self.settings is None:
            if self.settings_error is None:
                raise InvalidInput(
                    "loomflow_worker.tasks is not configured yet: call "
                    "loomflow_worker.tasks.configure() or loomflow_worker.tasks.settings() first"
                )
            raise InvalidInput(
                "the LOOMFLOW_WORKER_* settings are invalid: "
                + validation_message(self.settings_error)
            )
        return self.settings

    def current_app(self) -> Celery:
        """The app this process enqueues with, or its worker runs."""
        if self.app is None:
            raise InvalidInput(
                "loomflow_worker.tasks has no app yet: call loomflow_worker.tasks.configure() "
                "or use loomflow_worker.tasks.app first"
            )
        return self.app

    def database(self) -> tuple[str, int]:
        """The ledger's connection string and connect timeout, as the enqueue pool takes them."""
        current = self.current_settings()
        return current.database_url.get_secret_value(), current.connect_timeout

    def ledger_connection(self) -> AbstractContextManager[psycopg.Connection[Any]]:
        """A connection to the ledger from the enqueue pool."""
        return self.enqueue.connection(*self.database())

    def learn_agent(self, agent: object) -> list[str] | None:
        """For an enqueue of ``agent``: ``None`` when this process registered it
        (its own registration applies); else the names of the agents the
        fleet's workers recorded, after reading ``agent`` from their registry
        (``worker_agents``; again at most every LEARN_EVERY seconds), so that a
        process enqueues with ``loomflow_worker`` and the database alone."""
        if not isinstance(agent, str) or agent_registered(agent):
            return None
        now = time.monotonic()
        if now >= self.fleet_checked.get(agent, 0.0):
            with self.ledger_connection() as conn:
                found, self.fleet_names = ledger.fleet_agent(conn, agent)
            learn_fleet_agent(agent, found)
            self.fleet_checked[agent] = now + LEARN_EVERY
        return self.fleet_names

    def declare_limits(self) -> None:
        """Before this process's first enqueue with its settings: declare the
        concurrency limits and fairness weights they give to the fleet
        (:mod:`~loomflow_worker.execution.limits` says which source wins), so
        they hold from the first request, before any worker started."""
        current = self.current_settings()
        if self.limits_declared is current:
            return
        if current.limits or current.fairness_weights or current.budgets:
            try:
                with self.ledger_connection() as conn:
                    limits.declare(conn, current, ledger.worker_name(
                        self.node or socket.gethostname(), os.getpid()))
            except psycopg.Error as exc:
                # The enqueue goes on (and says what is wrong with the database
                # if it is); the next one declares them again.
                log.warning("could not declare this process's LIMITS and FAIRNESS_WEIGHTS "
                            "to the fleet: %s", exc, extra={"action": "limits_declare"})
                return
            ledger.HOLD_LIMITS.forget()
            budgets.REFUSING.forget()
        self.limits_declared = current

    def worker_context(self) -> WorkerContext:
        """The process's context for running requests, made on first use."""
        if self.context is None:
            current = self.current_settings()
            import_agent_modules(current.agents)
            self.context = WorkerContext(current, slots=self.slots or 1, node=self.node,
                                         publish_turns=self.publish_turns)
        return self.context

    @property
    def runs_here(self) -> bool:
        """Whether this worker's pool (the threads pool) runs in this process."""
        return self.slots is not None


#: This process's state.
PROCESS = ProcessState()
