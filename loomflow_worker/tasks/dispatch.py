"""Publishing requests the ledger recorded: a broker that refuses a message
is logged, not raised, and the request is left to the sweeper (the ledger is
the queue of record)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any

from celery.result import task_join_will_block

from ..execution.pending import Pending
from ..worker.state import PROCESS

log = logging.getLogger(__name__)

#: The names the tasks are registered and sent under (messages carry them).
RUN_AGENT = "loomflow_worker.run_agent"
RESUME_AGENT = "loomflow_worker.resume_agent"

#: A publish gives up after about a second: the ledger row is the record, and
#: the sweeper publishes a request whose message was lost.
DISPATCH_RETRY = {"max_retries": 2, "interval_start": 0.1, "interval_step": 0.3,
                  "interval_max": 0.5}

#: How long a result backend that answered a PING is taken to be up: enqueues
#: within it send none.
BACKEND_CHECK_EVERY = 1.0


def options_json(options: dict[str, Any]) -> dict[str, Any]:
    """A message's options as JSON, encoded as kombu encodes a message (so
    that what a message decodes to is encoded back the same way)."""
    from kombu.utils import json as kombu_json

    plain: dict[str, Any] = json.loads(kombu_json.dumps(options))  # type: ignore[no-untyped-call]
    return plain


def dispatch(pending: Pending, producer: Any = None) -> None:
    """Publish a request that has its ledger row, as the task of its kind
    (with ``producer``, over its connection)."""
    name = RESUME_AGENT if pending.kind == "resume" else RUN_AGENT
    PROCESS.current_app().tasks[name].dispatch(pending, producer)


def dispatch_many(pendings: list[Pending]) -> None:
    """Publish these requests' messages (a batch of the sweeper's) over one
    producer, on one broker connection acquired for the lot; on Redis in one
    round trip, where kombu has publish batches. The broker's error is raised,
    and then which of them went is unknown."""
    with PROCESS.current_app().producer_or_acquire() as producer:
        batch = getattr(producer, "batch", None)
        with batch() if batch is not None else contextlib.nullcontext():
            for pending in pendings:
                dispatch(pending, producer)


def dispatch_turns(pendings: list[Pending]) -> None:
    """Publish requests the ledger sent on their fair turn, as one batch: a
    broker that refuses it leaves each to the sweeper."""
    try:
        dispatch_many(pendings)
    except dispatch_errors() as exc:
        for pending in pendings:
            dispatch_deferred(pending.request_id, "queued (its fair turn came)", exc)


def dispatch_deferred(request_id: str, state: str, exc: BaseException) -> None:
    """The broker refused the message of a request the ledger has as ``state``:
    log it and mark the request for the sweeper."""
    PROCESS.backend_answered = None  # the next enqueue checks the backend first
    log.warning(
        "request %s is %s (the runs ledger has it) but the broker refused its message (%s); "
        "a worker's sweeper takes it from the ledger once the broker is back",
        request_id, state, exc, extra={"action": "dispatch_deferred", "request": request_id},
    )
    PROCESS.enqueue.mark_undispatched(*PROCESS.database(), request_id)


def dispatch_recorded(pending: Pending, state: str) -> None:
    """Publish a request whose change the ledger committed: a broker that
    refuses it is logged, not raised (the change stands, and the sweeper
    carries it out)."""
    try:
        dispatch(pending)
    except dispatch_errors() as exc:
        dispatch_deferred(pending.request_id, state, exc)


def dispatch_errors() -> tuple[type[BaseException], ...]:
    """What a publish raises when the broker can't be reached."""
    import kombu.exceptions
    import redis

    return (kombu.exceptions.OperationalError, redis.ConnectionError, redis.TimeoutError,
            ConnectionError, TimeoutError)


def check_result_backend() -> None:
    """Raise a connection error at once when the result backend's Redis is down.

    Before publishing, Celery subscribes the caller to the request's result
    on Redis, retrying for about 19 seconds when Redis is down and then
    giving up with an anonymous ``RuntimeError``. One ``PING`` (a fraction of a
    millisecond) finds out first, at most once every BACKEND_CHECK_EVERY
    seconds: a Redis that goes away in between is met by that retry, whose
    error ``apply_async`` also turns into a deferred dispatch. Pool children
    do not subscribe."""
    from celery.backends.redis import RedisBackend

    backend = PROCESS.current_app().backend
    if not isinstance(backend, RedisBackend) or task_join_will_block():
        return
    now = time.monotonic()
    answered = PROCESS.backend_answered
    if answered is not None and answered[0] is backend and now - answered[1] < BACKEND_CHECK_EVERY:
        return
    backend.client.ping()
    PROCESS.backend_answered = (backend, now)
