"""``loomflow-worker upgrade`` and ``versions`` against a ledger and a
registry written as a fleet leaves them: version v1 of agent deploy, whose
last worker is gone, and v2, served by a live worker. Bad input gets a
one-line error and changes nothing; a good one moves the request, records
the move and publishes it to its new version's queue."""

from __future__ import annotations

import re
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from loomflow_worker.runtime.sql import query

from .celery_harness import Fleet
from .helpers import cli

pytestmark = pytest.mark.slow


def _fleet_as_left(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(query("effects_table"))
        conn.execute(
            "INSERT INTO workers (worker, hostname, pid, slots, heartbeat_interval, seen_at)"
            " VALUES ('old:1', 'old', 1, 10, 60, now() - interval '10 minutes'),"
            "        ('new:2', 'new', 2, 10, 60, now())")
        conn.execute(
            "INSERT INTO worker_agents (worker, agent, version, built_at) VALUES"
            " ('old:1', 'deploy', 'v1', now() - interval '1 hour'),"
            " ('new:2', 'deploy', 'v2', now())")
        for request_id, status, version, waits in [
            ("done", "succeeded", "v1", False), ("fresh", "queued", None, False),
            ("busy", "running", "v1", False), ("waits", "queued", "v1", True),
        ]:
            conn.execute(
                "INSERT INTO runs (request_id, scope, session_id, agent, prompt, status,"
                " attempts, agent_version, version_wait_since, routing, finished_at)"
                " VALUES (%s, %s, %s, 'deploy', 'p', %s, 1, %s,"
                "         CASE WHEN %s THEN now() - interval '5 minutes' END, %s,"
                "         CASE WHEN %s = 'succeeded' THEN now() END)",
                (request_id, request_id, request_id, status, version, waits,
                 psycopg.types.json.Jsonb({"queue": "q@deploy@v1", "version": "v1",
                                           "base": {"queue": "q"}}) if waits else None,
                 status))


def _ledger_row(dsn: str, request_id: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        row = conn.execute("SELECT status, agent_version, version_wait_since, routing"
                           " FROM runs WHERE request_id = %s", (request_id,)).fetchone()
        moves = conn.execute("SELECT from_version, to_version, by FROM run_upgrades"
                             " WHERE request_id = %s", (request_id,)).fetchall()
    assert row is not None
    return {**row, "moves": moves}


@pytest.mark.parametrize(("args", "error"), [
    (("done",), "request done already succeeded: only an unfinished request moves"),
    (("fresh",), "request fresh has not started: it runs on any version of its agent already"),
    (("busy",), "request busy is running on version v1: it moves once it waits"),
    (("waits", "--to", "v9"), "no worker has registered version v9 of agent 'deploy' "
                              "(known: v2 (live), v1); start a worker of it first"),
    (("waits", "--to", "v1"), "version v1 is the version it is pinned to already"),
    (("waits", "--to", "no way"), "version 'no way' is not a version"),
    (("nobody",), "nobody"),
    (("--agent", "deploy"), "--agent needs --from VERSION"),
    ((), "give a REQUEST, or --agent NAME --from VERSION"),
])
def test_a_bad_upgrade_says_what_is_wrong_and_changes_nothing(
    fleet: Fleet, args: tuple[str, ...], error: str
) -> None:
    _fleet_as_left(fleet.dsn)
    before = {r: _ledger_row(fleet.dsn, r) for r in ("done", "fresh", "busy", "waits")}
    done = cli(fleet, "upgrade", *args)
    assert done.returncode in (2, 4), done.stdout + done.stderr
    assert "Traceback" not in done.stderr and error in done.stderr, done.stderr
    assert done.stdout == ""
    assert {r: _ledger_row(fleet.dsn, r) for r in before} == before


def test_upgrade_moves_a_waiting_request_and_versions_shows_the_fleet(fleet: Fleet) -> None:
    _fleet_as_left(fleet.dsn)
    listed = cli(fleet, "versions")
    assert listed.returncode == 0, listed.stderr
    header, v2, v1 = listed.stdout.splitlines()
    assert header.split() == ["AGENT", "VERSION", "WORKERS", "SEEN", "RUNNING", "WAITING",
                              "QUEUED"]
    assert v2.split()[:4] == ["deploy", "v2", "1", "now"]
    assert v1.split()[:5] == ["deploy", "v1", "0", "last", "seen"]
    # Running 1, waiting 1 (since a time), queued 0.
    assert re.search(r"  1  +1 since [0-9-]+ [0-9:]+  +0$", v1), v1
    assert ("agent 'deploy' version v1: 1 requests wait for a worker of it and none is "
            "alive; start one, or move them: loomflow-worker upgrade --agent deploy --from v1"
            ) in listed.stderr

    doctor = cli(fleet, "doctor")
    versions = next(line for line in doctor.stdout.splitlines() if " versions: " in line)
    assert versions == (
        "FAIL versions: deploy v2 on new:2; deploy v1 on no live worker (1 waiting); start a "
        "worker of deploy v1, or move its requests: loomflow-worker upgrade --agent deploy "
        "--from v1"), doctor.stdout

    moved = cli(fleet, "upgrade", "--agent", "deploy", "--from", "v1")
    assert moved.returncode == 0, moved.stderr
    assert moved.stdout == "waits: moved from version v1 to v2\n"  # the running one stays
    after = _ledger_row(fleet.dsn, "waits")
    assert after["agent_version"] == "v2" and after["version_wait_since"] is None
    assert after["routing"] == {"queue": "q@deploy@v2", "version": "v2", "base": {"queue": "q"}}
    assert after["moves"] == [{"from_version": "v1", "to_version": "v2", "by": "upgrade"}]
    assert _ledger_row(fleet.dsn, "busy")["agent_version"] == "v1"
    shown = cli(fleet, "show", "waits")
    assert "version   v2\n" in shown.stdout
    assert "from version v1 to v2, by upgrade" in shown.stdout


def test_the_console_shows_versions_and_moves(fleet: Fleet) -> None:
    from starlette.testclient import TestClient

    from loomflow_worker.console.app import create_app
    from loomflow_worker.tasks import settings

    _fleet_as_left(fleet.dsn)
    with TestClient(create_app(settings()), client=("127.0.0.1", 40000),
                    base_url="http://localhost:8040") as browser:
        page = browser.get("/fleet").text
        assert '<tr data-agent="deploy" data-version="v1" class="dead">' in page
        assert '<tr data-agent="deploy" data-version="v2">' in page
        waiting = browser.get("/runs/waits").text
        assert "waits for a worker of agent deploy version v1 since" in waiting
        assert "none alive since" in waiting
        assert cli(fleet, "upgrade", "waits").returncode == 0
        moved = browser.get("/runs/waits").text
        assert '<dd id="version">v2</dd>' in moved
        assert "from version v1 to v2, by upgrade" in moved

