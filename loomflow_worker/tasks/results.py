"""The result backend as the worker uses it: a result it can't store is left
to the sweeper, which stores a finished request's outcome from the ledger."""

from __future__ import annotations

import logging
import math
from typing import Any

from ..execution.request_errors import RunCancelled, RunDead, RunFailed
from ..sweeper.result_watch import BackendMark
from ..worker.state import PROCESS
from .dispatch import dispatch_errors

log = logging.getLogger(__name__)


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


def store_result(request_id: str, status: str, result: Any, error: str | None,
                 age: float = 0.0) -> bool:
    """Store a finished request's outcome, as the ledger has it, in the result
    backend, for what is left of its lifetime (``result_expires``, or
    ``result_failure_expires``, from when it ended, ``age`` seconds ago); none
    left: nothing stored, ``False``."""
    from celery.backends.redis import RedisBackend

    backend = PROCESS.current_app().backend
    state = "SUCCESS" if status == "succeeded" else "FAILURE"
    lifetime = result_lifetime(state)
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


def result_lifetime(state: str | None = None) -> float | None:
    """How long the result backend keeps a result of ``state`` (``None``: the
    longer of a success's and a failure's), in seconds; ``None``: for ever."""
    backend = PROCESS.current_app().backend
    success = float(backend.expires or 0)
    failure = float(getattr(backend, "failure_expires", success) or 0)
    lifetimes = [success, failure] if state is None else [
        failure if state == "FAILURE" else success]
    return None if 0 in lifetimes else max(lifetimes)


def probe_result_backend(token: str, stamp: float) -> BackendMark | None:
    """Read the mark the sweeper left in the result backend under ``token``,
    leave ``stamp`` in its place, and read how many keys the server has
    evicted: one round trip. ``None`` for a backend other than Redis."""
    from celery.backends.redis import RedisBackend

    backend = PROCESS.current_app().backend
    if not isinstance(backend, RedisBackend):
        return None
    key = f"{PROCESS.current_settings().redis_key_prefix}loomflow-worker:result-mark:{token}"
    with backend.client.pipeline(transaction=False) as pipe:
        pipe.get(key)
        pipe.set(key, repr(stamp))
        pipe.info("stats")
        found, _, stats = pipe.execute()
    evicted = stats.get("evicted_keys") if isinstance(stats, dict) else None
    return BackendMark(None if found is None else float(found),
                       None if evicted is None else int(evicted))
