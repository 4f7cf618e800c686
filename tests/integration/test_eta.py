"""Celery's countdown and eta: the ledger records when a request may start, and
nothing (the sweeper, a handoff) sends it earlier."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from pydantic import SecretStr

from loomflow_worker import tasks as tasks_module
from loomflow_worker.tasks import run_agent

from .celery_harness import Fleet
from .helpers import calls, cli, lines, tool_counts

pytestmark = pytest.mark.slow

COUNTDOWN = 8.0
#: A broker nobody listens on.
DOWN = "redis://127.0.0.1:1/0"


def _rows(dsn: str, *request_ids: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(
            "SELECT request_id, status, attempts, enqueued_at, not_before, started_at, "
            "finished_at FROM runs WHERE request_id = ANY(%s)", (list(request_ids),),
        )
        names = [d.name for d in cur.description or ()]
        found = {row[0]: dict(zip(names, row, strict=True)) for row in cur.fetchall()}
    return [found[request_id] for request_id in request_ids]



@pytest.mark.parametrize("broker", ["redis", "rabbitmq"], indirect=True)
def test_a_countdown_is_honoured_and_the_session_keeps_accept_order(
    fleet: Fleet, broker: str
) -> None:
    # The sweeper looks every 0.3 s and calls a queued message lost after 1 s:
    # an ETA message the worker holds (counted in no queue) would be sent
    # again, without its ETA, within a couple of seconds.
    fleet.start("w1", concurrency=2, pool="threads",
                LOOMFLOW_WORKER_SWEEP_INTERVAL="0.3", LOOMFLOW_WORKER_HANDOFF_GRACE="1",
                LOOMFLOW_WORKER_REDISPATCH_AFTER="2")
    delayed = run_agent.apply_async((calls("eta"), "s"), countdown=COUNTDOWN)
    later = run_agent.delay(calls("after"), "s")
    elsewhere = run_agent.delay(calls("other"), "s2")
    # While it waits, show and runs say when it may start.
    shown = cli(fleet, "show", delayed.id)
    assert shown.returncode == 0, shown.stderr
    assert "status    queued" in shown.stdout and ", not before 20" in shown.stdout
    listed = [json.loads(line) for line in lines(cli(fleet, "runs", "--json").stdout)]
    etas = {row["request_id"]: row["not_before"] for row in listed}
    assert etas[delayed.id] is not None and etas[later.id] is None
    # Another session is not held up by the delayed request ...
    assert elsewhere.get(timeout=20)["output"] == "done: recorded other"
    assert delayed.get(timeout=30)["output"] == "done: recorded eta"
    assert later.get(timeout=30)["output"] == "done: recorded after"
    first, second = _rows(fleet.dsn, delayed.id, later.id)
    # ... the delayed one started no earlier than its countdown, as the ledger says ...
    assert first["not_before"] is not None
    assert abs(first["not_before"] - first["enqueued_at"] - timedelta(seconds=COUNTDOWN)) \
        < timedelta(seconds=1)
    assert first["started_at"] >= first["not_before"] - timedelta(milliseconds=50)
    assert first["started_at"] - first["enqueued_at"] >= timedelta(seconds=COUNTDOWN - 0.1)
    # ... the later request of its session waited behind it, in accept order ...
    assert second["not_before"] is None
    assert second["started_at"] >= first["finished_at"]
    # ... and each ran once, from one message.
    assert first["attempts"] == second["attempts"] == 1
    assert tool_counts(fleet.dsn) == {"eta": 1, "after": 1, "other": 1}
    log = (fleet.logs / "w1.log").read_text(errors="replace")
    assert "sweeper: dispatched request" not in log
    assert len(re.findall(rf"request {delayed.id} succeeded", log)) == 1
    assert "already succeeded" not in log


def test_a_delayed_request_published_again_keeps_its_eta(fleet: Fleet) -> None:
    # Accepted while the broker is down: the sweeper publishes it as soon as
    # a worker runs, long before its countdown is over, and must send it
    # with its eta.
    up = tasks_module.settings()
    tasks_module.configure(up.model_copy(update={"broker_url": SecretStr(DOWN)}))
    try:
        delayed = run_agent.apply_async((calls("late"), "s"), countdown=COUNTDOWN)
    finally:
        tasks_module.configure(up)
    fleet.start("w1", concurrency=2, pool="threads",
                LOOMFLOW_WORKER_SWEEP_INTERVAL="0.3", LOOMFLOW_WORKER_HANDOFF_GRACE="0.5")
    assert delayed.get(timeout=30)["output"] == "done: recorded late"
    (row,) = _rows(fleet.dsn, delayed.id)
    assert row["started_at"] >= row["not_before"] - timedelta(milliseconds=50)
    assert row["attempts"] == 1 and tool_counts(fleet.dsn) == {"late": 1}
    log = (fleet.logs / "w1.log").read_text(errors="replace")
    assert len(re.findall(rf"sweeper: dispatched request {delayed.id}", log)) == 1
