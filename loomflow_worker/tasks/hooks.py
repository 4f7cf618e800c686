"""The worker's side of Celery's signals: checking the settings and the pool
at start, each pool child's loop and connections, the sweeper, the messages
a worker holds, revokes, and a shutdown's interrupted runs.

The receivers are connected when the package is imported (Celery sends the
signals only in a worker); each finds the process's state in
:data:`~.state.PROCESS`."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from typing import Any

import psycopg
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

from .. import metrics, tracing
from ..execution import ledger
from ..execution.registry import import_agent_modules
from ..execution.request import check_request
from ..runtime.errors import InvalidInput, LoomflowWorkerError, SessionPooler
from ..runtime.sessions import probe
from ..settings import Settings
from ..sweeper.leader import Sweeper
from ..sweeper.recovery import Revokes
from ..sweeper.result_watch import ResultBackend
from ..worker.admission import Admission
from ..worker.connections import bound_producers_now, bound_worker_connections
from ..worker.context import WorkerContext
from ..worker.pool import REFUSED_POOLS, RunPool, pool_name, refused_threads_option
from ..worker.quarantine.attempts import stop_in_quarantine
from ..worker.state import PROCESS
from .application import current_app, settings
from .cancel import cancel_request
from .dispatch import RESUME_AGENT, RUN_AGENT, dispatch_many, dispatch_turns
from .eta import arrival
from .queues import queue_lengths, version_queues
from .results import probe_result_backend, result_lifetime, results_missing, store_result
from .revoke import end_revoked_requests, end_revoked_soon, revoked_ids
from .task import AgentTask
from .upgrade import upgrade_stranded
from .version_watch import VersionWatch

log = logging.getLogger(__name__)

#: How long a pool child that is exiting waits for its connections to close.
CLOSE_TIMEOUT = 5.0


@worker_init.connect
def _prepare_worker(sender: Any = None, **_: Any) -> None:
    """Check the settings and the pool. The threads pool carries ``-c`` runs
    on the process's event loop (and becomes :class:`~.pool.RunPool`, whose
    runs can be stopped one by one, and refuses the options that only make
    sense for child processes); prefork and solo run one per process; gevent
    and eventlet would block their hub with the loop's thread, so the worker
    refuses them."""
    tracing.export_from_environment()
    try:
        settings()
    except InvalidInput as exc:
        # A worker on settings it can't use would serve nobody (and Celery's
        # defaults would point it at another broker): it does not start.
        log.critical("%s; the worker does not start", exc)
        raise SystemExit(2) from None
    # Its fair turns go out in batches from the loop, over the broker connection
    # its other publishes take turns on: given to the context the process makes
    # (a prefork child's is inherited), and to one made before the worker booted.
    PROCESS.publish_turns = dispatch_turns
    if PROCESS.context is not None:
        PROCESS.context.publish_turns = dispatch_turns
    name: str | None = None
    if sender is not None:
        # The node name its runs and its processes' rows in `workers` carry.
        PROCESS.node = getattr(sender, "hostname", None)
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
            sender.pool_cls = RunPool.stopping_with(_stop_run)
            PROCESS.slots = int(sender.concurrency or 1)
    if settings().metrics_port:
        metrics.prepare_multiprocess_dir()
    # A few connections to Redis and the broker, whatever the concurrency.
    bound_worker_connections(current_app())
    if PROCESS.runs_here:
        # Its threads publish at once (prefork's children fork from this
        # process, and each publishes from one thread).
        bound_producers_now(current_app())
    _refuse_session_pooler(settings())
    if PROCESS.runs_here:
        # The threads pool runs in this process: connect (and migrate), build
        # the agents and choose the version queues before the consumer starts.
        try:
            PROCESS.loop.run(PROCESS.worker_context().runtime())
        except Exception:
            log.exception("the worker could not connect to Postgres yet; will retry")
        else:
            _serve_versions(BEFORE_START)
    elif name == "prefork":
        _build_before_fork()
    _tune_collector()


def _build_before_fork() -> None:
    """A prefork worker's parent builds its agents once, before it forks its
    children, and drops them: each child starts with the agents' modules
    imported (building them again takes it milliseconds, where importing a
    model SDK takes seconds on a busy machine), and the queues of its agents'
    versions are chosen before the consumer starts. Nothing stays open."""
    import_agent_modules(settings().agents)
    ctx = WorkerContext(settings(), node=PROCESS.node, serving=False)

    async def build() -> dict[str, str]:
        try:
            return await ctx.serve_agents()
        finally:
            await ctx.aclose()

    try:
        versions = asyncio.run(build())
    except Exception:
        log.exception("the worker could not build its agents before starting its pool "
                      "children; each child builds them")
        return
    _take_version_queues(versions, BEFORE_START)


#: The cyclic garbage collector's thresholds in a worker process: a young
#: collection every 50,000 allocations (Python's default: 700). Hundreds of
#: runs in flight keep many objects alive, which every collection walks,
#: while reference counting frees nearly all of a run's garbage at once.
GC_THRESHOLDS = (50_000, 20, 100)


def _tune_collector() -> None:
    """Collect cycles less often, and never walk what the process loaded at
    start (its modules, the app, the agents' code): ``gc.freeze()`` moves it
    out of the collector's reach, and keeps it shared with prefork children
    rather than copied on their first collection. About 12-15% less worker
    CPU per run at ``-c 1000`` (``bench/bench_concurrency.py --backlog``)."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


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
    tracing.export_from_environment()
    if settings().metrics_port:
        metrics.setup()
    try:
        PROCESS.loop.run(PROCESS.worker_context().runtime())
    except Exception:
        log.exception("pool child could not connect to Postgres yet; will retry per task")
        return
    _serve_versions(None)


@worker_process_shutdown.connect
def _close_child(**_: Any) -> None:
    ctx, PROCESS.context = PROCESS.context, None
    if ctx is not None and PROCESS.loop.running:
        try:
            PROCESS.loop.run(ctx.aclose(), timeout=CLOSE_TIMEOUT)
        except Exception:
            # Bounded: a child that cannot close cleanly still exits, and
            # Postgres frees whatever its connections held.
            log.exception("closing the pool child's connections failed")
    PROCESS.loop.stop()
    tracing.flush()
    if metrics.enabled():
        metrics.process_exited(os.getpid())


@task_received.connect
def _note_received(request: Any = None, **_: Any) -> None:
    """A request's message reached this worker: until it starts, the sweeper
    hears from this worker that it holds it (see :func:`_stamp_held`)."""
    if request is not None and getattr(request, "name", None) in (RUN_AGENT, RESUME_AGENT):
        PROCESS.held[request.id] = request


def _stamp_held(conn: psycopg.Connection[Any]) -> int:
    """Stamp the requests this worker holds, received and not started, in
    the ledger; one sent by name, which the ledger does not have yet, is
    recorded first, with the eta and queue of its message. Returns how many
    it holds.

    A request is held until its run starts in the ledger (or its message is
    acknowledged), not merely until its task starts in a pool thread: the
    run starts on the process's loop, which a busy process or a tool that
    blocks it may keep waiting for seconds, and meanwhile the message is in
    no queue the broker counts."""
    held = PROCESS.held
    for request_id, request in list(held.items()):
        if request.acknowledged:
            held.pop(request_id, None)
    request_ids = list(held)
    if not request_ids:
        return 0
    stamped = ledger.mark_held(conn, request_ids)
    if len(stamped) < len(request_ids):
        # The others are not queued in the ledger: started or ended since
        # (forgotten), or sent by name and not recorded yet.
        rest = [request_id for request_id in request_ids if request_id not in stamped]
        unknown = set(ledger.unknown(conn, rest))
        for request_id in rest:
            if request_id not in unknown:
                held.pop(request_id, None)
        arrived = [request_id for request_id in rest if request_id in unknown]
        for request_id in arrived:
            _record_arrived(conn, held[request_id])
        if arrived:
            ledger.mark_held(conn, arrived)
    return len(held)


def _record_arrived(conn: psycopg.Connection[Any], request: Any) -> None:
    """Record a received request the ledger does not have (sent by name). Its
    input is checked when it runs: one a worker refuses is left to that."""
    app = current_app()
    task: AgentTask = app.tasks[request.name]
    try:
        checked = check_request(settings(), kind=task.kind,
                                **task.bind_arguments(request.args, request.kwargs))
    except (InvalidInput, TypeError):
        return
    ledger.record_arrived(conn, request.id, checked, arrival(request, app))


@worker_ready.connect
def _start_sweeper(sender: Any = None, **_: Any) -> None:
    if settings().metrics_port:
        metrics.setup()
        metrics.serve(settings().metrics_port)
    if PROCESS.runs_here:
        if sender is not None and getattr(sender, "qos", None) is not None:
            _admit(sender)
        # The threads pool runs in this process: connect (and migrate) now.
        try:
            PROCESS.loop.run(PROCESS.worker_context().runtime())
        except Exception:
            log.exception("the worker could not connect to Postgres yet; will retry per task")
        else:
            if PROCESS.version_queues is None:
                _serve_versions(sender)
            else:
                _say_version_queues(PROCESS.version_queues)
    elif PROCESS.version_queues is not None:  # chosen before the fork (prefork)
        _say_version_queues(PROCESS.version_queues)
    if settings().sweeper:
        sweeper = Sweeper(settings(), dispatch_many, queue_lengths,
                          ResultBackend(results_missing, store_result,
                                       probe_result_backend, result_lifetime()),
                          revoked=Revokes(revoked_ids, end_revoked_requests), held=_stamp_held,
                          versions=VersionWatch(upgrade_stranded, cancel_request))
        PROCESS.sweeper = sweeper
        sweeper.start()


def _serve_versions(consumer: Any) -> bool:
    """Build the process's agents and take messages from their versions'
    queues too (:func:`.queues.version_queues`); with TAKE_NEW false, from
    those only. ``consumer``: ``"before start"`` when the worker's consumer has
    not started (the threads pool, at ``worker_init``: the queues it will take
    from are chosen now, so it never takes a message it should not), else the
    worker's consumer when it runs in this process, else ``None`` (a pool
    child: its worker is asked over Celery's remote control). Whether the
    versions are served (their queues in ``PROCESS.version_queues``)."""
    try:
        versions = PROCESS.loop.run(PROCESS.worker_context().serve_agents())
    except Exception:
        log.exception("could not build this worker's agents; requests pinned to their "
                      "versions wait for another worker")
        return False
    return _take_version_queues(versions, consumer)


def _take_version_queues(versions: dict[str, str], consumer: Any) -> bool:
    """Take messages from the queues of ``versions`` too (with TAKE_NEW
    false, from those only); ``consumer`` as :func:`_serve_versions` takes it.
    A pool child whose parent took them already (the same code gives the same
    versions) changes nothing."""
    names = version_queues(versions)
    if PROCESS.version_queues is not None and set(names) <= set(PROCESS.version_queues):
        return True
    app = current_app()
    queues = app.amqp.queues
    try:
        bases = list(queues.consume_from or {})
        for name in names:
            if consumer == BEFORE_START:
                queues.select_add(name)
            elif consumer is not None:
                consumer.add_task_queue(name)
            else:
                app.control.add_consumer(name, destination=[PROCESS.node], reply=False)
        if not settings().take_new:
            for name in bases:
                if consumer == BEFORE_START:
                    queues.deselect(name)
                elif consumer is not None:
                    consumer.cancel_task_queue(name)
                else:
                    app.control.cancel_consumer(name, destination=[PROCESS.node], reply=False)
    except Exception:
        log.exception("could not take messages from the queues of this worker's agent "
                      "versions; requests pinned to them wait for another worker")
        return False
    PROCESS.version_queues = names
    if consumer != BEFORE_START:  # else said once the worker's log is set up (ready)
        _say_version_queues(names)
    return True


def _say_version_queues(names: list[str]) -> None:
    if settings().take_new:
        log.info("taking messages from the queues of this worker's agent versions too: %s",
                 ", ".join(names), extra={"action": "version_queues"})
    else:
        log.info("taking no new requests (TAKE_NEW is false): only those pinned to this "
                 "worker's agent versions, from %s", ", ".join(names) or "no queue",
                 extra={"action": "version_queues"})


#: ``_serve_versions``' consumer before the worker's consumer starts.
BEFORE_START = "before start"


def _admit(consumer: Any) -> None:
    """Let the process's load decide when its consumer takes messages."""
    from celery.worker import state as worker_state

    ctx, current = PROCESS.worker_context(), settings()
    admission = Admission(
        consumer.qos,
        ceiling=(PROCESS.slots or 1) * max(1, int(consumer.prefetch_multiplier or 1)),
        lag_limit=current.admission_lag,
        queue_limit=current.admission_queue,
        queue_depth=ctx.queue_depth,
        in_flight=lambda: len(worker_state.reserved_requests),
    )
    ctx.watch_observers.append(admission.observe)
    ctx.admitting = lambda: admission.admitting
    PROCESS.admission = admission


@task_revoked.connect
def _revoked(request: Any = None, expired: bool = False, **_: Any) -> None:
    """Celery revoked a request, or let it expire: the ledger ends it
    (``cancelled`` or ``expired``) and its session moves on, rather than
    waiting for a message every worker now discards."""
    name = getattr(request, "task", None)
    if getattr(name, "name", name) not in (RUN_AGENT, RESUME_AGENT):
        return
    end_revoked_soon(str(request.id), ledger.EXPIRED if expired else ledger.REVOKED)


def _stop_run(request_id: str) -> bool:
    """Stop one run of this process (:class:`~.pool.RunPool` calls it): a
    revoked one ends ``cancelled`` at once (``revoke(terminate=True)``), also
    one running alone in a process of its own, any other (a shutdown) is
    interrupted and requeued."""
    from celery.worker import state

    ctx = PROCESS.context
    if request_id in state.revoked:
        if stop_in_quarantine(request_id):
            return True
        if ctx is not None and PROCESS.loop.running:
            PROCESS.loop.loop.call_soon_threadsafe(ctx.halt, request_id, ledger.REVOKED.error)
            return True
    return PROCESS.loop.cancel(request_id)


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
            ledger.mark_interrupted(conn, sender)
    except psycopg.Error:
        log.warning("could not mark this worker's runs interrupted", exc_info=True)


@worker_shutdown.connect
def _stop_sweeper(sender: Any = None, **_: Any) -> None:
    sweeper, PROCESS.sweeper = PROCESS.sweeper, None
    if sweeper is not None:
        sweeper.stop()
    if PROCESS.runs_here:
        _close_child()  # the threads pool ran in this process
    # Once more now that the pool is gone: an attempt started during the
    # soft shutdown was interrupted too.
    _mark_interrupted(getattr(sender, "hostname", None))
