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
from tests.waiting import wait_until

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

        def ready() -> bool:
            if log.exists() and "ready." in log.read_text(errors="replace"):
                return True
            if proc.poll() is not None:
                out = (self.logs / f"{name}.out").read_text(errors="replace")
                raise RuntimeError(f"worker {name} exited at start:\n{out}")
            return False

        wait_until(ready, f"worker {name} ready", timeout, every=0.05,
                   detail=lambda: log.read_text(errors="replace") if log.exists() else "")

    def node(self, name: str) -> str:
        """The Celery node name of worker ``name``."""
        return f"{name}-{self.queue}@{os.uname().nodename}"

    def take_queue(self, names: tuple[str, ...], timeout: float = 30) -> None:
        """Have workers ``names``, started with ``args=("-Q", <another queue>)``,
        take the fleet's queue too, together: none of them takes its messages
        before the others are up. Each confirms it."""
        nodes = [self.node(name) for name in names]
        wait_until(
            lambda: tasks.app.control.add_consumer(self.queue, destination=nodes, reply=True,
                                                   timeout=2),
            f"workers {', '.join(names)} taking queue {self.queue}", timeout,
            until=lambda replies: {node for reply in replies for node in reply} >= set(nodes))

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

        def pending() -> list[str]:
            text = log.read_text(errors="replace") if log.exists() else ""
            return sorted(rid for rid in request_ids if not re.search(_ENDED.format(rid), text))

        wait_until(pending, f"worker {name}'s tasks ended (seen as: those still running)",
                   timeout, until=lambda left: not left, every=0.05)

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
        received, _ = wait_until(
            lambda: self.deliveries(request_id),
            f"{request_id}: {count} deliveries, all ended (seen as: received, ended)",
            timeout, until=lambda seen: seen[0] >= count and seen[1] == seen[0], every=0.05)
        return received

    def wait_logged(self, needle: str, timeout: float = 30) -> None:
        """Wait until a worker of the fleet logs ``needle``."""
        wait_until(lambda: any(needle in p.read_text(errors="replace")
                               for p in self.logs.glob("*.log")),
                   f"a worker logged {needle!r}", timeout, every=0.05)

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
    return wait_until(lambda: str(ledger(dsn, request_id)["status"]),
                      f"request {request_id} {' or '.join(statuses)}", timeout,
                      until=lambda status: status in statuses, every=0.05)


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
    began = None  # the first sweep seen to begin past that moment

    with psycopg.connect(fleet.dsn, autocommit=True) as conn:

        def sweeps() -> tuple[int, object, object]:
            """Its results waiting to be checked, the last sweep begun past
            that moment, and the first one seen."""
            nonlocal began
            row = conn.execute(
                "SELECT (SELECT count(*) FROM results_to_check WHERE request_id = %(r)s),"
                " (SELECT l.heartbeat_at FROM sweeper_leader l, runs r"
                "   WHERE r.request_id = %(r)s"
                "     AND l.heartbeat_at > r.finished_at + make_interval(secs => %(after)s))",
                {"r": request_id, "after": after},
            ).fetchone()
            assert row is not None
            began = began or row[1]
            return int(row[0]), row[1], began

        # None waiting, and a sweep began after the first one, so that one ended.
        wait_until(sweeps, f"the sweeper settled {request_id} (seen as: results to "
                   "check, last sweep, first sweep)", timeout,
                   until=lambda seen: seen[0] == 0 and seen[2] is not None
                   and seen[1] is not None and seen[1] > seen[2], every=0.1)


def wait_sweeps_for(fleet: Fleet, seconds: float = 0.0, timeout: float = 60) -> None:
    """Wait until a whole sweep of the sweeper's leader ran past ``seconds``
    after now (on the database's clock): one began past that moment, and a
    later one began, so it ended. Whatever the sweeper would do by then about
    what the ledger says, it has done."""
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT now() + make_interval(secs => %s)", (seconds,)).fetchone()
        assert row is not None
        since = row[0]
        began = None  # the first sweep seen to begin past that moment

        def sweeps() -> tuple[object, object]:
            """The last sweep begun past that moment, and the first one seen."""
            nonlocal began
            row = conn.execute("SELECT heartbeat_at FROM sweeper_leader").fetchone()
            last = row[0] if row is not None and row[0] > since else None
            began = began or last
            return last, began

        wait_until(sweeps, f"a whole sweep past {seconds:g}s from now (seen as: last "
                   "sweep, first sweep)", timeout, every=0.05,
                   until=lambda seen: seen[0] is not None and seen[1] is not None
                   and seen[0] > seen[1])


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
