"""What a draining release's KEDA trigger reads (deploy/k8s/release/draining): the
unfinished requests pinned to a version its pods built that no live worker of another
release serves. The query is the deploy file's, with the Deployment's name written in as
kustomize's replacement writes it, run against the real schema."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml  # type: ignore[import-untyped]

DRAINING = Path(__file__).resolve().parents[2] / "deploy/k8s/release/draining"
R41 = "loomflow-worker-r41"
R42 = "loomflow-worker-r42"
R43 = "loomflow-worker-r43"


def keda_query(deployment: str) -> str:
    """The draining ScaledObject's query, for the release whose Deployment is ``deployment``."""
    component = yaml.safe_load((DRAINING / "kustomization.yaml").read_text())
    scaled = yaml.safe_load((DRAINING / "scaledobject.yaml").read_text())
    (trigger,) = scaled["spec"]["triggers"]
    (replacement,) = component["replacements"]
    (target,) = replacement["targets"]
    delimiter, index = target["options"]["delimiter"], target["options"]["index"]
    parts = trigger["metadata"]["query"].split(delimiter)
    parts[index] = deployment
    return str(delimiter.join(parts))


def demand(conn: psycopg.Connection[Any], deployment: str) -> int:
    row = conn.execute(keda_query(deployment)).fetchone()
    assert row is not None
    return int(row[0])


def pod(conn: psycopg.Connection[Any], deployment: str, name: str, agents: dict[str, str], *,
        live: bool = True) -> str:
    """A worker process of a pod of ``deployment`` that built ``agents`` (name: version);
    ``live``: stamped now, else stopped (scaled down)."""
    hostname = f"{deployment}-{name}"
    worker = f"celery@{hostname}:1"
    conn.execute(
        "INSERT INTO workers (worker, hostname, pid, slots, heartbeat_interval, stopped_at)"
        " VALUES (%s, %s, 1, 100, 2, CASE WHEN %s THEN NULL ELSE now() END)",
        (worker, hostname, live))
    for agent, version in agents.items():
        conn.execute("INSERT INTO worker_agents (worker, agent, version) VALUES (%s, %s, %s)",
                     (worker, agent, version))
    return worker


def request(conn: psycopg.Connection[Any], request_id: str, agent: str, version: str | None,
            status: str) -> None:
    """A request of ``agent`` pinned to ``version`` (None: it never started); queued and
    pinned, it waits for a worker of its version."""
    waits = status == "queued" and version is not None
    conn.execute(
        "INSERT INTO runs (request_id, scope, session_id, agent, prompt, status, agent_version,"
        " version_wait_since) VALUES (%(id)s, %(id)s, %(id)s, %(agent)s, 'p', %(status)s,"
        " %(version)s, CASE WHEN %(waits)s THEN now() END)",
        {"id": request_id, "agent": agent, "version": version, "status": status,
         "waits": waits})


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as connection:
        yield connection


def test_a_draining_release_owes_the_requests_pinned_to_its_versions_alone(
    conn: psycopg.Connection[Any],
) -> None:
    # r41 built deploy at aaa; r42, the new release, at bbb. Both built search at ccc (an
    # agent the deploy left unchanged).
    pod(conn, R41, "7d9f8c6b5-x2k4q", {"deploy": "aaa111aaa111", "search": "ccc333ccc333"})
    pod(conn, R42, "5c4b9d7f6-p8m2n", {"deploy": "bbb222bbb222", "search": "ccc333ccc333"})
    request(conn, "d-running", "deploy", "aaa111aaa111", "running")
    request(conn, "d-waiting", "deploy", "aaa111aaa111", "queued")
    request(conn, "d-done", "deploy", "aaa111aaa111", "succeeded")
    request(conn, "d-new", "deploy", "bbb222bbb222", "running")
    request(conn, "d-unstarted", "deploy", None, "queued")  # runs on any version
    request(conn, "s-running", "search", "ccc333ccc333", "running")

    # The two pinned to aaa, running or waiting; search's are r42's to run too.
    assert keda_query(R41) == (
        "SELECT loomflow_worker_version_demand('loomflow-worker-r41' || '-')")
    assert demand(conn, R41) == 2
    assert demand(conn, R42) == 1
    # No pod of r4: its prefix does not take r41's.
    assert demand(conn, "loomflow-worker-r4") == 0


def test_a_version_a_live_worker_of_another_release_serves_is_owed_by_neither_alone(
    conn: psycopg.Connection[Any],
) -> None:
    pod(conn, R41, "7d9f8c6b5-x2k4q", {"deploy": "aaa111aaa111"})
    request(conn, "d-running", "deploy", "aaa111aaa111", "running")
    request(conn, "d-waiting", "deploy", "aaa111aaa111", "queued")
    assert demand(conn, R41) == 2
    # r43 built the same version of deploy (a rebuild that changed no agent): live, it serves
    # the version's queue, and r41 owes nothing.
    r43 = pod(conn, R43, "6f8d7c9b4-q3w5e", {"deploy": "aaa111aaa111"})
    assert demand(conn, R41) == 0
    # r43 stopped: r41 owes them again.
    conn.execute("UPDATE workers SET stopped_at = now() WHERE worker = %s", (r43,))
    assert demand(conn, R41) == 2
    # r43 alive but silent for more than two heartbeats: not alive.
    conn.execute("UPDATE workers SET stopped_at = NULL, seen_at = now() - interval '10 s'"
                 " WHERE worker = %s", (r43,))
    assert demand(conn, R41) == 2


def test_a_release_scaled_to_zero_still_owes_its_requests(
    conn: psycopg.Connection[Any],
) -> None:
    # Its pods stopped, not forgotten: KEDA starts one again for the request that waits.
    pod(conn, R41, "7d9f8c6b5-x2k4q", {"deploy": "aaa111aaa111"}, live=False)
    pod(conn, R42, "5c4b9d7f6-p8m2n", {"deploy": "bbb222bbb222"})
    request(conn, "d-waiting", "deploy", "aaa111aaa111", "queued")
    assert demand(conn, R41) == 1
    conn.execute("UPDATE runs SET status = 'succeeded' WHERE request_id = 'd-waiting'")
    assert demand(conn, R41) == 0
