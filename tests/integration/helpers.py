"""Shared pieces of the integration and chaos tests: test modules import
these from here, never from one another (tests/unit/test_suite_rules.py)."""

from __future__ import annotations

import contextlib
import html
import os
import re
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from loomflow import Agent
from loomflow.runtime import _codec, journal_scope

from loomflow_worker.runtime import PostgresRuntime
from loomflow_worker.testing import DeterministicModel, EffectsLog
from tests.waiting import wait_until as wait_until  # the tests import them from here
from tests.waiting import wait_until_async as wait_until_async

from .celery_harness import ROOT, Fleet


class Crash(BaseException):
    """Stands in for a process dying mid-step (not caught as a tool error)."""


def crash_on(*tags: str) -> Callable[[str], Awaitable[None]]:
    async def hook(tag: str) -> None:
        if tag in tags:
            raise Crash(f"crash in {tag}")

    return hook


@contextmanager
def crashes() -> Iterator[None]:
    """Expect the run to die of :class:`Crash` (possibly inside an exception group)."""
    with pytest.raises(BaseException) as info:
        yield
    exc = info.value
    if isinstance(exc, BaseExceptionGroup):
        assert exc.subgroup(Crash) is not None, f"expected a Crash, got {exc!r}"
    else:
        assert isinstance(exc, Crash), f"expected a Crash, got {exc!r}"


def make_agent(
    runtime: Any,
    effects: EffectsLog,
    *,
    model: DeterministicModel | None = None,
    instructions: str = "test agent",
    **kwargs: Any,
) -> Agent:
    return Agent(
        instructions,
        model=model or DeterministicModel(),
        tools=[effects.tool()],
        runtime=runtime,
        auto_extract=False,
        **kwargs,
    )


def calls(*tags: str) -> str:
    """A prompt asking for one sequential tool call per tag."""
    return "\n".join(f'call record {{"tag": "{tag}"}}' for tag in tags)


async def epoch_of(dsn: str, session_id: str, user_id: str | None = None) -> int | None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT value FROM journal_steps WHERE session_id = %s AND step_name = %s",
            (journal_scope(session_id, user_id), "__run_epoch__"),
        )
        row = await cur.fetchone()
    return None if row is None else int(_codec.loads(bytes(row[0])))


async def journal_rows(dsn: str) -> int:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT (SELECT count(*) FROM journal_steps) + (SELECT count(*) FROM journal_streams)"
        )
        row = await cur.fetchone()
    assert row is not None
    return int(row[0])


def steps_journaled_twice(dsn: str) -> list[tuple[str, str, int]]:
    """Journal keys written more than once: completed steps that ran again.

    The scope's bookkeeping keys (``__run_epoch__``...) are rewritten by design."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT session_id, step_name, count(*) FROM journal_writes "
            "WHERE step_name NOT IN ('__run_epoch__', '__last_run_epoch__') "
            "GROUP BY 1, 2 HAVING count(*) > 1"
        ).fetchall()
    return [(r[0], r[1], int(r[2])) for r in rows]


# ---- waiting on what can be seen (with tests/waiting.py's wait_until) --------------------------


def backends(dsn: str, application: str, statement: str = "%") -> int:
    """How many connections to ``dsn``'s database have an application name
    LIKE ``application`` and a last statement LIKE ``statement``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name LIKE %s AND query LIKE %s", (application, statement)
        ).fetchone()
    assert row is not None
    return int(row[0])


def signal_listeners(dsn: str) -> int:
    """How many processes listen for signals on ``dsn``'s database: a run that
    waits for a signal has its runtime's listener up before it first looks."""
    return backends(dsn, "loomflow-worker signals", "%LISTEN loomflow_worker_signals%")


def tcp_connections(pids: Iterable[int]) -> set[tuple[int, int]]:
    """The TCP sockets processes ``pids`` have open: (local port, remote port)
    of each (on this host's network namespace)."""
    inodes: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    inodes.add(os.readlink(fd))
    found = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if f"socket:[{fields[9]}]" in inodes:
                    found.add((int(fields[1].rsplit(":", 1)[1], 16),
                               int(fields[2].rsplit(":", 1)[1], 16)))
    return found


def connected_to(pid: int, port: int) -> bool:
    """Whether process ``pid`` has a TCP connection to ``port``."""
    return any(remote == port for _, remote in tcp_connections([pid]))


# ---- tool executions: the effects table, one row per execution of the record tool -----------


def tool_executions(dsn: str) -> list[tuple[str, int, object, object]]:
    """Every tool execution: its tag, process id, start and end (``None`` while it runs)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT tag, pid, started_at, finished_at FROM loomflow_worker_effects ORDER BY id"
        ).fetchall()
    return [(r[0], r[1], r[2], r[3]) for r in rows]


def tool_counts(dsn: str) -> dict[str, int]:
    """How many times each tag's tool call started."""
    found: dict[str, int] = {}
    for tag, *_ in tool_executions(dsn):
        found[tag] = found.get(tag, 0) + 1
    return found


def wait_for_execution(
    dsn: str, tag: str, timeout: float = 60
) -> tuple[str, int, object, object]:
    """Wait until the tool call of ``tag`` is running; its execution."""
    return wait_until(
        lambda: next((e for e in tool_executions(dsn) if e[0] == tag and e[3] is None), None),
        f"{tag} running", timeout)


# ---- the loomflow-worker command and the metrics endpoint --------------------------------------


def cli(
    fleet: Fleet, *args: str, input: str | None = None, timeout: float = 120, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m loomflow_worker.cli ARGS`` with the fleet's environment."""
    return subprocess.run(
        [sys.executable, "-m", "loomflow_worker.cli", *args],
        env={**fleet.env, **env}, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
        input=input if input is not None else "",
    )


def cli_in_process(
    fleet: Fleet, *args: str, input: str | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run the ``loomflow-worker`` command ARGS in this process (click's
    ``CliRunner``), with the fleet's environment and nothing else of
    ``LOOMFLOW_WORKER_*``: what it printed on stdout and stderr and its exit
    status, as :func:`cli` gives them, a second or more sooner (no interpreter
    to start, nothing to import again). As a process of its own, the command
    would print on stderr the warnings it logs (Python's last-resort handler)
    and the traceback of an exception it lets out: so they are here.

    For the commands that read their settings from the environment as they
    run (``requests``, ``show``, ``tail``, ``prune``, ``doctor``, ``limits``):
    ``enqueue``, ``cancel``, ``signal`` and ``upgrade`` send through this
    process's Celery binding, configured once a process, so they run as
    :func:`cli` runs them, and so does a command whose process is the point
    (one started before the run it follows, one read while it runs)."""
    import inspect
    import logging
    import traceback

    from click.testing import CliRunner

    from loomflow_worker.cli import main

    environment: dict[str, str | None] = {
        name: None for name in os.environ if name.startswith("LOOMFLOW_WORKER_")}
    environment.update({**fleet.env, **env})
    # click before 8.2 mixes stderr into stdout unless told not to.
    separate = ({"mix_stderr": False}
                if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters else {})
    pool_logger = logging.getLogger("psycopg.pool")
    pool_level = pool_logger.level
    root = logging.getLogger()
    root.addHandler(logging.lastResort)  # stderr, as in a process of its own
    try:
        done = CliRunner(**separate).invoke(main, list(args), input=input or "",
                                            env=environment)
    finally:
        root.removeHandler(logging.lastResort)
        pool_logger.setLevel(pool_level)  # the command quiets the pool's retries
    stderr = done.stderr
    if done.exc_info is not None and not isinstance(done.exception, SystemExit):
        stderr += "".join(traceback.format_exception(*done.exc_info))
    return subprocess.CompletedProcess(["loomflow-worker", *args], done.exit_code,
                                       done.stdout, stderr)


def enqueued(fleet: Fleet, prompt: str, session: str, *extra: str) -> str:
    """The request id ``loomflow-worker enqueue`` printed."""
    done = cli(fleet, "enqueue", prompt, "--session", session, *extra)
    assert done.returncode == 0, done.stderr
    request_id = done.stdout.strip()
    uuid.UUID(request_id)
    return request_id


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def scrape(port: int) -> dict[str, float]:
    """The ``loomflow_worker_*`` samples of the metrics endpoint on ``port``,
    once it answers (within 20 s)."""

    def page() -> str | OSError:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                return str(reply.read().decode())
        except OSError as exc:
            return exc

    text = wait_until(page, f"the metrics endpoint on {port} answered", 20,
                      until=lambda seen: isinstance(seen, str), every=0.2)
    assert isinstance(text, str)
    samples: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^(loomflow_worker_[^\s]+)\s+([0-9.e+-]+)$", line)
        if match:
            samples[match[1]] = float(match[2])
    return samples


@asynccontextmanager
async def warm_runtime(dsn: str) -> AsyncIterator[tuple[PostgresRuntime, Agent, EffectsLog]]:
    """A runtime with one lock connection, and an agent on it that ran once
    (its statements prepared, its imports done); the runtime closed after."""
    effects = EffectsLog(dsn)
    await effects.setup()
    runtime = await PostgresRuntime.connect(dsn, lock_connections=1)
    try:
        agent = make_agent(runtime, effects)
        await agent.run(calls("warm"), session_id="warm", user_id="u")
        yield runtime, agent, effects
    finally:
        await runtime.aclose()


def fleet_page(client: Any) -> dict[str, tuple[str, int]]:
    """What the console's fleet page shows of each worker process (node:pid):
    its state and its runs in flight. ``client``: a Starlette ``TestClient``
    of the console."""
    page = client.get("/fleet")
    assert page.status_code == 200
    return {html.unescape(found[1]): (found[2], int(found[3])) for found in re.finditer(
        r'<tr data-worker="([^"]+)" data-state="(\w+)".*?<td class="num runs">(\d+)</td>',
        page.text, re.S)}


def wait_fleet_page(client: Any, worker: str, expected: tuple[str, int],
                    timeout: float = 15) -> None:
    """Wait until the fleet page shows ``worker`` (node:pid) as ``expected``
    (its state and runs in flight)."""
    wait_until(lambda: fleet_page(client).get(worker), f"the fleet page shows {worker} as "
               f"{expected}", timeout, until=lambda shown: shown == expected, every=0.1)


def cell(header: str, row: str, name: str) -> str:
    """The cell of column ``name`` in ``row`` of a table the CLI printed under
    ``header`` (its columns are left-aligned: a cell starts where its name does)."""
    names = header.split()
    starts = _starts(header, names)
    at = names.index(name)
    end = starts[at + 1] if at + 1 < len(starts) else None
    return row[starts[at]:end].strip()


def _starts(header: str, names: list[str]) -> list[int]:
    starts, at = [], 0
    for name in names:
        at = header.index(name, at)
        starts.append(at)
        at += len(name)
    return starts
