"""Parts for writing crash tests of your own agents.

- :class:`DeterministicModel`: a model whose reply is a pure function of
  the messages, so a resumed run that replays its journal stays in step.
  Every real call mints fresh tool-call ids (as a real model does), and a
  tool result that answers no tool call of the assistant turn before it
  is refused the way Anthropic's API refuses it (HTTP 400).
- :class:`EffectsLog`: a tool that records every execution in Postgres,
  with start and end times, so a test can count side effects across
  processes and check that runs on one session never overlapped.

The prompt tells the model what to do, one turn a line::

    call record {"tag": "a"}
    call record {"tag": "b"} && record {"tag": "c"}

runs one tool call, then two in parallel, then answers
``done: <each tool output, in order>``. A prompt with no ``call`` line
is answered at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import anyio
import psycopg
from loomflow import tool
from loomflow.core.types import Message, ModelChunk, Role, ToolCall, ToolDef, Usage
from loomflow.tools import Tool
from psycopg.rows import class_row

from .runtime.sql import query

__all__ = ["DeterministicModel", "EffectsLog", "Execution", "UnmatchedToolResult", "plan"]


class UnmatchedToolResult(Exception):
    """A tool result whose id answers no tool call of the turn before it.

    Anthropic's Messages API answers such a request with HTTP 400
    (``unexpected tool_use_id found in tool_result blocks``)."""


def plan(prompt: str) -> list[list[tuple[str, dict[str, Any]]]]:
    """The turns a prompt asks for: each a list of ``(tool, args)`` calls."""
    turns: list[list[tuple[str, dict[str, Any]]]] = []
    for line in prompt.splitlines():
        line = line.strip()
        if not line.startswith("call "):
            continue
        calls = []
        for part in line[len("call ") :].split("&&"):
            name, _, raw = part.strip().partition(" ")
            calls.append((name, json.loads(raw) if raw.strip() else {}))
        turns.append(calls)
    return turns


def _check_tool_results(messages: list[Message]) -> None:
    expected: set[str] | None = None
    for index, message in enumerate(messages):
        if message.role == Role.ASSISTANT:
            expected = {call.id for call in message.tool_calls}
        elif message.role == Role.TOOL:
            if expected is None or message.tool_call_id not in expected:
                raise UnmatchedToolResult(
                    f"messages.{index}: unexpected tool_use_id found in tool_result blocks: "
                    f"{message.tool_call_id}. Each tool_result block must have a "
                    "corresponding tool_use block in the previous message."
                )
        else:
            expected = None


@dataclass
class DeterministicModel:
    """A model whose reply depends only on the messages it is sent.

    ``latency`` is slept on every real call; ``calls`` counts them."""

    name: str = "deterministic"
    latency: float = 0.0
    calls: int = 0
    on_call: Callable[[list[Message]], Awaitable[None]] | None = field(default=None, repr=False)

    def reply(self, messages: list[Message]) -> tuple[str, list[ToolCall]]:
        _check_tool_results(messages)
        last_user = max(
            (i for i, m in enumerate(messages) if m.role == Role.USER), default=-1
        )
        this_run = messages[last_user + 1 :]
        turn = sum(1 for m in this_run if m.role == Role.ASSISTANT and m.tool_calls)
        prompt = messages[last_user].content if last_user >= 0 else ""
        turns = plan(prompt)
        if turn < len(turns):
            calls = [
                ToolCall(id=f"toolu_{uuid.uuid4().hex[:20]}", tool=name, args=args)
                for name, args in turns[turn]
            ]
            return "", calls
        outputs = [m.content for m in this_run if m.role == Role.TOOL]
        return "done: " + ", ".join(outputs), []

    async def _call(self, messages: list[Message]) -> tuple[str, list[ToolCall]]:
        self.calls += 1
        if self.on_call is not None:
            await self.on_call(messages)
        if self.latency:
            await anyio.sleep(self.latency)
        return self.reply(messages)

    async def complete(
        self,
        messages: list[Message],
        *,
        tools: list[ToolDef] | None = None,
        temperature: float = 1.0,
        max_tokens: int | None = None,
        output_schema: Any | None = None,
        effort: str | None = None,
        strict_effort: bool = False,
        prompt_caching: Any = None,
    ) -> tuple[str, list[ToolCall], Usage, str]:
        text, calls = await self._call(messages)
        usage = Usage(input_tokens=sum(len(m.content) for m in messages), output_tokens=len(text))
        return text, calls, usage, "tool_use" if calls else "stop"

    async def stream(
        self,
        messages: list[Message],
        *,
        tools: list[ToolDef] | None = None,
        temperature: float = 1.0,
        max_tokens: int | None = None,
        output_schema: Any | None = None,
        effort: str | None = None,
        strict_effort: bool = False,
        prompt_caching: Any = None,
    ) -> AsyncIterator[ModelChunk]:
        text, calls = await self._call(messages)
        if text:
            yield ModelChunk(kind="text", text=text)
        for call in calls:
            yield ModelChunk(kind="tool_call", tool_call=call)
        usage = Usage(input_tokens=sum(len(m.content) for m in messages), output_tokens=len(text))
        yield ModelChunk(
            kind="finish", finish_reason="tool_use" if calls else "stop", usage=usage
        )


@dataclass(frozen=True)
class Execution:
    """One execution of the effects tool."""

    tag: str
    pid: int
    started_at: Any
    finished_at: Any


#: The effects tool's connections open at once in one event loop.
MAX_EFFECT_CONNECTIONS = 16


class EffectsLog:
    """A side-effect tool that counts its executions in Postgres.

    ``on_start(tag)`` runs after the start is recorded and before the
    tool sleeps and finishes: a crash test kills its process there.
    ``entries``: a file each call appends a line to as it is called (its tag,
    pid and time), before anything awaits."""

    def __init__(
        self,
        dsn: str,
        *,
        sleep: float = 0.0,
        on_start: Callable[[str], Awaitable[None]] | None = None,
        entries: str | None = None,
    ) -> None:
        self.dsn = dsn
        self.sleep = sleep
        self.on_start = on_start
        self.entries = entries
        # Connections open at once per event loop: hundreds of runs of one
        # process calling the tool side by side stay within the server's limit.
        self._connecting: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()

    @contextlib.asynccontextmanager
    async def _connect(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        loop = asyncio.get_running_loop()
        gate = self._connecting.get(loop)
        if gate is None:
            gate = self._connecting[loop] = asyncio.Semaphore(MAX_EFFECT_CONNECTIONS)
        async with gate, await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            yield conn

    async def setup(self) -> None:
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            await conn.execute(query("effects_table"))

    def tool(self, name: str = "record") -> Tool:
        log = self

        async def record(tag: str) -> str:
            """Record one execution of a side effect tagged ``tag``."""
            entered_at = datetime.now(UTC)
            if log.entries is not None:
                # Before anything awaits: a call that a cancel stops at its first
                # await (a fenced run's) was entered all the same.
                line = f"{tag} {os.getpid()} {entered_at.isoformat()}\n".encode()
                fd = os.open(log.entries, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line)
                finally:
                    os.close(fd)
            # No connection is held while the tool sleeps: many runs of one
            # process record their effects at once.
            async with log._connect() as conn:
                cur = await conn.execute(
                    query("effect_started"),
                    {"tag": tag, "pid": os.getpid(), "entered_at": entered_at})
                row = await cur.fetchone()
            assert row is not None
            if log.on_start is not None:
                await log.on_start(tag)
            if log.sleep:
                await anyio.sleep(log.sleep)
            async with log._connect() as conn:
                await conn.execute(query("effect_finished"), {"id": row[0]})
            return f"recorded {tag}"

        return tool(name=name, description="Record a side effect.")(record)

    async def executions(self, tag_prefix: str = "") -> list[Execution]:
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            cur = conn.cursor(row_factory=class_row(Execution))
            await cur.execute(query("effect_executions"), {"prefix": tag_prefix})
            return await cur.fetchall()

    async def counts(self, tag_prefix: str = "") -> dict[str, int]:
        found: dict[str, int] = {}
        for execution in await self.executions(tag_prefix):
            found[execution.tag] = found.get(execution.tag, 0) + 1
        return found
