"""The worker's pool: many runs per process, each one stoppable on its own.

Runs wait on the model, not the CPU, so one process carries many of them on
its event loop (:mod:`.loop`). Celery's threads pool feeds that loop: each
thread hands its task's run to the loop and waits, so Celery keeps doing
what it does best (prefetching no more messages than free threads, late
acks, retries, results) and the loop does the waiting.

Celery's threads pool cannot stop one task (``terminate_job`` is not
implemented there), which soft shutdown and ``revoke(terminate=True)``
need. :class:`RunPool` adds that: stopping a task cancels its run on the
loop, which releases the session lock at once and requeues the message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery.concurrency.thread import ApplyResult
from celery.concurrency.thread import TaskPool as ThreadTaskPool

#: Pools that cannot carry the process's event loop: the worker refuses them.
REFUSED_POOLS = ("gevent", "eventlet")

_NO_CHILDREN = (
    "it has no child processes to recycle; restart the worker instead (SIGTERM requeues its "
    "runs) or use -P prefork, whose children are recycled"
)
#: What the threads pool cannot do, each with what to do instead: the worker
#: refuses these options (from the command line or the Celery config) at start
#: rather than ignoring them or failing at the first load. The autoscaler would
#: grow and shrink processes the pool does not have; and the slots of a process
#: (its lock connections, thread limits) are sized once, at start.
REFUSED_THREADS_OPTIONS = {
    "autoscale": (
        "--autoscale",
        "its --concurrency is a ceiling of runs on one event loop, not a number of "
        "processes, and a slot no run uses costs nothing; set -c to the most runs a process "
        "should carry and scale the fleet by processes (KEDA on the queue, see deploy/)",
    ),
    "max_tasks_per_child": ("--max-tasks-per-child (worker_max_tasks_per_child)", _NO_CHILDREN),
    "max_memory_per_child": (
        "--max-memory-per-child (worker_max_memory_per_child)", _NO_CHILDREN),
}

#: Stops the run of one request; ``True`` when there was one to stop.
StopRun = Callable[[str], bool]


class StoppableResult(ApplyResult):  # type: ignore[misc]
    """A task's handle in :class:`RunPool`; ``terminate`` stops its run."""

    def __init__(self, result: ApplyResult, request_id: str | None,
                 stop_run: StopRun | None) -> None:
        super().__init__(result.f)
        self.request_id = request_id
        self._stop_run = stop_run
        # Celery keeps only a weak reference to a task's handle: the future
        # keeps this one alive while the task runs, so terminate() reaches it.
        result.f.loomflow_result = self

    def terminate(self, signal: Any = None) -> None:
        if self.request_id is not None and self._stop_run is not None:
            self._stop_run(self.request_id)


class RunPool(ThreadTaskPool):  # type: ignore[misc]
    """Celery's threads pool, whose tasks can be stopped one by one: by
    ``stop_run``, which the worker gives it (without one, a task's
    ``terminate`` does nothing, as in Celery's threads pool)."""

    def __init__(self, *args: Any, stop_run: StopRun | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stop_run = stop_run

    @classmethod
    def stopping_with(cls, stop_run: StopRun) -> type[RunPool]:
        """The pool class to give a worker, whose pools stop runs with
        ``stop_run`` (Celery makes the pool itself, from a class and
        arguments of its own)."""

        class Pool(cls):  # type: ignore[valid-type,misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, stop_run=stop_run, **kwargs)

        return Pool

    def on_apply(
        self,
        target: Callable[..., Any],
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        callback: Callable[..., Any] | None = None,
        accept_callback: Callable[..., Any] | None = None,
        correlation_id: str | None = None,
        **options: Any,
    ) -> StoppableResult:
        result = super().on_apply(target, args, kwargs, callback, accept_callback, **options)
        return StoppableResult(result, correlation_id, self._stop_run)

    def terminate_job(self, pid: int, signal: Any = None) -> None:
        """Every task shares this process's pid: a task is stopped through its
        own :class:`StoppableResult` instead."""


def refused_threads_option(worker: Any) -> str | None:
    """Why the threads pool refuses an option ``worker`` (Celery's
    ``WorkController``) was started with, or ``None``."""
    options = {**(getattr(worker, "options", None) or {}), **vars(worker)}
    for key, (option, why) in REFUSED_THREADS_OPTIONS.items():
        if options.get(key):
            return f"loomflow-worker: {option} is not supported on the threads pool: {why}."
    return None


def pool_name(pool: Any) -> str:
    """The short name of a Celery pool given as a class or a name."""
    if isinstance(pool, str):
        return pool.rsplit(":", 1)[0].rsplit(".", 1)[-1] if ":" in pool else pool
    if isinstance(pool, type) and issubclass(pool, RunPool):
        return "threads"
    module = getattr(pool, "__module__", "") or ""
    return {
        "celery.concurrency.thread": "threads",
        "celery.concurrency.prefork": "prefork",
        "celery.concurrency.solo": "solo",
        "celery.concurrency.gevent": "gevent",
        "celery.concurrency.eventlet": "eventlet",
    }.get(module, module or repr(pool))
