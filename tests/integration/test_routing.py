"""Where a request's messages go, and what the sweeper counts as present:
per-call queues, messages a worker holds for a rate limit, messages known only
by their body (``send_task``, ``celery call``), and the backlog autoscalers see."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from loomflow_worker.tasks import app, run_agent
from loomflow_worker.tasks.application import RUN_AGENT

from . import vip_agents  # noqa: F401  (the enqueuing side knows the vip agent)
from .celery_harness import ROOT, Fleet, ledger, wait_status, wait_sweeps_for
from .helpers import calls, scrape, wait_for_execution, wait_until
from .services import free_port

pytestmark = pytest.mark.slow

#: A sweeper that acts fast: a message counted nowhere for over a second looks lost.
QUICK_SWEEPER = {"LOOMFLOW_WORKER_SWEEP_INTERVAL": "0.5", "LOOMFLOW_WORKER_HANDOFF_GRACE": "1",
                 "LOOMFLOW_WORKER_REDISPATCH_AFTER": "2"}


@pytest.fixture(autouse=True)
def quick_sweeper(fleet: Fleet) -> None:
    """Every worker of these tests sweeps fast."""
    fleet.env.update(QUICK_SWEEPER)


def _redispatches(fleet: Fleet) -> list[str]:
    return re.findall(r"sweeper: dispatched request (\S+) again", fleet.log_text())


@pytest.fixture
def vip_queue(fleet: Fleet, broker: str) -> Iterator[str]:
    """A second queue of the fleet's broker, deleted after the test."""
    name = f"{fleet.queue}-vip"
    yield name
    if broker == "rabbitmq":
        from .celery_harness import _delete_amqp_queue

        _delete_amqp_queue(name)


def _start_vip_worker(fleet: Fleet, vip_queue: str, concurrency: int) -> None:
    """A worker of the vip queue alone, the only one with the vip agent."""
    fleet.start("vip", concurrency=concurrency, args=("-Q", vip_queue), TEST_TOOL_SLEEP="1",
                LOOMFLOW_WORKER_AGENTS="tests.integration.vip_agents")


@pytest.mark.slow
@pytest.mark.parametrize("broker", ["redis", "rabbitmq"], indirect=True)
def test_a_request_sent_to_its_own_queue_waits_there_and_runs_on_its_workers(
    fleet: Fleet, vip_queue: str
) -> None:
    # No worker reads the vip queue yet: its request waits there, past the
    # sweeper's grace and its second look (2 s), and is never sent to the
    # default queue, whose worker does not have its agent.
    fleet.start("default", concurrency=2)
    first = run_agent.apply_async((calls("v0"), "vip-0"), {"agent": "vip"}, queue=vip_queue)
    wait_sweeps_for(fleet, 3)
    assert ledger(fleet.dsn, first.id)["status"] == "queued"
    assert _redispatches(fleet) == []
    # Its worker comes, one run at a time: the others wait in the queue.
    _start_vip_worker(fleet, vip_queue, concurrency=1)
    more = [run_agent.apply_async((calls(f"v{i}"), f"vip-{i}"), {"agent": "vip"},
                                  queue=vip_queue) for i in range(1, 5)]
    for i, result in enumerate([first, *more]):
        assert result.get(timeout=120)["output"] == f"done: recorded v{i}"
    assert _redispatches(fleet) == []
    default_log = (fleet.logs / "default.log").read_text(errors="replace")
    assert "unknown agent" not in default_log
    assert not re.search(r"request \S+ succeeded", default_log)
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        routed = conn.execute("SELECT DISTINCT routing->>'queue' FROM runs").fetchall()
    assert routed == [(vip_queue,)]


@pytest.mark.slow
def test_a_running_request_whose_worker_died_is_sent_back_to_its_own_queue(
    fleet: Fleet, vip_queue: str
) -> None:
    # The vip worker dies mid-run: the default worker's sweeper dispatches
    # the request again, to the vip queue, where it waits for a vip worker.
    fleet.start("default", concurrency=2)
    _start_vip_worker(fleet, vip_queue, concurrency=1)
    result = run_agent.apply_async((calls("k1", "k2"), "vip-k"), {"agent": "vip"},
                                   queue=vip_queue)
    wait_for_execution(fleet.dsn, "k1")
    fleet.kill("vip")
    wait_swept_again(fleet, result.id)
    wait_sweeps_for(fleet, 3)
    assert ledger(fleet.dsn, result.id)["status"] in ("running", "queued")
    assert "unknown agent" not in (fleet.logs / "default.log").read_text(errors="replace")
    _start_vip_worker(fleet, vip_queue, concurrency=1)
    assert result.get(timeout=60)["output"] == "done: recorded k1, recorded k2"


def wait_swept_again(fleet: Fleet, request_id: str, timeout: float = 60) -> None:
    """Wait until the sweeper dispatched ``request_id`` again."""
    wait_until(lambda: _redispatches(fleet), f"the sweeper dispatched {request_id} again",
               timeout, until=lambda sent: request_id in sent, every=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("broker", ["redis", "rabbitmq"], indirect=True)
def test_messages_a_worker_holds_for_a_rate_limit_are_not_sent_again(
    fleet: Fleet, broker: str
) -> None:
    # 30/m: one run every 2 s. The worker holds the messages it took, waiting
    # for their slot, far longer than the sweeper's grace: they are in no
    # queue the broker counts, and the worker says it holds them.
    fleet.start("w1", concurrency=2)
    replies = app.control.rate_limit(RUN_AGENT, "30/m", reply=True, timeout=5,
                                     destination=[f"w1-{fleet.queue}@{os.uname().nodename}"])
    assert replies and all("ok" in next(iter(r.values())) for r in replies), replies
    results = [run_agent.delay(calls(f"r{i}"), f"rate-{i}") for i in range(4)]
    for i, result in enumerate(results):
        assert result.get(timeout=120)["output"] == f"done: recorded r{i}"
    assert _redispatches(fleet) == []
    log = (fleet.logs / "w1.log").read_text(errors="replace")
    assert len(re.findall(r"request \S+ succeeded", log)) == 4
    assert "already succeeded" not in log


def _celery_call(fleet: Fleet, *args: str) -> str:
    """``celery call`` from a process with the fleet's settings; the task id."""
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "loomflow_worker.tasks", "call", RUN_AGENT,
         *args], cwd=ROOT, env=fleet.env, capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_celery_call_with_a_countdown_records_when_the_request_may_start(fleet: Fleet) -> None:
    fleet.start("w1", concurrency=1)
    request_id = _celery_call(
        fleet, "--args", json.dumps([calls("c1"), "countdown"]), "--countdown", "4",
        "--queue", fleet.queue)
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        row = wait_until(lambda: conn.execute(
            "SELECT not_before, enqueued_at FROM runs WHERE request_id = %s",
            (request_id,)).fetchone(), "a ledger row for the message", 30, every=0.05)
        assert row is not None
        not_before, enqueued_at = row
        # Recorded on receipt, seconds before its eta, with that eta.
        assert not_before is not None and 2 < (not_before - enqueued_at).total_seconds() <= 4.5
        assert conn.execute("SELECT routing->>'queue' FROM runs WHERE request_id = %s",
                            (request_id,)).fetchone() == (fleet.queue,)
    assert wait_status(fleet.dsn, request_id, ("succeeded",)) == "succeeded"
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        started = conn.execute("SELECT min(started_at) FROM run_attempts WHERE request_id = %s",
                               (request_id,)).fetchone()
    assert started is not None and started[0] >= not_before
    assert _redispatches(fleet) == []


@pytest.mark.slow
def test_the_leader_reports_every_waiting_request_parked_or_not(
    fleet: Fleet, vip_queue: str
) -> None:
    # Three requests on one session (one runs, two park: acked, in no broker
    # queue) and one in a queue no worker reads: the gauge counts the three
    # waiting, per queue.
    port = free_port()
    fleet.start("w1", concurrency=2, TEST_TOOL_SLEEP="3", LOOMFLOW_WORKER_METRICS_PORT=str(port))
    session = f"gauge-{uuid.uuid4().hex[:6]}"
    running = run_agent.delay(calls("g0"), session)
    parked = [run_agent.delay(calls(f"g{i}"), session) for i in (1, 2)]
    run_agent.apply_async((calls("gv"), "gauge-vip"), queue=vip_queue)
    wait_status(fleet.dsn, running.id, ("running",))
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        wait_until(lambda: conn.execute("SELECT count(*) FROM runs WHERE status = 'queued' "
                                        "AND received_at IS NOT NULL").fetchone(),
                   "the two requests parked (seen as: how many)", 30,
                   until=lambda parked: parked == (2,), every=0.1)
    gauge = "loomflow_worker_queued_requests"

    def waiting() -> tuple[float, float]:
        """The gauge's requests waiting in the default queue and in the vip one."""
        samples = {k: v for k, v in scrape(port).items() if k.startswith(gauge)}
        return (sum(v for k, v in samples.items() if f'queue="{fleet.queue}"' in k),
                sum(v for k, v in samples.items() if f'queue="{vip_queue}"' in k))

    wait_until(waiting, "the gauge counts 2 waiting in the default queue, 1 in the vip one",
               30, until=lambda seen: seen == (2, 1), every=0.2)
    # KEDA's trigger on the ledger (deploy/k8s/scaledobject.yaml) counts the same.
    assert _keda_count(fleet) == 2
    for result in (running, *parked):
        result.get(timeout=60)


def _keda_count(fleet: Fleet) -> int:
    """What the deploy files' KEDA PostgreSQL trigger reads, for the fleet's queue."""
    import yaml  # type: ignore[import-untyped]

    docs = yaml.safe_load_all((ROOT / "deploy/k8s/scaledobject.yaml").read_text())
    (trigger,) = [t for d in docs if d["kind"] == "ScaledObject"
                  for t in d["spec"]["triggers"] if t["type"] == "postgresql"]
    sql = trigger["metadata"]["query"].replace("'loomflow'", f"'{fleet.queue}'")
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        row = conn.execute(sql).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.slow
def test_a_fleet_that_reads_the_celery_queue_runs_a_bare_send_task(fleet: Fleet) -> None:
    # The README's remedy for a client that cannot name the queue: the
    # workers add Celery's default `celery` queue. A plain Celery app (no
    # loomflow_worker config) sends by name; the request gets its ledger row,
    # routed to that queue, and runs.
    from celery import Celery

    from .celery_harness import REDIS_URL

    fleet.start("w1", concurrency=2, args=("-Q", f"{fleet.queue},celery"))
    bare = Celery("client", broker=REDIS_URL, backend=REDIS_URL)
    bare.conf.broker_transport_options = {"global_keyprefix": fleet.prefix}
    bare.conf.result_backend_transport_options = {"global_keyprefix": fleet.prefix}
    try:
        sent = bare.send_task(RUN_AGENT, args=[calls("bare"), "bare-session"])
        assert sent.get(timeout=60)["output"] == "done: recorded bare"
    finally:
        bare.close()
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT routing->>'queue' FROM runs WHERE request_id = %s",
                            (sent.id,)).fetchone() == ("celery",)


@pytest.mark.slow
def test_celery_control_shutdown_waits_for_the_runs_to_finish(fleet: Fleet) -> None:
    # Celery's remote shutdown is its warm shutdown: unlike SIGTERM's soft
    # shutdown (SOFT_SHUTDOWN_TIMEOUT, then the runs are requeued), the run in
    # flight finishes on this worker, in one attempt, before it exits.
    fleet.start("w1", concurrency=2, cli=True, TEST_TOOL_SLEEP="4",
                LOOMFLOW_WORKER_SOFT_SHUTDOWN_TIMEOUT="1")
    result = run_agent.delay(calls("d1"), "drain")
    wait_for_execution(fleet.dsn, "d1")
    app.control.shutdown(destination=[f"w1-{fleet.queue}@{os.uname().nodename}"])
    code, _ = fleet.wait_exit("w1", timeout=60)
    assert code == 0
    row = ledger(fleet.dsn, result.id)
    assert (row["status"], row["attempts"]) == ("succeeded", 1)
    assert result.get(timeout=10)["output"] == "done: recorded d1"
