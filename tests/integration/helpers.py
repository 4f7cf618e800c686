"""Shared pieces of the integration tests."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from loomflow import Agent
from loomflow.runtime import _codec, journal_scope

from loomflow_worker.testing import DeterministicModel, EffectsLog


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
