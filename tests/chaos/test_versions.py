"""Deploys that change an agent, with real worker processes: a request is
pinned to the version of its agent its first attempt ran, and no worker of
another version starts it or executes a step of it.

The scenario of a rolling deploy's last old worker lost: a request charging
six orders runs on a worker of version 1; a worker of version 2 joins; the
version-1 worker is SIGKILLed in the middle of a charge. Until a
worker of version 1 comes back, the request waits (queued, in its version's
queue) and version 2 charges nothing of it, while a new request runs on
version 2 at once; then it finishes on version 1, each order charged once
(the one in flight at the kill aside), its journaled model calls not asked
again."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from loomflow_worker.tasks import run_agent
from tests.integration import version_agents  # noqa: F401  (registers "deploy" here too)
from tests.integration.celery_harness import Fleet
from tests.integration.helpers import calls, cli, scrape, wait_until
from tests.integration.services import free_port

pytestmark = [pytest.mark.slow]

AGENTS = "tests.integration.version_agents"
FAST_ENV = {
    "LOOMFLOW_WORKER_AGENTS": AGENTS,
    "LOOMFLOW_WORKER_SWEEP_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_LEASE": "3",
    # Long enough that the request is still charging when version 2 is ready,
    # however slow the machine: version 1 is killed inside a charge.
    "TEST_TOOL_SLEEP": "1.0",
}


def _ledger_row(dsn: str, request_id: str) -> dict[str, Any]:
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


def _waiting_gauge(port: int, version: str) -> float:
    """loomflow_worker_version_waiting of agent deploy and ``version``, summed
    over the worker's processes (each sample carries its pid)."""
    return sum(value for key, value in scrape(port).items()
               if key.startswith("loomflow_worker_version_waiting{")
               and 'agent="deploy"' in key and f'version="{version}"' in key)


def _in_flight(path: Path, orders: list[str]) -> int:
    """How many of ``orders`` version 1 entered before it was killed (the last
    of them was in flight)."""
    entered = {line.split(" ", 1)[0] for line in path.read_text().splitlines()}
    return max(i + 1 for i, tag in enumerate(orders) if tag in entered)


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
    port = free_port()
    fleet.start("v2", concurrency=4, pool=pool, TEST_AGENT_VERSION="2", **env,
                LOOMFLOW_WORKER_METRICS_PORT=str(port))
    v1, v2 = _version_of(fleet.dsn, "v1"), _version_of(fleet.dsn, "v2")
    assert v1 != v2

    wait_until(lambda: _entered(entries, "A-o2"), "version 1 charging order 2", timeout=60)
    fleet.kill("v1")
    cut = _in_flight(entries, orders)
    assert cut < len(orders), "version 1 was killed too late: it charged every order"
    # The request waits for version 1, in its version's queue; version 2 runs
    # nothing of it, and a new request runs on version 2 at once.
    wait_until(lambda: _ledger_row(fleet.dsn, pinned.id)["version_wait_since"] is not None,
               "the request waiting for version 1", timeout=60)
    row = _ledger_row(fleet.dsn, pinned.id)
    assert row["status"] == "queued" and row["agent_version"] == v1
    assert row["routing"]["queue"] == f"{fleet.queue}@deploy@{v1}"
    fresh = run_agent.apply_async((calls("B-o1", "B-o2"), "session-b"), {"agent": "deploy"})
    expected = ("B-o1-cents", "B-o2-cents") if change == "tool" else ("B-o1", "B-o2")
    assert fresh.get(timeout=60)["output"] == "done: " + ", ".join(
        f"recorded {tag}" for tag in expected)
    assert _ledger_row(fleet.dsn, fresh.id)["agent_version"] == v2
    time.sleep(2)
    assert _ledger_row(fleet.dsn, pinned.id)["status"] == "queued"
    assert not any(tag.endswith("-cents") for tag in _charges(fleet.dsn, "A-"))
    assert "2" not in _model_calls(model_calls, prompt.splitlines()[0])
    fleet.wait_logged(f"request {pinned.id} is pinned to version {v1}")
    # Sent on once: its message waits in its version's queue, not back and forth.
    assert fleet.log_text().count(f"request {pinned.id} is pinned to version") <= 2
    # Never silent: the sweeper's leader warns, show and versions say it waits.
    fleet.wait_logged(f"1 requests of agent 'deploy' wait for a worker of version {v1}")
    shown = cli(fleet, "show", pinned.id).stdout
    assert f"waits for a worker of agent deploy version {v1} since" in shown, shown
    assert "none alive since" in shown, shown
    listed = cli(fleet, "versions")
    assert f"agent 'deploy' version {v1}: 1 requests wait" in listed.stderr, listed.stderr
    wait_until(lambda: _waiting_gauge(port, v1) == 1, "the waiting gauge of version 1")

    # A worker of version 1 comes back: the request finishes there. Started as
    # the old release of a drain is (TAKE_NEW=false), it takes no new request.
    drain = {"LOOMFLOW_WORKER_TAKE_NEW": "false"} if change == "instructions" else {}
    fleet.start("v1-again", concurrency=4, pool=pool, TEST_AGENT_VERSION="1", **env, **drain)
    if drain:
        fleet.wait_logged("taking no new requests (TAKE_NEW is false)")
        newer = [run_agent.apply_async((calls(f"C{n}-o1"), f"session-c{n}"), {"agent": "deploy"})
                 for n in range(8)]
        for handle in newer:
            handle.get(timeout=60)
            assert _ledger_row(fleet.dsn, handle.id)["agent_version"] == v2
    assert pinned.get(timeout=90)["output"] == "done: " + ", ".join(
        f"recorded {tag}" for tag in orders)
    charges = _charges(fleet.dsn, "A-")
    assert set(charges) == set(orders), charges
    assert all(charges[tag] == 1 for tag in orders if tag != orders[cut - 1]), charges
    assert charges[orders[cut - 1]] in (1, 2), charges
    row = _ledger_row(fleet.dsn, pinned.id)
    assert row["status"] == "succeeded" and row["agent_version"] == v1
    assert row["version_wait_since"] is None
    # One model call per charge and one to answer, each asked once, all on version 1.
    assert _model_calls(model_calls, prompt.splitlines()[0]) == ["1"] * 7


def _kill_v1_mid_run(
    fleet: Fleet, tmp_path: Path, **env: str
) -> tuple[Any, list[str], Path, int]:
    """A request charging six orders started on version 1, version 2 alive, and
    version 1 SIGKILLed in the middle of a charge (the second, or a later one on
    a slow machine); the request, its orders, the model calls' file and how many
    orders version 1 entered."""
    entries, model_calls = tmp_path / "entries", tmp_path / "model-calls"
    env = {**FAST_ENV, "TEST_ENTRIES_FILE": str(entries), "TEST_MODEL_CALLS": str(model_calls),
           **env}
    orders = [f"A-o{n}" for n in range(1, 7)]
    fleet.start("v1", concurrency=4, pool="threads", TEST_AGENT_VERSION="1", **env)
    request = run_agent.apply_async((calls(*orders), "session-a"), {"agent": "deploy"})
    fleet.start("v2", concurrency=4, pool="threads", TEST_AGENT_VERSION="2", **env)
    wait_until(lambda: _entered(entries, "A-o2"), "version 1 charging order 2", timeout=60)
    fleet.kill("v1")
    cut = _in_flight(entries, orders)
    assert cut < len(orders), "version 1 was killed too late: it charged every order"
    return request, orders, model_calls, cut


@pytest.mark.parametrize("how", ["command", "policy"])
def test_an_upgraded_request_continues_on_the_new_version_from_what_it_completed(
    fleet: Fleet, tmp_path: Path, how: str
) -> None:
    # Version 1 is gone for good: the request moves to version 2, by the
    # command or by its agent's policy (on_version_gone="upgrade", after its
    # grace). The orders charged under version 1 are not charged again; the
    # rest are charged once, on version 2, whose model writes the output.
    from loomflow_worker import admin
    from loomflow_worker.settings import Settings

    policy = {"TEST_ON_VERSION_GONE": "upgrade", "TEST_GRACE": "2"} if how == "policy" else {}
    request, orders, model_calls, cut = _kill_v1_mid_run(fleet, tmp_path, **policy)
    v1, v2 = _version_of(fleet.dsn, "v1"), _version_of(fleet.dsn, "v2")
    if how == "command":
        wait_until(lambda: _ledger_row(fleet.dsn, request.id)["version_wait_since"] is not None,
                   "the request waiting for version 1", timeout=60)
        moved = subprocess.run(
            [sys.executable, "-m", "loomflow_worker.cli", "upgrade", request.id],
            env=fleet.env, capture_output=True, text=True, timeout=60)
        assert moved.returncode == 0, moved.stderr
        assert moved.stdout == f"{request.id}: moved from version {v1} to {v2}\n"
    # Version 1 asked for the charges up to the one in flight; version 2 for the rest.
    expected = [*orders[:cut], *(f"{tag}-cents" for tag in orders[cut:])]
    assert request.get(timeout=90)["output"] == "done: " + ", ".join(
        f"recorded {tag}" for tag in expected)
    charges = _charges(fleet.dsn, "A-")
    assert set(charges) == set(expected), charges
    assert all(charges[tag] == 1 for tag in expected if tag != orders[cut - 1]), charges
    assert charges[orders[cut - 1]] in (1, 2), charges  # in flight at the kill
    # Version 1's model calls replay by position; version 2 asks the rest, once each.
    calls_made = _model_calls(model_calls, calls(*orders).splitlines()[0])
    assert calls_made == ["1"] * cut + ["2"] * (len(orders) + 1 - cut), calls_made
    with admin.connect(Settings(database_url=fleet.dsn)) as conn:  # type: ignore[arg-type]
        detail = admin.get_request(conn, request.id)
    assert detail.agent_version == v2 and detail.status == "succeeded"
    assert [(u.from_version, u.to_version) for u in detail.upgrades] == [(v1, v2)]
    assert detail.upgrades[0].by == (
        "upgrade" if how == "command" else "on_version_gone=upgrade after 2s")
    assert detail.attempts[-1].agent_version == v2


def test_a_change_under_an_unchanged_declared_version_diverges_before_a_second_charge(
    fleet: Fleet, tmp_path: Path
) -> None:
    # Both deploys declare version "1": version 2 resumes the request, asks its
    # model again (its instructions changed), and the first charge it asks for
    # carries other arguments than the one journaled there: the request ends
    # failed, Diverged, and nothing is charged again.
    request, orders, _, _ = _kill_v1_mid_run(fleet, tmp_path, TEST_DECLARED_VERSION="1")
    with pytest.raises(Exception, match="diverged from its journal") as info:
        request.get(timeout=90)
    assert "A-o1-cents" in str(info.value) and "version 1 of agent 'deploy'" in str(info.value)
    row = _ledger_row(fleet.dsn, request.id)
    assert row["status"] == "failed" and row["agent_version"] == "1"
    charges = _charges(fleet.dsn, "A-")
    assert set(charges) <= set(orders), charges
    assert all(n == 1 for n in charges.values()), charges


def test_an_unchanged_agent_resumes_on_any_worker_of_its_version(
    fleet: Fleet, tmp_path: Path
) -> None:
    # A deploy that leaves the agent as it was (an image rebuild): the killed
    # worker's request resumes on the other worker at once, sent nowhere.
    entries = tmp_path / "entries"
    env = {**FAST_ENV, "TEST_ENTRIES_FILE": str(entries), "TEST_AGENT_VERSION": "1"}
    orders = [f"A-o{n}" for n in range(1, 5)]
    fleet.start("old", concurrency=4, pool="threads", **env)
    request = run_agent.apply_async((calls(*orders), "session-a"), {"agent": "deploy"})
    fleet.start("new", concurrency=4, pool="threads", **env)
    assert _version_of(fleet.dsn, "old") == _version_of(fleet.dsn, "new")
    wait_until(lambda: _entered(entries, "A-o2"), "the old worker charging order 2", timeout=60)
    fleet.kill("old")
    assert request.get(timeout=60)["output"] == "done: " + ", ".join(
        f"recorded {tag}" for tag in orders)
    assert "is pinned to version" not in fleet.log_text()
    row = _ledger_row(fleet.dsn, request.id)
    assert row["version_wait_since"] is None and "version" not in row["routing"]


def test_a_request_whose_version_is_gone_is_cancelled_by_its_agents_policy(
    fleet: Fleet, tmp_path: Path
) -> None:
    # on_version_gone="cancel": once no worker of its version has been seen for
    # its grace, the request ends cancelled; version 2 charges nothing of it.
    request, *_ = _kill_v1_mid_run(
        fleet, tmp_path, TEST_ON_VERSION_GONE="cancel", TEST_GRACE="2")
    with pytest.raises(Exception, match="cancel"):
        request.get(timeout=90)
    assert _ledger_row(fleet.dsn, request.id)["status"] == "cancelled"
    assert not any(tag.endswith("-cents") for tag in _charges(fleet.dsn, "A-"))
    fleet.wait_logged("1 requests of agent 'deploy' waiting for version")
