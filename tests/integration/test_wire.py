"""Messages on the wire are untrusted: published raw to a real worker's queue,
a body of the wrong shape, arguments that differ from the ledger's, an id
Postgres can't index. Real Postgres, Redis and workers."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import redis

from loomflow_worker.tasks import app, run_agent

from .celery_harness import REDIS_URL, Fleet
from .helpers import calls
from .test_celery import _counts
from .test_metrics import _free_port, _scrape

pytestmark = pytest.mark.slow

RUN_AGENT = "loomflow_worker.run_agent"


def publish_raw(fleet: Fleet, body: Any, task_id: Any, task: str = RUN_AGENT) -> None:
    """Publish ``body`` as a task message of protocol 2, as anyone with access
    to the broker can, past every check ``apply_async`` makes."""
    with app.producer_or_acquire() as producer:
        producer.publish(
            body, routing_key=fleet.queue, serializer="json",
            headers={"lang": "py", "task": task, "id": task_id},
        )


def _broker_holds(fleet: Fleet) -> int:
    """Messages the broker still holds for the fleet: waiting in its queue,
    or delivered and not acked yet."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        waiting = sum(int(client.llen(key))
                      for key in client.scan_iter(match=f"{fleet.prefix}{fleet.queue}*"))
        return waiting + int(client.hlen(f"{fleet.prefix}unacked"))
    finally:
        client.close()


def _wait_broker_empty(fleet: Fleet, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while _broker_holds(fleet):
        assert time.monotonic() < deadline, f"the broker still holds {_broker_holds(fleet)}"
        time.sleep(0.05)


BAD_BODIES = ["a string", [1], [[], {}], None, {}]


@pytest.mark.parametrize("cli", [True, False], ids=["loomflow-worker", "celery-prefork"])
def test_a_body_of_the_wrong_shape_is_dropped_and_the_worker_lives(
    fleet: Fleet, cli: bool
) -> None:
    port = _free_port()
    worker = fleet.start("w1", concurrency=1, cli=cli, pool="prefork",
                         LOOMFLOW_WORKER_METRICS_PORT=str(port))
    bad_ids = [str(uuid.uuid4()) for _ in BAD_BODIES]
    for body, task_id in zip(BAD_BODIES, bad_ids, strict=True):
        publish_raw(fleet, body, task_id)
    # A well-shaped body with an id the ledger can't hold (or none at all).
    publish_raw(fleet, [["p", "s"], {}, None], "x" * 100_000)
    publish_raw(fleet, [["p", "s"], {}, None], None)

    valid = run_agent.delay(calls("after"), "s1")
    assert valid.get(timeout=60)["output"] == "done: recorded after"
    assert worker.poll() is None, fleet.log_text()
    _wait_broker_empty(fleet)
    assert _counts(fleet.dsn) == {"after": 1}
    log = (fleet.logs / "w1.log").read_text()
    for task_id in bad_ids:
        assert f"message {task_id} refused and dropped: its body is" in log
    assert "its id is 100000 characters long" in log
    assert "its id must be a string, not NoneType" in log
    assert "Unrecoverable error" not in log
    assert _scrape(port)['loomflow_worker_messages_refused_total{reason="malformed"}'] == 7
