"""The Celery app, its configuration, and the ``run_agent`` / ``resume_agent`` tasks.

Importing the package defines :data:`app`, :data:`run_agent` and
:data:`resume_agent` and nothing else: the app is made on first use, from
the environment's settings (``celery -A loomflow_worker.tasks`` uses it at
start), or by :func:`configure` with settings of the caller's."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from celery import Celery
from celery.local import Proxy
from kombu import pools as kombu_pools
from pydantic import ValidationError
from pydantic_settings import SettingsError

from ..execution import ledger
from ..settings import Settings
from ..worker.state import PROCESS
from .broker import AMQP
from .dispatch import RESUME_AGENT, RUN_AGENT
from .perform import ResumeAgentTask, RunAgentTask, _resume_agent, _run_agent
from .task import AgentTask

__all__ = ["RESUME_AGENT", "RUN_AGENT", "AgentTask", "app", "configure", "current_app",
           "make_app", "resume_agent", "run_agent", "settings"]

#: A worker's result backend gives up storing a result after about two
#: seconds (Celery's default retries for twenty): the ledger has the result,
#: and the sweeper stores it once the backend is back.
STORE_RETRY = {"max_retries": 3, "interval_start": 0.2, "interval_step": 0.4,
               "interval_max": 1.0}


class LoomflowCelery(Celery):  # type: ignore[misc]
    """A Celery app whose worker skips the soft shutdown when idle
    (:class:`~.worker.Worker`, imported only by a worker)."""

    @cached_property
    def Worker(self) -> Any:
        return self.subclass_with_self("loomflow_worker.worker.celery_worker:Worker")


def settings() -> Settings:
    """The settings the app runs with (raises if the environment's are invalid)."""
    _configured()
    return PROCESS.current_settings()


def current_app() -> Celery:
    """The app this process enqueues with, or its worker runs."""
    _configured()
    return PROCESS.current_app()


def configure(new: Settings | None = None) -> Settings:
    """Point this process at ``new`` settings (default: read the environment again).

    A worker configures once, from the environment, when Celery first uses
    the app. A process that enqueues for several fleets in turn (tests, the
    demo, benchmarks) gets a new Celery app for each, made by
    :func:`make_app`; :data:`app`, :data:`run_agent` and :data:`resume_agent`
    always lead to the current one. The one before is closed, and kombu's
    pools of broker connections with it. Settings equal to the current ones
    keep the current app: configuring twice is configuring once."""
    with PROCESS.lock:
        new = new or Settings()
        if PROCESS.app is not None and new == PROCESS.settings:
            return new
        PROCESS.settings, PROCESS.settings_error, PROCESS.context = new, None, None
        _use(make_app(new))
        PROCESS.enqueue.close()
        # The limits enqueues withhold requests on were read from the fleet
        # before's database: the next enqueue reads this one's.
        ledger.HOLD_LIMITS.forget()
        return new


def _configured() -> None:
    """Configure this process from the environment unless something did.
    Settings the environment gets wrong do not raise here (the CLI's doctor
    reports them): the app is Celery's defaults, and :func:`settings` raises."""
    if PROCESS.app is not None:
        return
    with PROCESS.lock:
        if PROCESS.app is not None:
            return
        try:
            configure()
        except (ValidationError, SettingsError) as exc:
            PROCESS.settings_error = exc
            _use(make_app(None))


def make_app(new: Settings | None) -> Celery:
    """A Celery app on ``new`` settings (Celery's defaults when ``None``: the
    environment's are invalid), with the ``run_agent`` and ``resume_agent``
    tasks."""
    made = LoomflowCelery("loomflow_worker", amqp=AMQP)
    if new is not None:
        made.conf.update(_celery_settings(new))
    made.task(bind=True, base=RunAgentTask, name=RUN_AGENT)(_run_agent)
    made.task(bind=True, base=ResumeAgentTask, name=RESUME_AGENT)(_resume_agent)
    return made


def _celery_settings(new: Settings) -> dict[str, Any]:
    transport: dict[str, Any] = {}
    if new.redis_key_prefix:
        transport["global_keyprefix"] = new.redis_key_prefix
    broker_options = {**new.broker_transport_options, **transport}
    if new.is_redis_broker:
        broker_options["visibility_timeout"] = new.visibility_timeout
    return {
        "broker_url": new.broker_url.get_secret_value(),
        "result_backend": new.result_backend.get_secret_value(),
        "broker_transport_options": broker_options,
        # Only workers store results (callers read them): the retries are theirs.
        "result_backend_transport_options": {**transport, "retry_policy": STORE_RETRY},
        "task_default_queue": new.queue,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_prefetch_multiplier": 1,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "broker_connection_retry_on_startup": True,
        "imports": list(new.agents),
        "worker_hijack_root_logger": False,
        "worker_soft_shutdown_timeout": new.soft_shutdown_timeout,
        # Messages held for an eta are requeued cleanly; an idle worker
        # skips the wait all the same (see .worker).
        "worker_enable_soft_shutdown_on_idle": True,
    }


def _use(made: Celery) -> None:
    """Make ``made`` the app of this process, closing the one before.

    A prefork child never uses the broker connections its parent opened:
    the app registers Celery's own after-fork hook with billiard when its
    pool is first used, which drops its connection and producer pools in
    the child; redis-py's clients (the result backend) and the enqueue pool
    check their process id."""
    previous = PROCESS.app
    PROCESS.app = made
    made.set_current()
    if previous is not None:
        previous.close()
        # kombu keeps connection and producer pools per connection in
        # process-wide groups: close them, so no socket of the closed app
        # stays open.
        kombu_pools.reset()  # type: ignore[no-untyped-call]


#: The current app (``celery -A loomflow_worker.tasks`` finds it here).
app = Proxy(current_app)
#: The current app's tasks.
run_agent = Proxy(lambda: current_app().tasks[RUN_AGENT])
resume_agent = Proxy(lambda: current_app().tasks[RESUME_AGENT])
