"""Real `celery worker` processes for the tests, on a keyspace and queue of their own."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
import redis

from loomflow_worker import tasks
from loomflow_worker.settings import Settings
from tests.needs import AMQP_URL, RABBITMQ, REDIS_URL
from tests.needs import REDIS_PORT as REDIS_PORT  # the tests' import of it from here

BROKERS = {"redis": REDIS_URL, "rabbitmq": AMQP_URL}
ROOT = Path(__file__).resolve().parents[2]
AGENTS = "tests.integration.agents_fixture"


@dataclass
class Fleet:
    dsn: str
    prefix: str
    queue: str
    logs: Path
    env: dict[str, str]
    workers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(
        self,
        name: str,
        concurrency: int = 2,
        *,
        cli: bool = False,
        pool: str = "prefork",
        gossip: bool = False,
        wait: bool = True,
        args: tuple[str, ...] = (),
        own_pids: bool = False,
        **extra_env: str,
    ) -> subprocess.Popen[bytes]:
        """Start a worker; ``cli=True`` starts it with ``loomflow-worker worker``
        (soft shutdown on SIGTERM) instead of plain ``celery worker``;
        ``gossip=True`` keeps Celery's gossip and mingle on (its defaults);
        ``wait=False`` returns at once (:meth:`wait_ready` waits for it);
        ``args`` are more options for the worker; ``own_pids=True`` starts it
        in a pid namespace of its own, as a container runs it: its main
        process is pid 1 there, every time."""
        log = self.logs / f"{name}.log"
        if log.exists():
            log.unlink()
        env = {**self.env, **extra_env}
        command = (
            [sys.executable, "-m", "loomflow_worker.cli", "worker"]
            if cli
            else [sys.executable, "-m", "celery", "-A", "loomflow_worker.tasks", "worker"]
        )
        if own_pids:
            command = ["unshare", "--pid", "--fork", "--mount-proc", *command]
        proc = subprocess.Popen(
            # Node names are unique per fleet: RabbitMQ holds one exclusive
            # control queue per name, and other fleets may run beside this one.
            [*command, "-c", str(concurrency), "-n", f"{name}-{self.queue}@%h", "-P", pool,
             *(() if gossip else ("--without-gossip", "--without-mingle")),
             "-l", "INFO", "-f", str(log), *args],
            cwd=ROOT, env=env, stdout=(self.logs / f"{name}.out").open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.workers[name] = proc
        if wait:
            self.wait_ready(name)
        return proc

    def wait_ready(self, name: str, timeout: float = 60) -> None:
        """Wait until worker ``name`` says it is ready."""
        proc, log = self.workers[name], self.logs / f"{name}.log"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if log.exists() and "ready." in log.read_text(errors="replace"):
                return
            if proc.poll() is not None:
                out = (self.logs / f"{name}.out").read_text(errors="replace")
                raise RuntimeError(f"worker {name} exited at start:\n{out}")
            time.sleep(0.05)
        raise RuntimeError(f"worker {name} not ready: {log.read_text(errors='replace')}")

    def wait_exit(self, name: str, timeout: float = 60) -> tuple[int, str]:
        """Wait until worker ``name`` exits; its exit code and what it printed."""
        proc = self.workers.pop(name)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            raise AssertionError(f"worker {name} still running after {timeout:g}s") from None
        return code, (self.logs / f"{name}.out").read_text(errors="replace")

    def kill(self, name: str) -> None:
        """SIGKILL a whole worker: main process and its pool children."""
        proc = self.workers.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def terminate(self, name: str, timeout: float = 60) -> None:
        """SIGTERM the worker's main process, as an orchestrator does, and wait."""
        proc = self.workers.pop(name)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # Every process of the worker prints its threads' stacks, so the
            # failure shows where it hangs: Celery's main process on SIGUSR1,
            # the pool children on SIGUSR2 (see agents_fixture).
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
            with contextlib.suppress(OSError):
                for child in children.read_text().split():
                    os.kill(int(child), signal.SIGUSR2)
                os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(2)
            raise AssertionError(
                f"worker {name} did not stop {timeout:g}s after SIGTERM:\n"
                + (self.logs / f"{name}.out").read_text(errors="replace")[-12000:]
                + "\n--- log\n" + (self.logs / f"{name}.log").read_text(errors="replace")[-6000:]
            ) from None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

    def worker_of(self, child_pid: int) -> str:
        """The name of the worker whose pool child is ``child_pid``."""
        stat = Path(f"/proc/{child_pid}/stat").read_text()
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        for name, proc in self.workers.items():
            if proc.pid in (parent, child_pid):
                return name
        raise LookupError(f"pid {child_pid} belongs to no worker of this fleet")

    def stop_all(self) -> None:
        for name in list(self.workers):
            self.kill(name)

    def wait_tasks_ended(self, name: str, request_ids: list[str], timeout: float = 30) -> None:
        """Wait until worker ``name``'s log says its task of each of ``request_ids``
        ended (succeeded, raised, retried, was ignored or rejected)."""
        log = self.logs / f"{name}.log"
        pending = set(request_ids)
        deadline = time.monotonic() + timeout
        while pending:
            text = log.read_text(errors="replace") if log.exists() else ""
            pending = {rid for rid in pending if not re.search(_ENDED.format(rid), text)}
            if pending:
                assert time.monotonic() < deadline, (
                    f"worker {name} still running {sorted(pending)[:5]} after {timeout:g}s"
                )
                time.sleep(0.05)

    def deliveries(self, request_id: str) -> tuple[int, int]:
        """How many times the fleet's workers received the message of
        ``request_id`` (a duplicate or a redelivery counts again), and how
        many of those deliveries ended."""
        text = "\n".join(p.read_text(errors="replace") for p in self.logs.glob("*.log"))
        return (len(re.findall(rf"Task \S+\[{request_id}\] received", text)),
                len(re.findall(_ENDED.format(request_id), text)))

    def wait_deliveries(self, request_id: str, count: int, timeout: float = 30) -> int:
        """Wait until the workers received ``request_id``'s message at least
        ``count`` times and every delivery so far ended; how many there were."""
        deadline = time.monotonic() + timeout
        while True:
            received, ended = self.deliveries(request_id)
            if received >= count and ended == received:
                return received
            assert time.monotonic() < deadline, (
                f"{request_id}: {received} deliveries, {ended} ended, after {timeout:g}s")
            time.sleep(0.05)

    def wait_logged(self, needle: str, timeout: float = 30) -> None:
        """Wait until a worker of the fleet logs ``needle``."""
        deadline = time.monotonic() + timeout
        while not any(needle in p.read_text(errors="replace") for p in self.logs.glob("*.log")):
            assert time.monotonic() < deadline, f"no worker logged {needle!r} in {timeout:g}s"
            time.sleep(0.05)

    def log_text(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
            for p in self.logs.glob("*.log")
        )


# A worker's log line saying its task of a request ended; format with the request id.
_ENDED = r"Task \S+\[{}\] (succeeded|raised|retry|ignored|reject)"


def ledger(dsn: str, request_id: str) -> dict[str, object]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(
            "SELECT status, attempts, failures, crashes, epoch, error, error_type, result "
            "FROM runs WHERE request_id = %s",
            (request_id,),
        )
        row = cur.fetchone()
        assert row is not None, f"no ledger row for {request_id}"
        names = [d.name for d in cur.description or ()]
        return dict(zip(names, row, strict=True))


def wait_status(dsn: str, request_id: str, statuses: tuple[str, ...], timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    status = ""
    while time.monotonic() < deadline:
        status = str(ledger(dsn, request_id)["status"])
        if status in statuses:
            return status
        time.sleep(0.05)
    raise AssertionError(f"request {request_id} still {status!r} after {timeout}s")


#: A fleet's sweeper that looks at a finished request's result a second after
#: it finished (HANDOFF_GRACE, two heartbeats), not six: for tests that wait
#: until it had its chance (``fleet.env.update(QUICK_RESULT_CHECK)``, then
#: :func:`wait_swept`).
QUICK_RESULT_CHECK = {"LOOMFLOW_WORKER_SWEEP_INTERVAL": "0.5",
                      "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "0.5",
                      "LOOMFLOW_WORKER_HANDOFF_GRACE": "1"}


def wait_swept(fleet: Fleet, request_id: str, timeout: float = 60) -> None:
    """Wait until the sweeper has had its chance to act on finished
    ``request_id`` (store its result, dispatch it again): its
    ``results_to_check`` row is gone, and the sweeper's leader completed a
    sweep that began past the moment it would have looked for the result
    (on the fleet's settings)."""
    settings = tasks.settings()
    grace = float(fleet.env.get("LOOMFLOW_WORKER_HANDOFF_GRACE", settings.handoff_grace))
    beat = float(fleet.env.get("LOOMFLOW_WORKER_HEARTBEAT_INTERVAL", settings.heartbeat_interval))
    after = max(grace, 2 * beat) + 1.0
    deadline = time.monotonic() + timeout
    seen = None
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        while True:
            row = conn.execute(
                "SELECT (SELECT count(*) FROM results_to_check WHERE request_id = %(r)s),"
                " (SELECT l.heartbeat_at FROM sweeper_leader l, runs r"
                "   WHERE r.request_id = %(r)s"
                "     AND l.heartbeat_at > r.finished_at + make_interval(secs => %(after)s))",
                {"r": request_id, "after": after},
            ).fetchone()
            assert row is not None
            waiting, claimed = row
            if seen is None:
                seen = claimed  # a sweep began past that moment
            elif waiting == 0 and claimed is not None and claimed > seen:
                return  # ... and a later one began, so it ended
            assert time.monotonic() < deadline, f"the sweeper did not settle {request_id}"
            time.sleep(0.1)


def wait_sweeps_for(fleet: Fleet, seconds: float = 0.0, timeout: float = 60) -> None:
    """Wait until a whole sweep of the sweeper's leader ran past ``seconds``
    after now (on the database's clock): one began past that moment, and a
    later one began, so it ended. Whatever the sweeper would do by then about
    what the ledger says, it has done."""
    deadline = time.monotonic() + timeout
    began = None
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT now() + make_interval(secs => %s)", (seconds,)).fetchone()
        assert row is not None
        since = row[0]
        while True:
            row = conn.execute("SELECT heartbeat_at FROM sweeper_leader").fetchone()
            if row is not None and row[0] > since:
                if began is not None and row[0] > began:
                    return
                began = row[0]
            assert time.monotonic() < deadline, f"no whole sweep past {seconds:g}s from now"
            time.sleep(0.05)


@pytest.fixture
def broker(request: pytest.FixtureRequest) -> str:
    """The broker a fleet uses; parametrize with ``@pytest.mark.parametrize("broker",
    ["redis", "rabbitmq"], indirect=True)``."""
    return str(getattr(request, "param", "redis"))


@pytest.fixture
def fleet(dsn: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    broker_name = getattr(request, "param", None) or request.getfixturevalue("broker")
    if broker_name == "rabbitmq":
        RABBITMQ.require()
    broker_url = BROKERS[broker_name]
    prefix = f"lfwtest:{uuid.uuid4().hex[:8]}:"
    queue = f"lfw-{uuid.uuid4().hex[:8]}"
    settings = Settings(
        database_url=dsn,  # type: ignore[arg-type]
        broker_url=broker_url,  # type: ignore[arg-type]
        result_backend=REDIS_URL,  # type: ignore[arg-type]
        redis_key_prefix=prefix,
        queue=queue,
        agents=[AGENTS],
        retry_backoff=0.2,
        retry_backoff_max=1.0,
    )
    previous = tasks.settings()
    tasks.configure(settings)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("LOOMFLOW_WORKER_")},
        "LOOMFLOW_WORKER_DATABASE_URL": dsn,
        "LOOMFLOW_WORKER_BROKER_URL": broker_url,
        "LOOMFLOW_WORKER_RESULT_BACKEND": REDIS_URL,
        "LOOMFLOW_WORKER_REDIS_KEY_PREFIX": prefix,
        "LOOMFLOW_WORKER_QUEUE": queue,
        "LOOMFLOW_WORKER_AGENTS": AGENTS,
        "LOOMFLOW_WORKER_RETRY_BACKOFF": "0.2",
        "LOOMFLOW_WORKER_RETRY_BACKOFF_MAX": "1.0",
        "PYTHONPATH": str(ROOT),
    }
    fleet = Fleet(dsn, prefix, queue, tmp_path, env)
    try:
        yield fleet
    finally:
        fleet.stop_all()
        tasks.configure(previous)
        if broker_name == "rabbitmq":
            for name in [queue, *_version_queues(dsn, queue)]:
                _delete_amqp_queue(name)
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


def _version_queues(dsn: str, queue: str) -> list[str]:
    """The queues of the agent versions the fleet's workers registered."""
    from loomflow_worker.execution.versions import queue_suffix

    with psycopg.connect(dsn, autocommit=True) as conn:
        pairs = conn.execute("SELECT DISTINCT agent, version FROM worker_agents").fetchall()
    return [queue + queue_suffix(agent, version) for agent, version in pairs]


def _delete_amqp_queue(queue: str) -> None:
    from kombu import Connection

    with Connection(AMQP_URL, connect_timeout=5) as conn:
        channel = conn.channel()
        with contextlib.suppress(Exception):
            channel.queue_delete(queue)
