"""A worker publishes requests from the ledger in batches (its fair turns, the
sweeper's redispatches) over one producer: each batch's first message to a
queue declares it, as Celery would; the rest skip what kombu's cache of the
connection's declarations already answers. No message is lost for it, on a
queue no one declared before, on Redis or RabbitMQ."""

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
        with tasks.app.producer_or_acquire() as producer:
            assert not run_agent._declared_on(producer, {"queue": queue})
        dispatch_many(pendings)
        assert _waiting(fleet, queue) == 40
        with tasks.app.producer_or_acquire() as producer:
            # The connection the batch went over remembers the queue: the next
            # batch's messages spare its declaration.
            assert run_agent._declared_on(producer, {"queue": queue})
            assert not run_agent._declared_on(producer, {"queue": f"{queue}-other"})
        dispatch_many(pendings[:5])
        assert _waiting(fleet, queue) == 45
    finally:
        if not tasks.app.conf.broker_url.startswith("redis"):  # Redis's go with the fleet's keys
            with tasks.app.connection_for_write() as conn:
                conn.default_channel.queue_delete(queue)
