"""Real `celery worker` processes for the tests, on a keyspace and queue of their own."""

from __future__ import annotations

import contextlib
import os
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

REDIS_URL = os.environ.get("LOOMFLOW_WORKER_TEST_REDIS", "redis://127.0.0.1:6379/0")
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

    def start(self, name: str, concurrency: int = 2, **extra_env: str) -> subprocess.Popen[bytes]:
        log = self.logs / f"{name}.log"
        env = {**self.env, **extra_env}
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "loomflow_worker.tasks", "worker",
             "-c", str(concurrency), "-n", f"{name}@%h", "-P", "prefork",
             "--without-gossip", "--without-mingle", "-l", "INFO", "-f", str(log)],
            cwd=ROOT, env=env, stdout=(self.logs / f"{name}.out").open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.workers[name] = proc
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if log.exists() and "ready." in log.read_text(errors="replace"):
                return proc
            if proc.poll() is not None:
                out = (self.logs / f"{name}.out").read_text(errors="replace")
                raise RuntimeError(f"worker {name} exited at start:\n{out}")
            time.sleep(0.1)
        raise RuntimeError(f"worker {name} not ready: {log.read_text(errors='replace')}")

    def kill(self, name: str) -> None:
        """SIGKILL a whole worker: main process and its pool children."""
        proc = self.workers.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def stop_all(self) -> None:
        for name in list(self.workers):
            self.kill(name)

    def log_text(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
            for p in self.logs.glob("*.log")
        )


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


@pytest.fixture
def fleet(dsn: str, tmp_path: Path) -> Iterator[Fleet]:
    prefix = f"lfwtest:{uuid.uuid4().hex[:8]}:"
    queue = f"lfw-{uuid.uuid4().hex[:8]}"
    settings = Settings(
        database_url=dsn,  # type: ignore[arg-type]
        broker_url=REDIS_URL,  # type: ignore[arg-type]
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
        "LOOMFLOW_WORKER_BROKER_URL": REDIS_URL,
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
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()
