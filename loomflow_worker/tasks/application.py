"""The Celery app, its defaults, and the ``run_agent`` / ``resume_agent`` tasks."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import json
import logging
import math
import os
import threading
import time
import uuid
from datetime import datetime
from typing import Any

import psycopg
from celery import Celery, Task
from celery.exceptions import Ignore, Reject, SoftTimeLimitExceeded, TimeLimitExceeded
from celery.local import Proxy
from celery.result import AsyncResult, task_join_will_block
from celery.signals import (
    task_received,
    task_revoked,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)
from celery.utils.time import maybe_make_aware
from kombu import pools as kombu_pools
from kombu.utils import json as kombu_json
from pydantic import ValidationError
from pydantic_settings import SettingsError

from .. import metrics
from ..execution import ledger
from ..execution.errors import AttemptLost, DiedAlone, RunCancelled, RunDead, RunFailed
from ..execution.execute import Outcome, WorkerContext, execute
from ..execution.ledger import ON_BUSY, EnqueuePool, OnBusy, Pending, StartAt
from ..execution.registry import DEFAULT_AGENT, import_agent_modules
from ..execution.request import Kind, check_request
from ..runtime.errors import (
    DatabaseUnavailable,
    InvalidInput,
    LockLost,
    LoomflowWorkerError,
    SessionPooler,
)
from ..runtime.sql import query
from ..runtime.store import probe
from ..runtime.validate import check_id
from ..settings import Settings, validation_message
from . import pool
from .admission import Admission
from .alone import run_alone
from .broker import AMQP
from .connections import bound_worker_connections
from .loop import ChildLoop
from .pool import REFUSED_POOLS, RunPool, pool_name, refused_threads_option
from .results import BackendMark, ResultRepair
from .sweeper import Sweeper

log = logging.getLogger("loomflow_worker.tasks")

#: How long past the run time limit a request running alone may take before
#: its process is stopped.
ALONE_GRACE = 60.0

#: How long a pool child that is exiting waits for its connections to close.
CLOSE_TIMEOUT = 5.0

#: A publish gives up after about a second: the ledger row is the record, and
#: the sweeper publishes a request whose message was lost.
DISPATCH_RETRY = {"max_retries": 2, "interval_start": 0.1, "interval_step": 0.3,
                 "interval_max": 0.5}

#: A worker's result backend gives up storing a result after about two
#: seconds (Celery's default retries for twenty): the ledger has the result,
#: and the sweeper stores it once the backend is back.
STORE_RETRY = {"max_retries": 3, "interval_start": 0.2, "interval_step": 0.4,
               "interval_max": 1.0}

_state: dict[str, Any] = {}
_loop = ChildLoop()
_enqueue = EnqueuePool()


def settings() -> Settings:
    """The settings the app runs with (raises if the environment's are invalid)."""
    current: Settings | None = _state.get("settings")
    if current is None:
        raise InvalidInput(
            "the LOOMFLOW_WORKER_* settings are invalid: "
            + validation_message(_state["settings_error"])
        )
    return current


def configure(new: Settings | None = None) -> Settings:
    """Point this process at ``new`` settings (default: read the environment again).

    A worker configures once, at import. A process that enqueues for several
    fleets in turn (tests, the demo, benchmarks) gets a new Celery app for
    each, made by :func:`make_app`; :data:`app`, :data:`run_agent` and
    :data:`resume_agent` always lead to the current one. The one before is
    closed, and kombu's pools of broker connections with it."""
    new = new or Settings()
    _state["settings"] = new
    _state.pop("context", None)
    _use(make_app(new))
    _enqueue.close()
    return new


def make_app(new: Settings | None) -> Celery:
    """A Celery app on ``new`` settings (Celery's defaults when ``None``: the
    environment's are invalid), with the ``run_agent`` and ``resume_agent``
    tasks."""
    made = Celery("loomflow_worker", amqp=AMQP)
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
        "worker_enable_soft_shutdown_on_idle": True,
    }


def _use(made: Celery) -> None:
    """Make ``made`` the app of this process, closing the one before.

    A prefork child never uses the broker connections its parent opened:
    the app registers Celery's own after-fork hook with billiard when its
    pool is first used, which drops its connection and producer pools in
    the child; redis-py's clients (the result backend) and the enqueue pool
    check their process id."""
    previous: Celery | None = _state.get("app")
    _state["app"] = made
    made.set_current()
    if previous is not None:
        previous.close()
        # kombu keeps connection and producer pools per connection in
        # process-wide groups: close them, so no socket of the closed app
        # stays open.
        kombu_pools.reset()  # type: ignore[no-untyped-call]


def current_app() -> Celery:
    """The app this process enqueues with, or its worker runs."""
    made: Celery = _state["app"]
    return made


RUN_AGENT = "loomflow_worker.run_agent"
RESUME_AGENT = "loomflow_worker.resume_agent"

#: The current app (``celery -A loomflow_worker.tasks`` finds it here).
app = Proxy(current_app)
#: The current app's tasks.
run_agent = Proxy(lambda: current_app().tasks[RUN_AGENT])
resume_agent = Proxy(lambda: current_app().tasks[RESUME_AGENT])


def _context() -> WorkerContext:
    ctx: WorkerContext | None = _state.get("context")
    if ctx is None:
        import_agent_modules(settings().agents)
        ctx = WorkerContext(settings(), slots=_state.get("slots", 1), node=_state.get("node"))
        _state["context"] = ctx
    return ctx


@worker_init.connect
def _prepare_worker(sender: Any = None, **_: Any) -> None:
    """Check the settings and the pool. The threads pool carries ``-c`` runs
    on the process's event loop (and becomes :class:`~.pool.RunPool`, whose
    runs can be stopped one by one, and refuses the options that only make
    sense for child processes); prefork and solo run one per process; gevent
    and eventlet would block their hub with the loop's thread, so the worker
    refuses them."""
    try:
        settings()
    except InvalidInput as exc:
        # A worker on settings it can't use would serve nobody (and Celery's
        # defaults would point it at another broker): it does not start.
        log.critical("%s; the worker does not start", exc)
        raise SystemExit(2) from None
    if sender is not None:
        # The node name its runs and its processes' rows in `workers` carry.
        _state["node"] = getattr(sender, "hostname", None)
        name = pool_name(sender.pool_cls)
        if name in REFUSED_POOLS:
            raise SystemExit(
                f"loomflow-worker: the {name} pool is not supported: a worker process carries "
                "its runs on one asyncio event loop, which the threads pool feeds. Start it "
                "with `loomflow-worker worker` (threads, LOOMFLOW_WORKER_CONCURRENCY runs per "
                "process) or `celery ... worker -P threads -c 100`."
            )
        if name == "threads":
            refused = refused_threads_option(sender)
            if refused is not None:
                raise SystemExit(refused)
            sender.pool_cls = RunPool
            _state["slots"] = int(sender.concurrency or 1)
    if settings().metrics_port:
        metrics.prepare_multiprocess_dir()
    # A few connections to Redis and the broker, whatever the concurrency.
    bound_worker_connections(current_app())
    _refuse_session_pooler(settings())


def _refuse_session_pooler(current: Settings) -> None:
    """A worker behind a transaction- or statement-mode pooler would take its
    session locks on borrowed server sessions and stall: it does not start.
    A database that is down now is no reason not to start (runs wait for it)."""
    try:
        asyncio.run(probe(current.database_url.get_secret_value(), current.connect_timeout))
    except SessionPooler as exc:
        log.critical("%s; the worker does not start", exc)
        raise SystemExit(2) from None
    except LoomflowWorkerError as exc:
        log.warning("%s; the worker starts and connects when a run comes", exc)


@worker_process_init.connect
def _open_child(**_: Any) -> None:
    if settings().metrics_port:
        metrics.setup()
    try:
        _loop.run(_context().runtime())
    except Exception:
        log.exception("pool child could not connect to Postgres yet; will retry per task")


@worker_process_shutdown.connect
def _close_child(**_: Any) -> None:
    ctx: WorkerContext | None = _state.pop("context", None)
    if ctx is not None and _loop.running:
        try:
            _loop.run(ctx.aclose(), timeout=CLOSE_TIMEOUT)
        except Exception:
            # Bounded: a child that cannot close cleanly still exits, and
            # Postgres frees whatever its connections held.
            log.exception("closing the pool child's connections failed")
    _loop.stop()
    if metrics.enabled():
        metrics.process_exited(os.getpid())


def _queue_lengths(names: list[str]) -> dict[str, int | None]:
    """Messages waiting in each of these queues, as the broker counts them
    (``None``: the broker did not say)."""
    # Declared as the workers declare them (idempotent), not passively: kombu's
    # passive declare on Redis looks a queue up without the global key
    # prefix, so with REDIS_KEY_PREFIX it would always find it missing.
    counts: dict[str, int | None] = dict.fromkeys(names)
    with app.pool.acquire(block=True, timeout=5) as conn:
        for name in names:
            queue = app.amqp.queues[name]
            try:
                counts[name] = int(queue.bind(conn.default_channel).queue_declare().message_count)
            except Exception as exc:
                log.warning("sweeper: could not count the messages of queue %s: %s", name, exc,
                            extra={"action": "sweeper_count", "queue": name})
    return counts


def _queue_length() -> int:
    """Messages waiting in the default queue, as the broker counts them."""
    name = settings().queue
    count = _queue_lengths([name])[name]
    if count is None:
        raise ConnectionError(f"the broker did not count the messages of queue {name}")
    return count


#: The requests this worker's consumer received and has not started yet
#: (held for a rate limit or an eta, or waiting for a free slot), by id.
_held: dict[str, Any] = {}


@task_received.connect
def _note_received(request: Any = None, **_: Any) -> None:
    """A request's message reached this worker: until it starts, the sweeper
    hears from this worker that it holds it (see :func:`_stamp_held`)."""
    if request is not None and getattr(request, "name", None) in (RUN_AGENT, RESUME_AGENT):
        _held[request.id] = request


def _stamp_held(conn: psycopg.Connection[Any]) -> int:
    """Stamp the requests this worker holds, received and not started (those
    that started or ended are forgotten), in the ledger; one sent by name,
    which the ledger does not have yet, is recorded first, with the eta and
    queue of its message. Returns how many it holds."""
    for request_id, request in list(_held.items()):
        if request.time_start is not None or request.acknowledged:
            _held.pop(request_id, None)
    request_ids = list(_held)
    if not request_ids:
        return 0
    stamped = ledger.mark_held(conn, request_ids)
    if len(stamped) < len(request_ids):
        # Some are not queued in the ledger: started since, or sent by name.
        arrived = [request_id for request_id in ledger.unknown(
            conn, [i for i in request_ids if i not in stamped]) if request_id in _held]
        for request_id in arrived:
            _record_arrived(conn, _held[request_id])
        if arrived:
            ledger.mark_held(conn, arrived)
    return len(request_ids)


def _record_arrived(conn: psycopg.Connection[Any], request: Any) -> None:
    """Record a received request the ledger does not have (sent by name). Its
    input is checked when it runs: one a worker refuses is left to that."""
    task: AgentTask = current_app().tasks[request.name]
    try:
        checked = check_request(settings(), kind=task.kind,
                                **task._bind(request.args, request.kwargs))
    except (InvalidInput, TypeError):
        return
    ledger.record_arrived(conn, request.id, checked, _arrival(request))


def _results_missing(request_ids: list[str]) -> set[str]:
    """Which of these finished requests have no outcome in the result backend:
    on Redis, one pipelined ``EXISTS`` per request (nothing read back), one
    round trip for the lot."""
    from celery.backends.redis import RedisBackend

    backend = app.backend
    if isinstance(backend, RedisBackend):
        with backend.client.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.exists(backend.get_key_for_task(request_id))
            found = pipe.execute()
        return {rid for rid, exists in zip(request_ids, found, strict=True) if not exists}
    return {rid for rid in request_ids if backend.get_state(rid) == "PENDING"}


def _store_result(request_id: str, status: str, result: Any, error: str | None,
                  age: float = 0.0) -> bool:
    """Store a finished request's outcome, as the ledger has it, in the result
    backend, for what is left of its lifetime (``result_expires``, or
    ``result_failure_expires``, from when it ended, ``age`` seconds ago); none
    left: nothing stored, ``False``."""
    from celery.backends.redis import RedisBackend

    backend = app.backend
    state = "SUCCESS" if status == "succeeded" else "FAILURE"
    lifetime = _result_lifetime(state)
    left = lifetime - age if lifetime else None
    if left is not None and left <= 0:
        return False
    if state == "SUCCESS":
        backend.store_result(request_id, result, state)
    else:
        failure = {"dead": RunDead, "cancelled": RunCancelled}.get(status, RunFailed)
        backend.store_result(request_id, failure(error or status), state)
    if left is not None and isinstance(backend, RedisBackend):
        # Stored for a whole lifetime: it ends when the one it was stored for would.
        backend.expire(backend.get_key_for_task(request_id), max(1, math.ceil(left)))
    return True


def _result_lifetime(state: str | None = None) -> float | None:
    """How long the result backend keeps a result of ``state`` (``None``: the
    longer of a success's and a failure's), in seconds; ``None``: for ever."""
    backend = app.backend
    success = float(backend.expires or 0)
    failure = float(getattr(backend, "failure_expires", success) or 0)
    lifetimes = [success, failure] if state is None else [
        failure if state == "FAILURE" else success]
    return None if 0 in lifetimes else max(lifetimes)


def _probe_result_backend(token: str, stamp: float) -> BackendMark | None:
    """Read the mark the sweeper left in the result backend under ``token``,
    leave ``stamp`` in its place, and read how many keys the server has
    evicted: one round trip. ``None`` for a backend other than Redis."""
    from celery.backends.redis import RedisBackend

    backend = app.backend
    if not isinstance(backend, RedisBackend):
        return None
    key = f"{settings().redis_key_prefix}loomflow-worker:result-mark:{token}"
    with backend.client.pipeline(transaction=False) as pipe:
        pipe.get(key)
        pipe.set(key, repr(stamp))
        pipe.info("stats")
        found, _, stats = pipe.execute()
    evicted = stats.get("evicted_keys") if isinstance(stats, dict) else None
    return BackendMark(None if found is None else float(found),
                       None if evicted is None else int(evicted))


@worker_ready.connect
def _start_sweeper(sender: Any = None, **_: Any) -> None:
    if settings().metrics_port:
        metrics.setup()
        metrics.serve(settings().metrics_port)
    if "slots" in _state:
        if sender is not None and getattr(sender, "qos", None) is not None:
            _admit(sender)
        # The threads pool runs in this process: connect (and migrate) now.
        try:
            _loop.run(_context().runtime())
        except Exception:
            log.exception("the worker could not connect to Postgres yet; will retry per task")
    if settings().sweeper:
        sweeper = Sweeper(settings(), _dispatch_many, _queue_lengths,
                          ResultRepair(_results_missing, _store_result,
                                       _probe_result_backend, _result_lifetime()),
                          revoked=_end_revoked_requests, held=_stamp_held)
        _state["sweeper"] = sweeper
        sweeper.start()


def _admit(consumer: Any) -> None:
    """Let the process's load decide when its consumer takes messages."""
    from celery.worker import state as worker_state

    ctx, current = _context(), settings()
    admission = Admission(
        consumer.qos,
        ceiling=int(_state["slots"]) * max(1, int(consumer.prefetch_multiplier or 1)),
        lag_limit=current.admission_lag,
        queue_limit=current.admission_queue,
        queue_depth=ctx.queue_depth,
        in_flight=lambda: len(worker_state.reserved_requests),
    )
    ctx.watch_observers.append(admission.observe)
    ctx.admitting = lambda: admission.admitting
    _state["admission"] = admission


#: How long a request Celery ended from outside (revoked, or killed at its hard
#: time limit) whose attempt still holds its scope is waited for (its worker
#: stops it at its next step, or dies of the terminate or the kill).
REVOKE_WAIT = 15.0


@task_revoked.connect
def _revoked(request: Any = None, expired: bool = False, **_: Any) -> None:
    """Celery revoked a request, or let it expire: the ledger ends it
    (``cancelled`` or ``expired``) and its session moves on, rather than
    waiting for a message every worker now discards."""
    name = getattr(request, "task", None)
    if getattr(name, "name", name) not in (run_agent.name, resume_agent.name):
        return
    _end_revoked_soon(str(request.id), ledger.EXPIRED if expired else ledger.REVOKED)


def _end_revoked_soon(request_id: str, how: ledger.OutsideEnding) -> None:
    """:func:`_end_revoked` in a thread of its own: it may wait for the lock."""
    threading.Thread(
        target=_end_revoked, args=(request_id, how), daemon=True,
        name=f"loomflow-worker revoke {request_id}",
    ).start()


def _end_revoked(request_id: str, how: ledger.OutsideEnding) -> None:
    current = settings()
    deadline = time.monotonic() + REVOKE_WAIT
    while True:
        try:
            with _enqueue.pool(
                current.database_url.get_secret_value(), current.connect_timeout
            ).connection(timeout=current.connect_timeout) as conn:
                done, handoff = ledger.end_revoked(conn, request_id, how)
        except psycopg.Error:
            log.warning("could not end %s request %s in the ledger yet", how.name, request_id,
                        exc_info=True, extra={"action": "revoke", "request": request_id})
            done, handoff = False, None
        if done:
            log.info("request %s %s", request_id, how.name,
                     extra={"action": how.name.replace(" ", "_"), "request": request_id})
            for pending in handoff.dispatch if handoff is not None else []:
                _dispatch_recorded(pending, "handed the session")
            return
        if time.monotonic() > deadline:
            log.warning("%s request %s: its attempt still holds the session after %gs; "
                        "it stops at its next step", how.name, request_id, REVOKE_WAIT,
                        extra={"action": "revoke", "request": request_id})
            return
        time.sleep(0.2)


def _end_revoked_requests(request_ids: list[str]) -> None:
    """The sweeper's share: requests revoked while their message waits in the
    broker (a worker learns of a revoke at once, of the message only when it
    comes) end now."""
    for request_id in request_ids:
        _end_revoked_soon(request_id, ledger.REVOKED)


def _stop_run(request_id: str) -> bool:
    """Stop one run of this process: a revoked one ends ``cancelled`` at once
    (``revoke(terminate=True)``), any other (a shutdown) is interrupted and
    requeued."""
    from celery.worker import state

    ctx: WorkerContext | None = _state.get("context")
    if request_id in state.revoked and ctx is not None and _loop.running:
        _loop.loop.call_soon_threadsafe(ctx.halt, request_id, "revoked (Celery revoke)")
        return True
    return _loop.cancel(request_id)


pool.stop_run = _stop_run


@worker_shutting_down.connect
def _mark_interrupted(sender: str | None = None, **_: Any) -> None:
    """A deploy: the runs this worker stops were interrupted, not crashed."""
    if not sender:
        return
    current = settings()
    try:
        with psycopg.connect(
            current.database_url.get_secret_value(), autocommit=True,
            connect_timeout=current.connect_timeout,
        ) as conn:
            conn.execute(query("mark_interrupted"), {"node": f"{sender}:"})
    except psycopg.Error:
        log.warning("could not mark this worker's runs interrupted", exc_info=True)


@worker_shutdown.connect
def _stop_sweeper(sender: Any = None, **_: Any) -> None:
    sweeper: Sweeper | None = _state.pop("sweeper", None)
    if sweeper is not None:
        sweeper.stop()
    if "slots" in _state:
        _close_child()  # the threads pool ran in this process
    # Once more now that the pool is gone: an attempt started during the
    # soft shutdown was interrupted too.
    _mark_interrupted(getattr(sender, "hostname", None))


class _ResultStore:
    """The result backend as a worker's task stores its outcome: a result the
    backend refuses (it is down) is recorded in the ledger as not stored, for
    the sweeper to store once the backend is back, instead of the task failing
    and Celery storing the ``ConnectionError`` in the result's place. A retry
    whose RETRY state it refuses goes on without it: the state only informs
    (the ledger holds the retry), and Celery would report the retry's
    ``ConnectionError`` as an error of the request."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def mark_as_done(self, task_id: str, *args: Any, **kwargs: Any) -> None:
        self._store(self._backend.mark_as_done, task_id, *args, **kwargs)

    def mark_as_failure(self, task_id: str, *args: Any, **kwargs: Any) -> None:
        self._store(self._backend.mark_as_failure, task_id, *args, **kwargs)

    def mark_as_retry(self, task_id: str, *args: Any, **kwargs: Any) -> None:
        try:
            self._backend.mark_as_retry(task_id, *args, **kwargs)
        except _backend_errors(self._backend) as exc:
            log.warning("request %s: the result backend refused its RETRY state (%s); "
                        "the retry goes on", task_id, exc,
                        extra={"action": "retry_state_unstored", "request": task_id})

    def _store(self, store: Any, task_id: str, *args: Any, **kwargs: Any) -> None:
        try:
            store(task_id, *args, **kwargs)
        except _backend_errors(self._backend) as exc:
            current = settings()
            marked = _enqueue.mark_result_unstored(
                current.database_url.get_secret_value(), current.connect_timeout, task_id
            )
            log.warning(
                "request %s: the result backend refused its result (%s); %s", task_id, exc,
                "the sweeper stores it from the runs ledger once the backend is back" if marked
                else "the ledger could not record that either; the sweeper's check of recent "
                "results stores it",
                extra={"action": "result_deferred", "request": task_id},
            )
            return
        ctx: WorkerContext | None = _state.get("context")
        if ctx is not None:
            ctx.result_stored(task_id)


def _backend_errors(backend: Any) -> tuple[type[BaseException], ...]:
    """What storing a result raises when the result backend can't be reached."""
    from celery.exceptions import BackendStoreError

    return (*_dispatch_errors(), *tuple(getattr(backend, "connection_errors", ())),
            BackendStoreError)


class AgentTask(Task):
    """``apply_async`` records the request in the ledger before publishing it."""

    kind: Kind = "run"
    acks_late = True
    reject_on_worker_lost = True
    max_retries = None
    typing = False  # arguments are checked by check_request, with clearer errors
    # A message whose body Celery can't unpack is dropped, not left to stop the worker.
    Strategy = "loomflow_worker.tasks.wire:strategy"

    def on_failure(
        self, exc: Exception, task_id: str, args: Any, kwargs: Any, einfo: Any
    ) -> None:
        """Celery's hard time limit killed the pool child running the request
        (this runs in the worker's main process): the ledger ends it ``failed``
        with ``TimeLimitExceeded`` as soon as its lock is free, and hands its
        session on, rather than the sweeper resuming it as a crash."""
        if isinstance(exc, TimeLimitExceeded):
            limit = exc.args[0] if exc.args and isinstance(exc.args[0], int | float) else 0
            _end_revoked_soon(task_id, ledger.killed_at_time_limit(float(limit)))

    @property
    def backend(self) -> Any:
        """The app's result backend; while a worker runs the task, one that
        defers a result it can't store to the sweeper (:class:`_ResultStore`)."""
        if self.request.called_directly:
            return self.app.backend
        return _ResultStore(self.app.backend)

    @functools.cached_property
    def _signature(self) -> inspect.Signature:
        # The task's own function (bound: without ``self``) says what it takes.
        return inspect.signature(self.run)

    def _bind(self, args: Any, kwargs: Any) -> dict[str, Any]:
        try:
            bound = self._signature.bind(*(args or ()), **(kwargs or {}))
        except TypeError as exc:
            raise InvalidInput(f"{self.name}: {exc}") from exc
        bound.apply_defaults()
        return dict(bound.arguments)

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        on_busy: OnBusy = "enqueue",
        **options: Any,
    ) -> AsyncResult:
        """Check the request, record it in the ledger, then publish it.

        ``on_busy`` says what to do when the session already has an
        unfinished request: ``"enqueue"`` (wait for its turn), ``"reject"``
        (raise :class:`SessionBusy`, nothing recorded) or ``"interrupt"``
        (cancel the earlier requests, then run this one)."""
        if task_id is not None and task_id == self.request.id and options.get("retries"):
            return self._publish_retry(args, kwargs, task_id, options)
        kwargs = dict(kwargs or {})
        on_busy = kwargs.pop("on_busy", on_busy)
        if on_busy not in ON_BUSY:
            raise InvalidInput(f"on_busy must be one of {', '.join(ON_BUSY)}, not {on_busy!r}")
        current = settings()
        import_agent_modules(current.agents)
        request = check_request(current, kind=self.kind, **self._bind(args, kwargs))
        if task_id:  # Celery's rule: an empty one means "make one"
            check_id("task_id", task_id)
        task_id = task_id or str(uuid.uuid4())
        start = _start_at(options.get("countdown"), options.get("eta"))
        enqueued = _enqueue.insert(
            current.database_url.get_secret_value(), current.connect_timeout, task_id, request,
            on_busy, start, ignore_result=bool(options.get("ignore_result", self.ignore_result)),
            routing=self._routing(request.task_args(), options),
        )
        if enqueued.duplicate:
            # The same request sent again under its id: it is recorded and was
            # published already, so this publishes nothing.
            return self.AsyncResult(task_id)
        # The request is accepted: its row is the record, and the sweeper
        # publishes a queued request whose message looks lost. A publish that
        # fails now is logged, not raised: the caller's handle is good, and a
        # caller retrying the enqueue under a new id would run it twice.
        task_args, task_kwargs = request.task_args()
        options.setdefault("retry_policy", DISPATCH_RETRY)
        if enqueued.not_before is not None:
            # The message's eta is the moment the ledger recorded, exactly.
            options.pop("countdown", None)
            options["eta"] = enqueued.not_before
        try:
            _check_result_backend()
            result = super().apply_async(task_args, task_kwargs, task_id=task_id, **options)
        except _dispatch_errors() as exc:
            _dispatch_deferred(task_id, "accepted", exc)
            result = self.AsyncResult(task_id)
        except RuntimeError as exc:
            # Celery's result consumer gave up reconnecting (Redis went away
            # after the check above).
            if not isinstance(exc.__cause__, _dispatch_errors()):
                raise
            _dispatch_deferred(task_id, "accepted", exc.__cause__)
            result = self.AsyncResult(task_id)
        for pending in enqueued.cancelled:
            _dispatch_recorded(pending, "cancelled")  # so its result is stored
        return result

    def _publish_retry(
        self, args: Any, kwargs: Any, task_id: str, options: dict[str, Any]
    ) -> AsyncResult:
        """Publish Celery's retry of the request this worker is running: the
        ledger rescheduled it already (queued, not before its countdown), so it
        is sent as it was received, not recorded again (which would find it a
        duplicate and publish nothing, leaving it to the sweeper)."""
        options = {"retry_policy": DISPATCH_RETRY, **options}
        try:
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        except _dispatch_errors() as exc:
            _dispatch_deferred(task_id, "queued for its retry", exc)
            return self.AsyncResult(task_id)

    def delay(self, *args: Any, **kwargs: Any) -> AsyncResult:
        return self.apply_async(args, kwargs)

    def _routing(
        self, task_args: tuple[tuple[Any, ...], dict[str, Any]], options: dict[str, Any]
    ) -> dict[str, Any]:
        """Where the request's messages go, as Celery's router sends its first
        (the call's ``queue``, else the app's ``task_routes``, else the default
        queue): the queue by name, and the exchange, routing key and priority
        the call or its route asked for."""
        asked = {k: v for k, v in options.items() if k in ROUTING and v is not None}
        routed = self.app.amqp.router.route(asked, self.name, *task_args)
        found: dict[str, Any] = {}
        for key in ROUTING:
            value = routed.get(key)
            if value is not None:
                found[key] = getattr(value, "name", value)  # a kombu Queue or Exchange
        return found

    def dispatch(self, pending: Pending, producer: Any = None) -> None:
        """Publish a request that already has its ledger row (a handoff, a
        redispatch) as its first message was: to its queue (its routing), with
        its eta, and with what that message carried once a worker took it (its
        chain, callbacks, chord and group, headers, priority, time limits), as
        Celery's retry would; with ``producer``, over its connection."""
        task_args, task_kwargs = pending.task_args()
        options = {**(pending.routing or {}), **(pending.options or {}),
                   "retry_policy": DISPATCH_RETRY}
        if pending.not_before is not None:
            options["eta"] = pending.not_before
        super().apply_async(task_args, task_kwargs, task_id=pending.request_id,
                            producer=producer, **options)


#: The ``apply_async`` options that say where a message goes.
ROUTING = ("queue", "exchange", "routing_key", "priority")

#: The longest countdown (or the farthest eta) the ledger accepts: ten years.
MAX_DELAY = 10 * 365 * 86400.0


def _start_at(countdown: Any, eta: Any) -> StartAt | None:
    """When a request may start, from ``apply_async``'s ``countdown`` or
    ``eta`` as Celery reads them: a countdown wins, zero or none means at once,
    a naive eta is in the app's timezone."""
    if countdown is not None:
        if (isinstance(countdown, bool) or not isinstance(countdown, int | float)
                or not math.isfinite(countdown) or abs(countdown) > MAX_DELAY):
            raise InvalidInput(
                f"countdown must be a number of seconds (up to {MAX_DELAY:.0f}), "
                f"not {countdown!r}"
            )
        if countdown > 0:
            return StartAt(countdown=float(countdown))
        if countdown < 0:
            return None  # in the past: at once, as Celery runs it
    if eta is None or eta == "":
        return None
    if isinstance(eta, str):
        try:
            eta = datetime.fromisoformat(eta)
        except ValueError:
            raise InvalidInput(
                f"eta {eta!r} is not an ISO 8601 date and time; pass a datetime"
            ) from None
    if not isinstance(eta, datetime):
        raise InvalidInput(f"eta must be a datetime, not {type(eta).__name__}")
    aware: datetime = maybe_make_aware(eta, app.conf.timezone)
    if abs((aware - datetime.now(aware.tzinfo)).total_seconds()) > MAX_DELAY:
        raise InvalidInput(f"eta {eta.isoformat()} is more than ten years away")
    return StartAt(eta=aware)


def _message_options(task: AgentTask, request: Any) -> dict[str, Any]:
    """What the request's message carried besides its arguments, rebuilt as
    Celery's own retry rebuilds it (``Task.signature_from_request``): its chain
    and callbacks, errbacks, chord and group membership, root and parent ids,
    headers, priority and routing, expiry and time limits. As JSON (kombu's,
    so what the message decoded to is encoded back the same way)."""
    options = task.signature_from_request(request).options
    kept = {k: v for k, v in options.items() if v is not None and k != "task_id"}
    plain: dict[str, Any] = json.loads(kombu_json.dumps(kept))  # type: ignore[no-untyped-call]
    return plain


def _dispatch(pending: Pending, producer: Any = None) -> None:
    (resume_agent if pending.kind == "resume" else run_agent).dispatch(pending, producer)


def _dispatch_many(pendings: list[Pending]) -> None:
    """Publish these requests' messages (a batch of the sweeper's) over one
    producer, on one broker connection acquired for the lot; on Redis in one
    round trip, where kombu has publish batches. The broker's error is raised,
    and then which of them went is unknown."""
    with app.producer_or_acquire() as producer:
        batch = getattr(producer, "batch", None)
        with batch() if batch is not None else contextlib.nullcontext():
            for pending in pendings:
                _dispatch(pending, producer)


def _dispatch_deferred(request_id: str, state: str, exc: BaseException) -> None:
    global _backend_answered
    _backend_answered = None  # the next enqueue checks the backend first
    log.warning(
        "request %s is %s (the runs ledger has it) but the broker refused its message (%s); "
        "a worker's sweeper takes it from the ledger once the broker is back",
        request_id, state, exc, extra={"action": "dispatch_deferred", "request": request_id},
    )
    current = settings()
    _enqueue.mark_undispatched(
        current.database_url.get_secret_value(), current.connect_timeout, request_id
    )


def _dispatch_recorded(pending: Pending, state: str) -> None:
    """Publish a request whose change the ledger committed: a broker that
    refuses it is logged, not raised (the change stands, and the sweeper
    carries it out)."""
    try:
        _dispatch(pending)
    except _dispatch_errors() as exc:
        _dispatch_deferred(pending.request_id, state, exc)


def cancel_run(request_id: str) -> str:
    """Cancel a request: a queued one never starts, a running one stops at its
    next step boundary; it ends ``cancelled`` and its session moves on.

    Returns the request's status now: ``"cancelled"``, or ``"running"`` /
    ``"queued"`` while the cancel takes effect, or the terminal status it
    had already reached."""
    check_id("request_id", request_id)
    current = settings()
    status, pending = _enqueue.cancel(
        current.database_url.get_secret_value(), current.connect_timeout, request_id
    )
    if status in ("cancelled", "queued"):
        # A worker picks it up now, stores its result and hands the session on.
        _dispatch_recorded(pending, f"{status} (cancel requested)")
    return str(status)


def cancel_queued(session_id: str | None = None, user_id: str | None = None) -> list[str]:
    """Drop waiting work: cancel every queued request (of ``session_id``, of
    ``user_id``, or of the whole fleet); returns their ids.

    Each ends ``cancelled`` in the ledger and never starts (one queued for a
    retry ends so when a worker next picks it up), and its session moves on.
    Their messages may stay on the broker: a worker that receives one finds
    it finished. This, not ``celery purge``, is how to drop work: the ledger
    is the queue of record, and the sweeper publishes again a queued request
    whose message was purged."""
    for what, value in (("session_id", session_id), ("user_id", user_id)):
        if value is not None:
            check_id(what, value)
    current = settings()
    found = _enqueue.cancel_queued(
        current.database_url.get_secret_value(), current.connect_timeout, session_id, user_id
    )
    for status, pending in found:
        if status == "queued":
            # Started before: a worker ends it cancelled and hands its session on.
            _dispatch_recorded(pending, "queued (cancel requested)")
    return [pending.request_id for _, pending in found]


#: How long a result backend that answered a PING is taken to be up: enqueues
#: within it send none.
BACKEND_CHECK_EVERY = 1.0
# The backend that last answered, and when (a publish that fails forgets it).
_backend_answered: tuple[object, float] | None = None


def _check_result_backend() -> None:
    """Raise a connection error at once when the result backend's Redis is down.

    Before publishing, Celery subscribes the caller to the request's result
    on Redis, retrying for about 19 seconds when Redis is down and then
    giving up with an anonymous ``RuntimeError``. One ``PING`` (a fraction of a
    millisecond) finds out first, at most once every BACKEND_CHECK_EVERY
    seconds: a Redis that goes away in between is met by that retry, whose
    error ``apply_async`` also turns into a deferred dispatch. Pool children
    do not subscribe."""
    global _backend_answered
    from celery.backends.redis import RedisBackend

    backend = app.backend
    if not isinstance(backend, RedisBackend) or task_join_will_block():
        return
    now = time.monotonic()
    answered = _backend_answered
    if answered is not None and answered[0] is backend and now - answered[1] < BACKEND_CHECK_EVERY:
        return
    backend.client.ping()
    _backend_answered = (backend, now)


def _dispatch_errors() -> tuple[type[BaseException], ...]:
    """What a publish raises when the broker can't be reached."""
    import kombu.exceptions
    import redis

    return (kombu.exceptions.OperationalError, redis.ConnectionError, redis.TimeoutError,
            ConnectionError, TimeoutError)


#: How long a worker whose attempt lost its database connection tries to record
#: it (a Postgres restart takes seconds) before the request runs again.
MARK_LOST_WITHIN = 30.0


def _mark_lost(lost: AttemptLost) -> None:
    """Record, before the request runs again, that its attempt was lost by a
    worker that lived, so the next attempt does not count a crash. Bounded:
    past MARK_LOST_WITHIN the request goes on, and this attempt counts as one."""
    current = settings()
    deadline = time.monotonic() + MARK_LOST_WITHIN
    pause = 0.2
    while True:
        try:
            with _enqueue.pool(
                current.database_url.get_secret_value(), current.connect_timeout
            ).connection(timeout=current.connect_timeout) as conn:
                ledger.mark_lost(conn, lost.request_id, lost.attempt, lost.holder)
            return
        except (psycopg.Error, TimeoutError):
            if time.monotonic() + pause > deadline:
                log.warning("request %s: could not record attempt %s as lost",
                            lost.request_id, lost.attempt,
                            extra={"action": "retry", "request": lost.request_id})
                return
            time.sleep(pause)
            pause = min(pause * 2, 2.0)


def _call_time_limit(task: AgentTask) -> float | None:
    """The run's time limit from ``apply_async(time_limit=..., soft_time_limit=...)``:
    the soft limit, else a moment before the hard one, so that the run ends
    ``failed`` with ``TimeLimitExceeded`` before Celery would kill its process
    (which would count as a crash and resume it)."""
    hard, soft = (*(task.request.timelimit or ()), None, None)[:2]
    if soft:
        return float(soft)
    if hard:
        return max(float(hard) - min(1.0, 0.1 * float(hard)), 0.1)
    return None


def _soft_time_limit(request_id: str, exc: BaseException) -> bool:
    """Celery's soft time limit fired in this pool child (prefork, as a signal
    raising ``SoftTimeLimitExceeded`` wherever the task is): the run ends as
    past its own time limit, ``failed`` and handed on, rather than being
    cancelled mid-attempt (which would leave it for the sweeper to resume
    without its limits). ``True`` when ``exc`` is that limit."""
    if not isinstance(exc, SoftTimeLimitExceeded):
        return False
    ctx: WorkerContext | None = _state.get("context")
    if ctx is not None and _loop.running:
        _loop.loop.call_soon_threadsafe(
            functools.partial(ctx.halt, request_id, "soft time limit", timed_out=True))
    log.info("request %s: Celery's soft time limit; the run ends past its time limit",
             request_id, extra={"action": "time_limit", "request": request_id})
    return True


def _perform(task: AgentTask, args: dict[str, Any]) -> Any:
    if task.request.called_directly:
        raise InvalidInput(
            f"{task.name} was called directly, which skips the runs ledger; enqueue the "
            f"request with {task.name.rsplit('.', 1)[-1]}.delay(...) or .apply_async(...) "
            "and wait for it with .get() on the handle they return"
        )
    request_id = task.request.id
    try:
        outcome = _attempt(task, request_id, args)
        if outcome.kind == "quarantine":
            outcome = run_alone(
                request_id, args, task.kind, task.request.hostname or _context().node,
                time_limit=_call_time_limit(task),
                options=_message_options(task, task.request),
                timeout=settings().run_time_limit + ALONE_GRACE,
            )
            if outcome.kind == "handed_back":
                outcome = _attempt(task, request_id, args)
            if outcome.kind in ("quarantine", "handed_back"):
                raise task.retry(countdown=_context().backoff(task.request.retries + 1))
    except DiedAlone as exc:
        # Its own death: the next attempt (alone again) counts the crash.
        countdown = _context().backoff(task.request.retries + 1)
        log.warning("request %s died running alone (%s); retrying in %.1fs", request_id, exc,
                    countdown, extra={"action": "retry", "request": request_id})
        raise task.retry(exc=exc, countdown=countdown) from exc
    except (concurrent.futures.CancelledError, asyncio.CancelledError) as exc:
        # Stopped by the worker (a shutdown): the run was interrupted and its
        # session lock released; the message goes back to the queue.
        log.info("request %s interrupted; requeued", request_id,
                 extra={"action": "interrupted", "request": request_id})
        raise Reject(exc, requeue=True) from exc
    except (LockLost, AttemptLost, DatabaseUnavailable, psycopg.OperationalError) as exc:
        if isinstance(exc, AttemptLost):
            _mark_lost(exc)
        countdown = _context().backoff(task.request.retries + 1)
        log.warning("request %s: %s; retrying in %.1fs", request_id, exc, countdown,
                    extra={"action": "retry", "request": request_id})
        raise task.retry(exc=exc, countdown=countdown) from exc
    for pending in outcome.dispatch:
        # The handoff is committed: a broker that is down now does not make
        # this request fail (the sweeper publishes the next one).
        _dispatch_recorded(pending, "handed the session")
    if outcome.kind == "succeeded":
        return outcome.result
    if outcome.kind in ("parked", "refused"):
        # Acked, and nothing stored under the id: a refused message's id may
        # be another request's, whose caller waits for its own result.
        raise Ignore()
    if outcome.kind == "retry":
        raise task.retry(exc=RunFailed(outcome.error or "retry"), countdown=outcome.countdown)
    if outcome.kind == "dead":
        raise RunDead(outcome.error or "dead")
    if outcome.kind == "cancelled":
        raise RunCancelled(outcome.error or "cancelled")
    raise RunFailed(outcome.error or "failed")


def _arrival(request: Any) -> ledger.Arrival:
    """The eta and the queue of the message ``request`` came in (for a request
    the ledger first sees in a worker): its queue is the one this worker
    consumes whose exchange and routing key it came by."""
    info = request.delivery_info or {}
    exchange, key = info.get("exchange"), info.get("routing_key")
    queue = next((q.name for q in app.amqp.queues.values() if q.routing_key == key
                  and (not exchange or getattr(q.exchange, "name", None) == exchange)), key)
    try:
        start = _start_at(None, request.eta)
    except InvalidInput:
        start = None  # Celery itself refuses such an eta
    return ledger.Arrival(start, {"queue": queue} if queue else None)


def _attempt(task: AgentTask, request_id: str, args: dict[str, Any]) -> Outcome:
    """One attempt of the request on this process's loop."""
    outcome: Outcome = _loop.run(
        execute(_context(), request_id, args, task.kind, task.request.hostname,
                time_limit=_call_time_limit(task),
                options=functools.partial(_message_options, task, task.request),
                arrival=_arrival(task.request)),
        key=request_id, interrupt=functools.partial(_soft_time_limit, request_id),
    )
    return outcome


class RunAgentTask(AgentTask):
    kind: Kind = "run"


class ResumeAgentTask(AgentTask):
    kind: Kind = "resume"


def _run_agent(
    self: RunAgentTask,
    prompt: str,
    session_id: str,
    user_id: str | None = None,
    agent: str = DEFAULT_AGENT,
    metadata: dict[str, Any] | None = None,
) -> Any:
    """Run ``agent`` on ``prompt`` in ``session_id`` (for ``user_id``), durably.

    The result is the run's ``RunResult`` as JSON plus its ``request_id``."""
    return _perform(
        self,
        {"prompt": prompt, "session_id": session_id, "user_id": user_id, "agent": agent,
         "metadata": metadata},
    )


def _resume_agent(
    self: ResumeAgentTask,
    prompt: str,
    session_id: str,
    user_id: str | None = None,
    agent: str = DEFAULT_AGENT,
) -> Any:
    """Continue the session's last run (``Agent.resume`` without a checkpoint):
    its completed steps replay, even if it finished."""
    return _perform(
        self, {"prompt": prompt, "session_id": session_id, "user_id": user_id, "agent": agent}
    )


try:
    configure()
except (ValidationError, SettingsError) as exc:
    # Importing the package must not fail on bad settings (the CLI's doctor
    # reports them); using the app does, with this error.
    _state["settings_error"] = exc
    _use(make_app(None))
