"""The result backend as the worker uses it: a result it can't store is left
to the sweeper, which stores a finished request's outcome from the ledger."""

from __future__ import annotations

import logging
from typing import Any

from ..execution.errors import RunCancelled, RunDead, RunFailed
from .dispatch import dispatch_errors
from .state import PROCESS

log = logging.getLogger("loomflow_worker.tasks")


class ResultStore:
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
        except backend_errors(self._backend) as exc:
            log.warning("request %s: the result backend refused its RETRY state (%s); "
                        "the retry goes on", task_id, exc,
                        extra={"action": "retry_state_unstored", "request": task_id})

    def _store(self, store: Any, task_id: str, *args: Any, **kwargs: Any) -> None:
        try:
            store(task_id, *args, **kwargs)
        except backend_errors(self._backend) as exc:
            marked = PROCESS.enqueue.mark_result_unstored(*PROCESS.database(), task_id)
            log.warning(
                "request %s: the result backend refused its result (%s); %s", task_id, exc,
                "the sweeper stores it from the runs ledger once the backend is back" if marked
                else "the ledger could not record that either; the sweeper's check of recent "
                "results stores it",
                extra={"action": "result_deferred", "request": task_id},
            )
            return
        if PROCESS.context is not None:
            PROCESS.context.result_stored(task_id)


def backend_errors(backend: Any) -> tuple[type[BaseException], ...]:
    """What storing a result raises when the result backend can't be reached."""
    from celery.exceptions import BackendStoreError

    return (*dispatch_errors(), *tuple(getattr(backend, "connection_errors", ())),
            BackendStoreError)


def results_missing(request_ids: list[str]) -> set[str]:
    """Which of these finished requests have no outcome in the result backend:
    on Redis, one pipelined ``EXISTS`` per request (nothing read back), one
    round trip for the lot."""
    from celery.backends.redis import RedisBackend

    backend = PROCESS.current_app().backend
    if isinstance(backend, RedisBackend):
        with backend.client.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.exists(backend.get_key_for_task(request_id))
            found = pipe.execute()
        return {rid for rid, exists in zip(request_ids, found, strict=True) if not exists}
    return {rid for rid in request_ids if backend.get_state(rid) == "PENDING"}


def store_result(request_id: str, status: str, result: Any, error: str | None) -> None:
    """Store a finished request's outcome, as the ledger has it, in the result backend."""
    backend = PROCESS.current_app().backend
    if status == "succeeded":
        backend.store_result(request_id, result, "SUCCESS")
    else:
        failure = {"dead": RunDead, "cancelled": RunCancelled}.get(status, RunFailed)
        backend.store_result(request_id, failure(error or status), "FAILURE")
