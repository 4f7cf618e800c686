"""A worker publishes requests from the ledger in batches (its fair turns, the
sweeper's redispatches) over one producer, each message's queue bound to the
producer's channel once, not copied and bound for each: the first message
declares it, as Celery would, and kombu's cache answers for the rest. No
message is lost for it, on a queue no one declared before, on Redis or
RabbitMQ."""

from __future__ import annotations

import uuid

import pytest
import redis

from loomflow_worker import tasks
from loomflow_worker.execution.pending import Pending
from loomflow_worker.tasks import run_agent
from loomflow_worker.tasks.dispatch import dispatch_many
from tests.needs import REDIS_URL

from .celery_harness import Fleet
from .helpers import wait_until

pytestmark = pytest.mark.slow


def _waiting(fleet: Fleet, queue: str) -> int:
    """How many messages wait in ``queue`` (on Redis, its list under the fleet's
    key prefix)."""
    if tasks.app.conf.broker_url.startswith("redis"):
        client = redis.Redis.from_url(REDIS_URL)
        try:
            return int(client.llen(fleet.prefix + queue))
        finally:
            client.close()
    with tasks.app.connection_for_write() as conn:
        count: int = conn.default_channel.queue_declare(queue=queue, passive=True).message_count
        return count


@pytest.mark.parametrize("fleet", ["redis", "rabbitmq"], indirect=True)
def test_a_batch_to_a_queue_never_declared_declares_it_and_loses_nothing(fleet: Fleet) -> None:
    queue = f"{fleet.queue}-batch"
    pendings = [Pending(uuid.uuid4().hex, "run", f"s{i}", None, "default", "p", {},
                        routing={"queue": queue}) for i in range(40)]
    try:
        dispatch_many(pendings)
        # RabbitMQ counts a message once it routed it (no publisher confirms).
        wait_until(lambda: _waiting(fleet, queue), "all 40 in the queue", 10,
                   until=lambda n: n == 40)
        with tasks.app.producer_or_acquire() as producer:
            # Bound to the producer's channel once, for all its messages.
            bound = run_agent._bound_queue(producer, {"queue": queue})
            assert bound is not None and bound.channel is producer.channel
            assert run_agent._bound_queue(producer, {"queue": queue}) is bound
            assert run_agent._bound_queue(producer, {}) is None  # Celery's own choice
        dispatch_many(pendings[:5])
        wait_until(lambda: _waiting(fleet, queue), "all 45 in the queue", 10,
                   until=lambda n: n == 45)
    finally:
        if not tasks.app.conf.broker_url.startswith("redis"):  # Redis's go with the fleet's keys
            with tasks.app.connection_for_write() as conn:
                conn.default_channel.queue_delete(queue)
