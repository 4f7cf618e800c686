"""A plain Celery app for ``bench_celery.py``: the bench agent on loomflow's own runtime.

``celery -A bench.plain_celery_app worker`` runs :func:`run_agent`, which runs the same agent
as ours (``bench/agents_bench.py``) on ``loomflow.runtime.PostgresRuntime`` (asyncpg). Each
pool child makes, at ``worker_process_init``, one event loop in a thread of its own, one
runtime (connection pool) and one agent, and keeps them for its life: the same shape as
loomflow_worker's pool children. No ledger, no scope lock across processes, no handoff.

Delivery settings are plain Celery's defaults (``acks_late`` off, prefetch multiplier 4),
unless ``BENCH_PLAIN_ACKS_LATE=1`` asks for ours' (``acks_late``, ``reject_on_worker_lost``,
prefetch multiplier 1). Configured from ``BENCH_PLAIN_*`` variables at import, or by
:func:`configure` in the process that enqueues.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from celery import Celery
from celery.signals import worker_process_init, worker_process_shutdown
from loomflow.core.types import Event
from loomflow.runtime import PostgresRuntime

from bench.agents_bench import build_agent, expected_output

log = logging.getLogger("bench.plain_celery_app")

T = TypeVar("T")

app = Celery("bench_plain")


@dataclass(frozen=True)
class PlainConfig:
    database_url: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    broker_url: str = "redis://127.0.0.1:6379/0"
    result_backend: str = "redis://127.0.0.1:6379/1"
    redis_key_prefix: str = ""
    queue: str = "bench-plain"
    acks_late: bool = False
    pool_min_size: int = 1
    pool_max_size: int = 4

    @classmethod
    def from_env(cls) -> PlainConfig:
        env = os.environ.get
        default = cls()
        return cls(
            database_url=env("BENCH_PLAIN_DATABASE_URL", default.database_url),
            broker_url=env("BENCH_PLAIN_BROKER_URL", default.broker_url),
            result_backend=env("BENCH_PLAIN_RESULT_BACKEND", default.result_backend),
            redis_key_prefix=env("BENCH_PLAIN_REDIS_KEY_PREFIX", default.redis_key_prefix),
            queue=env("BENCH_PLAIN_QUEUE", default.queue),
            acks_late=env("BENCH_PLAIN_ACKS_LATE", "0") == "1",
            pool_min_size=int(env("BENCH_PLAIN_POOL_MIN_SIZE", str(default.pool_min_size))),
            pool_max_size=int(env("BENCH_PLAIN_POOL_MAX_SIZE", str(default.pool_max_size))),
        )

    def env(self) -> dict[str, str]:
        """The ``BENCH_PLAIN_*`` variables a worker needs to read this configuration."""
        return {
            "BENCH_PLAIN_DATABASE_URL": self.database_url,
            "BENCH_PLAIN_BROKER_URL": self.broker_url,
            "BENCH_PLAIN_RESULT_BACKEND": self.result_backend,
            "BENCH_PLAIN_REDIS_KEY_PREFIX": self.redis_key_prefix,
            "BENCH_PLAIN_QUEUE": self.queue,
            "BENCH_PLAIN_ACKS_LATE": "1" if self.acks_late else "0",
            "BENCH_PLAIN_POOL_MIN_SIZE": str(self.pool_min_size),
            "BENCH_PLAIN_POOL_MAX_SIZE": str(self.pool_max_size),
        }


_config: list[PlainConfig] = []


def configure(config: PlainConfig) -> None:
    """Point the app at ``config``: the same broker settings as ours, plain delivery."""
    _config[:] = [config]
    transport: dict[str, Any] = {}
    if config.redis_key_prefix:
        transport["global_keyprefix"] = config.redis_key_prefix
    delivery: dict[str, Any] = (
        {"task_acks_late": True, "task_reject_on_worker_lost": True,
         "worker_prefetch_multiplier": 1}
        if config.acks_late
        else {}
    )
    app.conf.update(
        broker_url=config.broker_url,
        result_backend=config.result_backend,
        broker_transport_options=dict(transport),
        result_backend_transport_options=dict(transport),
        task_default_queue=config.queue,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        **delivery,
    )


configure(PlainConfig.from_env())


class _ChildLoop:
    """One event loop per pool child, running in a thread of its own."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="bench-plain loop", daemon=True
        )
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self.loop is None:
            self.start()
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        if self.loop is None:
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self.thread is not None:
            self.thread.join(timeout=10)
        self.loop.close()
        self.loop = self.thread = None


_loop = _ChildLoop()
_child: dict[str, Any] = {}


async def _open() -> None:
    config = _config[0]
    runtime = await PostgresRuntime.connect(
        config.database_url, min_size=config.pool_min_size, max_size=config.pool_max_size
    )
    _child["runtime"] = runtime
    _child["agent"] = build_agent(runtime)


async def _close() -> None:
    runtime: PostgresRuntime | None = _child.pop("runtime", None)
    _child.pop("agent", None)
    if runtime is not None:
        await runtime.aclose()


@worker_process_init.connect  # type: ignore[untyped-decorator]
def _open_child(**_: Any) -> None:
    _loop.start()
    _loop.run(_open())


@worker_process_shutdown.connect  # type: ignore[untyped-decorator]
def _close_child(**_: Any) -> None:
    try:
        _loop.run(_close())
    except Exception:
        log.exception("closing the pool child's runtime failed")
    _loop.stop()


async def _noop_emit(event: Event) -> None:
    return None


async def _run(prompt: str, session_id: str, request_id: str) -> dict[str, Any]:
    if "agent" not in _child:
        await _open()
    started = time.time()
    result = await _child["agent"].run(
        prompt, session_id=session_id, metadata={"request_id": request_id}, emit=_noop_emit
    )
    payload: dict[str, Any] = result.model_dump(mode="json")
    # When the run held its session: runs on one session may overlap across processes here
    # (loomflow's runtime serializes a session within one process only); the bench counts it.
    payload.update(request_id=request_id, run_started=started, run_ended=time.time())
    return payload


@app.task(bind=True, name="bench.plain_run_agent")  # type: ignore[untyped-decorator]
def run_agent(self: Any, prompt: str, session_id: str) -> dict[str, Any]:
    """Run the bench agent on ``prompt`` in ``session_id`` with loomflow's PostgresRuntime."""
    return _loop.run(_run(prompt, session_id, str(self.request.id)))


@app.task(name="bench.plain_noop")  # type: ignore[untyped-decorator]
def noop(prompt: str, session_id: str) -> dict[str, Any]:
    """No work, a result: what the bench agent's run answers to ``prompt``,
    read off the prompt. Plain Celery's own cost per task (receive, run,
    store the result, ack), the yardstick ``bench_concurrency.py --yardstick``
    measures ours against."""
    tags = [json.loads(line.split(" ", 2)[2])["tag"] for line in prompt.splitlines()]
    return {"output": expected_output(*tags), "session_id": session_id}
