"""A worker process's connections to Redis and the broker: a few, whatever its concurrency.

Celery keeps a result backend per thread unless the backend says it is thread
safe, and a Redis backend opens a pool of connections of its own: a worker
whose threads pool runs ``-c 200`` held about 200 connections to Redis, one
per thread that had stored a result. A worker process shares one
:class:`WorkerRedisBackend` instead: redis-py's client is thread safe, and
its pool is bounded (RESULT_CONNECTIONS); a thread that finds every
connection in use waits for one (a store takes about a millisecond) rather
than opening another. Callers (processes that enqueue and wait on
results) keep Celery's backend per thread: their result subscriptions are
not thread safe.

The threads publish (a session handed over, a retry) through kombu's pool of
producers, which a worker bounds to PUBLISH_CONNECTIONS broker connections
(two sockets each on Redis). A thread that waits longer than PUBLISH_WAIT
for one leaves the publish to the sweeper, as when the broker refuses it:
the ledger has the request.
"""

from __future__ import annotations

from typing import Any

import redis
from celery import Celery
from celery.app.backends import by_url
from celery.backends.redis import RedisBackend

#: The Redis connections a worker process stores its results (and its
#: sweeper checks them) with.
RESULT_CONNECTIONS = 2

#: How long a thread waits for one of them before the store counts as
#: refused (retried as Celery retries a store, then left to the sweeper). A
#: store holds one for a round trip or two, but a process whose CPU is
#: starved (hundreds of threads retrying at once) makes that seconds: the
#: wait is for a Redis that hangs, not for the others' turns.
RESULT_WAIT = 30.0

#: The broker connections a worker process's threads publish with. One: a
#: publish holds it for a round trip, and the publishers of a process (the
#: sweeper's thread, a batch of fair turns, a handoff) take turns on it rather
#: than open a second (two more sockets on Redis) whenever two publish at once.
PUBLISH_CONNECTIONS = 1

#: How long a thread waits for one of them before the publish counts as refused.
PUBLISH_WAIT = 30.0


class WorkerRedisBackend(RedisBackend):  # type: ignore[misc]
    """Celery's Redis result backend, shared by every thread of a worker process."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.thread_safe = True
        self.connparams["max_connections"] = RESULT_CONNECTIONS

    def _get_pool(self, **params: Any) -> redis.BlockingConnectionPool:
        return redis.BlockingConnectionPool(  # type: ignore[no-untyped-call]
            timeout=RESULT_WAIT, **params
        )


def bound_worker_connections(app: Celery) -> None:
    """Bound the connections of this worker process, whatever its concurrency:
    its threads publish through PUBLISH_CONNECTIONS broker connections and,
    when the result backend is Redis, store results through one backend on
    RESULT_CONNECTIONS connections."""
    app.conf.broker_pool_limit = PUBLISH_CONNECTIONS
    app.conf.broker_pool_acquire_timeout = PUBLISH_WAIT
    backend_cls, url = by_url(app.conf.result_backend, app.loader)
    if backend_cls is RedisBackend:  # redis:// and rediss://, not sentinel
        # Celery's own switch, result_backend_thread_safe, would leave the
        # backends threads made before it: this one replaces them all.
        app._backend = WorkerRedisBackend(app=app, url=url)


def bound_producers_now(app: Celery) -> None:
    """Give kombu's pools (global to the process) the worker's limit now,
    before any thread publishes. Celery does it on the first publish, which
    fails ("Can't shrink pool when in use") when threads that published
    meanwhile hold more producers than the limit: a restarted worker whose
    requests all retry at once lost a retry so. Nothing connects yet."""
    _ = app.amqp.producer_pool
