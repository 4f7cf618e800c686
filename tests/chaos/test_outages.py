"""Broker and result-backend restarts, on a ``redis-server`` or RabbitMQ node
of the test's own.

The shared Redis and RabbitMQ can't be restarted (other tests use them), so
each test starts its own (a Redis keeping its data in an append-only file, a
RabbitMQ node with its own name, ports and data) and restarts it while runs
are in flight. Afterwards every worker's main process still runs, every
request is ``succeeded`` once, and every caller's ``AsyncResult.get()``
returns the run's output."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis
from celery.app.backends import by_url
from celery.result import AsyncResult
from pydantic import SecretStr

from loomflow_worker import tasks
from loomflow_worker.tasks import run_agent
from tests.chaos.checks import (
    Sent,
    assert_sound,
    executions,
    grep_logs,
    install_journal_audit,
    problem_lines,
    request_key,
    send,
    verdict,
    wait_terminal,
)
from tests.integration.celery_harness import Fleet, wait_status
from tests.integration.helpers import calls, wait_until
from tests.integration.services import PrivateRabbitMQ, PrivateRedis

pytestmark = [
    pytest.mark.slow,
    # This process's own result handles: once a test stopped its private Redis
    # for good, Celery's result consumer, unsubscribing as a handle is
    # collected, finds no server and says so from AsyncResult.__del__.
    pytest.mark.filterwarnings(
        r"ignore:Exception ignored in. <function AsyncResult.__del__"
        r":pytest.PytestUnraisableExceptionWarning"),
]

ENV = {
    "TEST_TOOL_SLEEP": "0.3",
    "LOOMFLOW_WORKER_SWEEP_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_LEASE": "5",
}


@contextlib.contextmanager
def _redis(tmp_path: Path, *, persist: bool) -> Iterator[PrivateRedis]:
    workdir = tmp_path / "redis"
    workdir.mkdir()
    server = PrivateRedis(workdir, persist=persist)
    server.start()
    try:
        yield server
    finally:
        # Results of the test's calls unsubscribe from the server when collected:
        # collect them while it still answers.
        gc.collect()
        server.stop()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    with _redis(tmp_path, persist=True) as server:
        yield server


@pytest.fixture
def volatile_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    """A private Redis that keeps nothing on disk: a restart loses every key."""
    with _redis(tmp_path, persist=False) as server:
        yield server


@pytest.fixture
def private_rabbitmq(tmp_path: Path) -> Iterator[PrivateRabbitMQ]:
    workdir = tmp_path / "rabbitmq"
    workdir.mkdir()
    server = PrivateRabbitMQ(workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def use_services(fleet: Fleet, *, broker: str | None = None, backend: str | None = None) -> None:
    """Point the fleet's workers, and this process, at another broker / result backend."""
    current = tasks.settings()
    update: dict[str, SecretStr] = {}
    if broker is not None:
        fleet.env["LOOMFLOW_WORKER_BROKER_URL"] = broker
        update["broker_url"] = SecretStr(broker)
    if backend is not None:
        fleet.env["LOOMFLOW_WORKER_RESULT_BACKEND"] = backend
        update["result_backend"] = SecretStr(backend)
    tasks.configure(current.model_copy(update=update))


def wait_in_flight(dsn: str, after: float, timeout: float = 20) -> list[str]:
    """Tags of tool calls started after ``after`` (epoch seconds) and still running."""
    return wait_until(lambda: [e.tag for e in executions(dsn)
                               if e.finished_at is None and e.started_at.timestamp() > after],
                      "a tool call in flight", timeout)


def wait_running(dsn: str, batch: list[Sent], timeout: float = 20) -> list[str]:
    """Tags of the tool calls in flight once every request of ``batch`` has one."""
    keys = {request_key(s.tags[0]) for s in batch}
    return wait_until(lambda: [e.tag for e in executions(dsn)
                               if e.finished_at is None and request_key(e.tag) in keys],
                      f"requests {sorted(keys)} all in a tool call (seen as: the tags)", timeout,
                      until=lambda tags: {request_key(tag) for tag in tags} == keys)


def check_all(fleet: Fleet, sent: list[Sent], *, fresh_handles: bool = False) -> None:
    """Every request succeeded once, and its Celery result holds its output;
    with ``fresh_handles``, read through new result handles (a handle made
    before a restart may sit on a result subscription Celery gave up)."""
    if fresh_handles:
        # A backend of its own: the app's may hold a result subscription that
        # Celery gave up on during the restarts.
        cls, url = by_url(tasks.settings().result_backend.get_secret_value(), tasks.app.loader)
        backend = cls(app=tasks.app, url=url)
        sent = [dataclasses.replace(s, result=AsyncResult(s.result.id, backend=backend))
                for s in sent]
    wait_terminal(fleet.dsn, sent, timeout=60)
    v = verdict(fleet.dsn, sent)
    print(v.summary())
    assert_sound(v, f"worker log lines:\n{problem_lines(fleet)}")


def wait_reconnected(fleet: Fleet, name: str, connects: int, timeout: float = 60) -> None:
    """Wait for worker ``name``'s ``connects``-th broker connection (its log's
    "Connected to" lines); fail as soon as its main process logs
    "Unrecoverable" or exits instead."""
    proc = fleet.workers[name]
    log = fleet.logs / f"{name}.log"

    def connections() -> int:
        """How many times it connected to the broker so far."""
        text = log.read_text(errors="replace")
        if "Unrecoverable" in text or proc.poll() is not None:
            raise AssertionError(
                f"worker {name}'s main process did not outlive the restart:\n"
                + grep_logs(fleet, "Unrecoverable", "CRITICAL", "consumer:", limit=20))
        return text.count("] Connected to ")

    wait_until(connections, f"worker {name} connected {connects} times (seen as: how many)",
               timeout, until=lambda count: count >= connects, every=0.05,
               detail=lambda: grep_logs(fleet, "consumer:", limit=20))


#: Requests sent before each restart, to a worker taking four at once: with
#: two, it holds their messages unacked while it waits on Redis for more;
#: with four, it takes no more.
ROUNDS = (2, 2, 4)


@pytest.mark.parametrize("cli", [False, True], ids=["celery-worker", "loomflow-worker"])
def test_worker_outlives_redis_restarts(
    fleet: Fleet, private_redis: PrivateRedis, cli: bool
) -> None:
    """Redis restarts under a worker with runs in flight: its main process
    reconnects each time, the runs in flight complete once, and runs sent
    after the restarts complete. The first restarts come while the worker
    holds unacked messages and waits on Redis for more (it used to exit
    there with "Unrecoverable error: AttributeError('NoneType' object has no
    attribute 'hostname')"), the last while it takes no more."""
    use_services(fleet, broker=private_redis.url, backend=private_redis.url)
    install_journal_audit(fleet.dsn)
    worker = fleet.start("w1", 4, cli=cli, pool="threads" if cli else "prefork", gossip=True,
                         **ENV)
    sent: list[Sent] = []
    for round_no, count in enumerate(ROUNDS, start=1):
        batch = [send(i, f"s{i}", "u", "abc") for i in range(len(sent), len(sent) + count)]
        sent += batch
        in_flight = wait_running(fleet.dsn, batch)
        private_redis.restart(down_for=0.5)
        print(f"restart {round_no}: in flight {in_flight}")
        wait_reconnected(fleet, "w1", round_no + 1)
    sent += [send(i, f"s{i % 4}", "u", "a") for i in range(len(sent), len(sent) + 4)]
    check_all(fleet, sent, fresh_handles=True)
    assert worker.poll() is None
    assert grep_logs(fleet, "Unrecoverable") == ""


def test_workers_outlive_a_rabbitmq_restart(
    private_rabbitmq: PrivateRabbitMQ, fleet: Fleet
) -> None:
    """A RabbitMQ restart (RabbitMQ the broker, Redis the result backend) under
    a ``celery worker`` and a ``loomflow-worker worker`` with runs in flight:
    each main process reconnects, the runs in flight complete once (RabbitMQ
    requeues their unacked messages when it closes the connections, and
    delivers them again), and runs sent after the restart complete."""
    use_services(fleet, broker=private_rabbitmq.url)
    install_journal_audit(fleet.dsn)
    fleet.start("w1", 4, gossip=True, **ENV)
    fleet.start("w2", 4, cli=True, pool="threads", gossip=True, **ENV)
    sent = [send(i, f"s{i}", "u", "abcdef") for i in range(6)]
    in_flight = wait_running(fleet.dsn, sent)
    private_rabbitmq.restart(down_for=0.5)
    print(f"restart: in flight {in_flight}")
    for name in fleet.workers:
        wait_reconnected(fleet, name, 2)
    sent += [send(i, f"s{i % 6}", "u", "a") for i in range(6, 10)]
    check_all(fleet, sent)
    assert all(proc.poll() is None for proc in fleet.workers.values())
    assert grep_logs(fleet, "Unrecoverable") == ""


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_results_stored_after_a_backend_outage(
    fleet: Fleet, private_redis: PrivateRedis, pool: str
) -> None:
    """Redis (broker and result backend) down for longer than a worker tries to
    store a result: runs finish meanwhile, their results wait in the ledger
    (``result_stored`` false) and the sweeper stores them once Redis is back;
    every caller's ``get()`` returns the output, none gets a ConnectionError.
    The threads pool's threads share one result backend on a few connections."""
    use_services(fleet, broker=private_redis.url, backend=private_redis.url)
    install_journal_audit(fleet.dsn)
    worker = fleet.start("w1", 4, cli=True, pool=pool, **ENV)
    # Two requests per session: the second is handed the session (a publish)
    # when the first finishes, inside the outage for some.
    sent = [send(i, f"s{i % 4}", "u", "ab") for i in range(8)]
    wait_in_flight(fleet.dsn, 0.0)
    private_redis.stop()
    time.sleep(4.0)  # longer than STORE_RETRY and PUBLISH_RETRY give up after
    private_redis.start()
    check_all(fleet, sent)
    assert worker.poll() is None
    deferred = grep_logs(fleet, "the result backend refused its result")
    stored = grep_logs(fleet, "sweeper: stored the succeeded result")
    print(f"deferred:\n{deferred}\nstored by the sweeper:\n{stored}")
    assert deferred and stored, problem_lines(fleet)
    with psycopg.connect(fleet.dsn) as conn:
        row = conn.execute("SELECT count(*) FROM runs WHERE NOT result_stored").fetchone()
    assert row == (0,)


def test_a_retry_goes_on_without_a_failure_when_the_backend_refuses_its_state(
    fleet: Fleet, private_redis: PrivateRedis
) -> None:
    """The run fails once (its model) while the worker's result backend is down:
    Celery retries it and cannot store the RETRY state. That state is only
    informative (the ledger has the schedule), so the retry goes on as if
    stored: Celery reports no failure of the request (no ``raised unexpected``,
    no FAILURE put in its result's place), the request succeeds, and its result
    is stored once the backend is back."""
    # The worker's result backend only: this process enqueues with the shared one.
    fleet.env["LOOMFLOW_WORKER_RESULT_BACKEND"] = private_redis.url
    private_redis.stop()
    fleet.start("w1", 4, cli=True, pool="threads", **ENV)
    request_id = run_agent.delay(calls("flaky-a"), "s1", agent="flaky").id
    wait_status(fleet.dsn, request_id, ("succeeded",))
    assert grep_logs(fleet, f"[{request_id}] retry"), problem_lines(fleet)
    assert grep_logs(fleet, "raised unexpected", "outside body") == "", problem_lines(fleet)
    private_redis.start()
    wait_until(lambda: _result_stored(fleet.dsn, request_id), "the result stored", 30,
               every=0.1, detail=lambda: problem_lines(fleet))
    assert AsyncResult(request_id, backend=by_url(private_redis.url)[0](
        app=tasks.app, url=private_redis.url)).get(timeout=10)["output"]


def _result_stored(dsn: str, request_id: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT result_stored FROM runs WHERE request_id = %s",
                           (request_id,)).fetchone()
    return bool(row and row[0])


#: How long after its result backend lost everything every caller's ``get()``
#: returns its result again (the leader looks once a sweep, 0.5 s here).
RESTORED_WITHIN = 10.0


@pytest.mark.parametrize("loss", ["restart", "flushall", "eviction"])
def test_results_the_backend_lost_are_stored_again(
    fleet: Fleet, volatile_redis: PrivateRedis, loss: str
) -> None:
    """The result backend, a Redis keeping nothing on disk, restarts (or is
    flushed, or evicts every key with an expiry for want of memory) after 50
    runs finished and their worker stored their results and told the ledger
    so (nothing left for the sweeper to check). The leader finds the mark it
    left there gone (or the server counting evictions), and stores every
    result again from the ledger, each for what is left of its lifetime:
    every caller's ``get()`` returns its output within RESTORED_WITHIN
    seconds."""
    use_services(fleet, backend=volatile_redis.url)
    fleet.start("w1", 8, cli=True, pool="threads", **ENV)
    sent = [run_agent.delay(calls(f"r{i}"), f"s{i}") for i in range(50)]
    outputs = {r.id: r.get(timeout=60)["output"] for r in sent}
    _wait_results_checked(fleet.dsn)
    client = redis.Redis.from_url(volatile_redis.url)
    assert client.exists(_result_key(sent[0].id)) == 1
    # A key of the test's own (with an expiry, as results have): gone after
    # the loss, whereas a result may be back already, stored by the leader.
    sentinel = _result_key("sentinel")
    client.set(sentinel, "1", ex=3600)
    if loss == "restart":
        volatile_redis.restart()
    elif loss == "flushall":
        client.flushall()
    else:
        _evict_all(client)
    assert client.exists(sentinel) == 0
    lost_at = time.monotonic()
    cls, url = by_url(volatile_redis.url, tasks.app.loader)
    backend = cls(app=tasks.app, url=url)
    for request_id, output in outputs.items():
        left = RESTORED_WITHIN - (time.monotonic() - lost_at)
        assert left > 0, f"results not stored again within {RESTORED_WITHIN}s:\n" + (
            problem_lines(fleet))
        assert AsyncResult(request_id, backend=backend).get(timeout=left)["output"] == output
    print(f"every result back {time.monotonic() - lost_at:.2f}s after the {loss}")
    lifetime = tasks.app.backend.expires
    ttls = [client.ttl(_result_key(request_id)) for request_id in outputs]
    assert all(0 < ttl <= lifetime for ttl in ttls), ttls
    assert grep_logs(fleet, "the result backend lost results"), problem_lines(fleet)
    client.close()


def _evict_all(client: redis.Redis) -> None:
    """Make the server evict every key with an expiry (results have one, the
    sweeper's mark has none), as a Redis short of memory does, then give it
    its memory back; one round trip, between two of the leader's looks."""
    client.config_set("maxmemory-policy", "volatile-lru")
    with client.pipeline(transaction=False) as pipe:
        pipe.config_set("maxmemory", 1)
        pipe.set("lfw-test-evict", "x")  # refused, after evicting all it may
        pipe.config_set("maxmemory", 0)
        pipe.execute(raise_on_error=False)
    assert int(client.info("stats")["evicted_keys"]) >= 50


def _result_key(request_id: str) -> str:
    return str(tasks.app.backend.get_key_for_task(request_id).decode())


def _wait_results_checked(dsn: str, timeout: float = 30) -> None:
    """Wait until no finished request waits for the sweeper to check its result."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        wait_until(lambda: conn.execute("SELECT count(*) FROM results_to_check").fetchone(),
                   "every result checked (seen as: how many unchecked)", timeout,
                   until=lambda row: row == (0,), every=0.1)
