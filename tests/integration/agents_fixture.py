"""Agents the Celery tests' workers import (LOOMFLOW_WORKER_AGENTS)."""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import signal
import sys
import time
from typing import Any

import anyio
import psycopg
from loomflow import Agent

from loomflow_worker import register_agent
from loomflow_worker.tasks import settings
from loomflow_worker.testing import DeterministicModel, EffectsLog
from loomflow_worker.worker.quarantine.child import PROCESS_NAME as ALONE_PROCESS
from tests.waiting import wait_until_async

# SIGUSR2 prints every thread's stack to the worker's output: the harness
# sends it to a worker that does not stop in time, to show where it hangs.
faulthandler.register(signal.SIGUSR2, file=sys.__stderr__, all_threads=True)


async def _on_start(tag: str) -> None:
    # "poison" kills the pool child on every attempt; "block" holds the
    # process's event loop for 30 s, so no timer of the loop can stop it.
    if tag.startswith("poison"):
        await _await_company(float(os.environ.get("TEST_POISON_COMPANY", "0")))
        os.kill(os.getpid(), signal.SIGKILL)
    # "block" holds the event loop (a synchronous wait in an async tool), every
    # other run of the process with it, for TEST_BLOCK_SECONDS (30).
    if tag.startswith("block"):
        time.sleep(float(os.environ.get("TEST_BLOCK_SECONDS", "30")))
    # "lasting" makes its tool call TEST_LASTING_SECONDS (10) longer than the others.
    if tag.startswith("lasting"):
        await anyio.sleep(float(os.environ.get("TEST_LASTING_SECONDS", "10")))


async def _await_company(seconds: float) -> None:
    """Wait up to ``seconds`` until another run of this process is in its
    tool (recorded started, not finished): the poison then kills it too,
    whatever order a redelivery started them in. Alone, it kills after them."""
    if seconds <= 0:
        return
    dsn = settings().database_url.get_secret_value()
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:

        async def company() -> bool:
            cur = await conn.execute(
                "SELECT 1 FROM loomflow_worker_effects WHERE pid = %s AND finished_at IS NULL"
                " AND tag NOT LIKE 'poison%%' LIMIT 1", (os.getpid(),))
            return await cur.fetchone() is not None

        with contextlib.suppress(AssertionError):  # no company came: it kills all the same
            await wait_until_async(company, "another run in its tool", seconds, every=0.05)


class FlakyModel(DeterministicModel):
    """Raises on the first N real calls of this process whose prompt says ``flaky``."""

    async def complete(self, messages: Any, **kwargs: Any) -> Any:
        if any("flaky" in m.content for m in messages) and self.calls < int(
            os.environ.get("TEST_FLAKY_FAILURES", "1")
        ):
            self.calls += 1
            raise RuntimeError("model overloaded (test)")
        return await super().complete(messages, **kwargs)

    async def stream(self, messages: Any, **kwargs: Any) -> Any:
        if any("flaky" in m.content for m in messages) and self.calls < int(
            os.environ.get("TEST_FLAKY_FAILURES", "1")
        ):
            self.calls += 1
            raise RuntimeError("model overloaded (test)")
        async for chunk in super().stream(messages, **kwargs):
            yield chunk


def _effects() -> EffectsLog:
    return EffectsLog(
        settings().database_url.get_secret_value(),
        sleep=float(os.environ.get("TEST_TOOL_SLEEP", "0")),
        on_start=_on_start,
        entries=os.environ.get("TEST_ENTRIES_FILE"),
    )


@register_agent()
def build(runtime: Any) -> Agent:
    return Agent(
        "test agent",
        # TEST_MODEL_LATENCY: seconds each model call waits, as a real model's would.
        model=DeterministicModel(latency=float(os.environ.get("TEST_MODEL_LATENCY", "0"))),
        tools=[_effects().tool()],
        runtime=runtime,
        auto_extract=False,
        # TEST_TELEMETRY=otel: loomflow's own spans, inside each attempt's.
        telemetry=os.environ.get("TEST_TELEMETRY"),
    )


@register_agent("flaky")
def build_flaky(runtime: Any) -> Agent:
    return Agent(
        "an agent whose model fails at first",
        model=FlakyModel(),
        tools=[_effects().tool()],
        runtime=runtime,
        auto_extract=False,
    )


def _die_after_commit() -> None:
    """Kill the pool child right after a run's finishing commit, before Celery
    stores the result or acks the message (once: a marker file says it happened)."""
    from loomflow_worker.tasks import perform as task_app

    execute = task_app.execute
    marker = os.environ["TEST_DIE_AFTER_COMMIT"]

    async def execute_then_die(*args: Any, **kwargs: Any) -> Any:
        outcome = await execute(*args, **kwargs)
        if outcome.kind == "succeeded" and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return outcome

    task_app.execute = execute_then_die  # type: ignore[assignment]


if os.environ.get("TEST_DIE_AFTER_COMMIT"):
    _die_after_commit()


def _die_on_receipt() -> None:
    """Kill the worker as it receives one request's message, before it starts
    it (TEST_DIE_ON_RECEIPT=<request id>:<marker>), once: the marker file says
    it happened."""
    from celery.signals import task_received

    request_id, marker = os.environ["TEST_DIE_ON_RECEIPT"].split(":", 1)

    @task_received.connect(weak=False)
    def received(request: Any = None, **_: Any) -> None:
        if request is not None and request.id == request_id and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


if os.environ.get("TEST_DIE_ON_RECEIPT"):
    _die_on_receipt()


def _hold_first_start() -> None:
    """Hold the lock connection in a turn just before or after the first start
    of a request (TEST_HOLD_START=before:<marker> or after:<marker>: before
    its statement, or after it committed; alone:<marker>: after it committed, in a process
    running a request alone), once: the marker file, written then, tells the
    test to end the connection while the start's turn is in flight, as a
    Postgres restart would."""
    from loomflow_worker.execution import ledger
    from loomflow_worker.runtime.store import Lease

    when, marker = os.environ["TEST_HOLD_START"].split(":", 1)
    # A process running a request alone is forked from a server that imported
    # this module: it is told by its name, when the start comes.
    alone = when == "alone"
    if alone:
        when = "after"
    start, send = ledger.start, Lease.send
    starts: list[Any] = []

    async def hold(conn: Any) -> None:
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        await conn.execute("SELECT pg_sleep(60)")

    def start_noted(*args: Any, **kwargs: Any) -> Any:
        starts.append(start(*args, **kwargs))
        return starts[-1]

    async def send_held(lease: Any, batch: Any) -> Any:
        first = batch in starts and not os.path.exists(marker) and (
            not alone or multiprocessing.current_process().name.startswith(ALONE_PROCESS))
        if first and when == "before":
            await lease.io(hold)
        started = await send(lease, batch)
        if first and when == "after":
            await lease.io(hold)
        return started

    ledger.start = start_noted  # type: ignore[assignment]
    Lease.send = send_held  # type: ignore[method-assign]


if os.environ.get("TEST_HOLD_START"):
    _hold_first_start()


@register_agent("quick", time_limit=1.0)
def build_quick(runtime: Any) -> Agent:
    """An agent whose runs may take one second at most."""
    return Agent(
        "a hurried agent",
        model=DeterministicModel(),
        tools=[_effects().tool()],
        runtime=runtime,
        auto_extract=False,
    )


@register_agent("slow-model")
def build_slow_model(runtime: Any) -> Agent:
    """An agent that only waits on its model (TEST_MODEL_LATENCY seconds a call)
    and opens no connection of its own."""
    return Agent(
        "an agent that waits on its model",
        model=DeterministicModel(latency=float(os.environ.get("TEST_MODEL_LATENCY", "0"))),
        runtime=runtime,
        auto_extract=False,
    )


@register_agent("claude", version=os.environ.get("TEST_CLAUDE_VERSION"))
def build_claude(runtime: Any) -> Agent:
    """loomflow's real AnthropicModel, pointed by ANTHROPIC_BASE_URL at the
    tests' local Messages API; TEST_CLAUDE_INSTRUCTIONS stands in for a deploy
    that changed the agent's instructions, TEST_CLAUDE_VERSION for a version
    declared by hand."""
    from loomflow.model.anthropic import AnthropicModel

    model = AnthropicModel(
        "claude-sonnet-4-6", api_key=os.environ.get("ANTHROPIC_API_KEY"), request_timeout_s=10
    )
    return Agent(
        os.environ.get("TEST_CLAUDE_INSTRUCTIONS", "v1"),
        model=model,
        tools=[_effects().tool()],
        runtime=runtime,
        auto_extract=False,
    )
