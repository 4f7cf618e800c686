"""Deploys that change an agent, with real worker processes: a request is
pinned to the version of its agent its first attempt ran, and no worker of
another version starts it or executes a step of it.

The scenario of a rolling deploy's last old worker lost: a request charging
six orders runs on a worker of version 1; a worker of version 2 joins; the
version-1 worker is SIGKILLed in the middle of the fourth charge. Until a
worker of version 1 comes back, the request waits (queued, in its version's
queue) and version 2 charges nothing of it, while a new request runs on
version 2 at once; then it finishes on version 1, each order charged once
(the one in flight at the kill aside), its journaled model calls not asked
again."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from loomflow_worker.tasks import run_agent
from tests.integration import version_agents  # noqa: F401  (registers "deploy" here too)
from tests.integration.celery_harness import Fleet
from tests.integration.helpers import calls, wait_until

pytestmark = [pytest.mark.slow]

AGENTS = "tests.integration.version_agents"
FAST_ENV = {
    "LOOMFLOW_WORKER_AGENTS": AGENTS,
    "LOOMFLOW_WORKER_SWEEP_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_LEASE": "3",
    "TEST_TOOL_SLEEP": "0.4",
}


def _row(dsn: str, request_id: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        row = conn.execute("SELECT status, agent_version, version_wait_since, routing, result"
                           " FROM runs WHERE request_id = %s", (request_id,)).fetchone()
    assert row is not None
    return row


def _version_of(dsn: str, worker: str) -> str:
    """The version of agent deploy the worker named ``worker`` registered
    (its pool's children register theirs as they start)."""
    found: list[str] = []

    def registered() -> bool:
        with psycopg.connect(dsn, autocommit=True) as conn:
            found[:] = [row[0] for row in conn.execute(
                "SELECT DISTINCT version FROM worker_agents"
                " WHERE agent = 'deploy' AND worker LIKE %s", (f"{worker}-%",))]
        return bool(found)

    wait_until(registered, f"worker {worker} registering its version of agent deploy")
    assert len(found) == 1, found
    return found[0]


def _charges(dsn: str, prefix: str) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT tag, count(*) FROM loomflow_worker_effects"
                            " WHERE tag LIKE %s GROUP BY tag", (f"{prefix}%",)).fetchall()
    return {tag: count for tag, count in rows}


def _entered(path: Path, tag: str) -> bool:
    return path.exists() and any(line.split(" ", 1)[0] == tag
                                 for line in path.read_text().splitlines())


def _model_calls(path: Path, first_line: str) -> list[str]:
    """The versions that made each model call of the request whose prompt
    starts with ``first_line``."""
    if not path.exists():
        return []
    return [version for version, _, prompt in
            (line.partition("\t") for line in path.read_text().splitlines())
            if prompt == first_line]


@pytest.mark.parametrize(("fleet", "pool", "change"), [
    ("redis", "threads", "tool"),
    ("rabbitmq", "prefork", "tool"),
    ("redis", "threads", "instructions"),
], indirect=["fleet"])
def test_a_request_finishes_on_the_version_it_started_on(
    fleet: Fleet, tmp_path: Path, pool: str, change: str
) -> None:
    entries, model_calls = tmp_path / "entries", tmp_path / "model-calls"
    env = {**FAST_ENV, "TEST_ENTRIES_FILE": str(entries), "TEST_MODEL_CALLS": str(model_calls),
           "TEST_AGENT_CHANGE": change}
    orders = [f"A-o{n}" for n in range(1, 7)]
    prompt = calls(*orders)
    fleet.start("v1", concurrency=4, pool=pool, TEST_AGENT_VERSION="1", **env)
    pinned = run_agent.apply_async((prompt, "session-a"), {"agent": "deploy"})
    fleet.start("v2", concurrency=4, pool=pool, TEST_AGENT_VERSION="2", **env)
    v1, v2 = _version_of(fleet.dsn, "v1"), _version_of(fleet.dsn, "v2")
    assert v1 != v2

    wait_until(lambda: _entered(entries, "A-o4"), "version 1 charging order 4", timeout=60)
    fleet.kill("v1")
    # The request waits for version 1, in its version's queue; version 2 runs
    # nothing of it, and a new request runs on version 2 at once.
    wait_until(lambda: _row(fleet.dsn, pinned.id)["version_wait_since"] is not None,
               "the request waiting for version 1", timeout=60)
    row = _row(fleet.dsn, pinned.id)
    assert row["status"] == "queued" and row["agent_version"] == v1
    assert row["routing"]["queue"] == f"{fleet.queue}@deploy@{v1}"
    fresh = run_agent.apply_async((calls("B-o1", "B-o2"), "session-b"), {"agent": "deploy"})
    expected = ("B-o1-cents", "B-o2-cents") if change == "tool" else ("B-o1", "B-o2")
    assert fresh.get(timeout=60)["output"] == "done: " + ", ".join(
        f"recorded {tag}" for tag in expected)
    assert _row(fleet.dsn, fresh.id)["agent_version"] == v2
    time.sleep(2)
    assert _row(fleet.dsn, pinned.id)["status"] == "queued"
    assert not any(tag.endswith("-cents") for tag in _charges(fleet.dsn, "A-"))
    assert "2" not in _model_calls(model_calls, prompt.splitlines()[0])
    fleet.wait_logged(f"request {pinned.id} is pinned to version {v1}")

    # A worker of version 1 comes back: the request finishes there.
    fleet.start("v1-again", concurrency=4, pool=pool, TEST_AGENT_VERSION="1", **env)
    assert pinned.get(timeout=90)["output"] == "done: " + ", ".join(
        f"recorded {tag}" for tag in orders)
    charges = _charges(fleet.dsn, "A-")
    assert set(charges) == set(orders), charges
    assert {tag: n for tag, n in charges.items() if tag != "A-o4"} == dict.fromkeys(
        set(orders) - {"A-o4"}, 1), charges
    assert charges["A-o4"] in (1, 2), charges
    row = _row(fleet.dsn, pinned.id)
    assert row["status"] == "succeeded" and row["agent_version"] == v1
    assert row["version_wait_since"] is None
    # Four model calls before the kill (one a charge), three after: none asked twice.
    assert _model_calls(model_calls, prompt.splitlines()[0]) == ["1"] * 7
