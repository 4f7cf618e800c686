"""Runs made through PostgresRuntime outside Celery (a web process's own
agent.run) are recorded as they open and end, and `requests --direct`,
`show` and the console list them, apart from requests, with their journal."""

from __future__ import annotations

import html
import re

import anyio
import psycopg
import pytest
from starlette.testclient import TestClient

from loomflow_worker import admin
from loomflow_worker.console import create_app
from loomflow_worker.runtime import PostgresRuntime
from loomflow_worker.tasks import settings
from loomflow_worker.testing import EffectsLog

from .celery_harness import Fleet
from .helpers import Crash, calls, cli, crash_on, crashes, make_agent


def _run_directly(dsn: str) -> None:
    """A web process's two runs: one that ends, one that raises."""

    async def run() -> None:
        runtime = await PostgresRuntime.connect(dsn)
        try:
            await runtime.init_schema()
            effects = EffectsLog(dsn, on_start=crash_on("boom"))
            agent = make_agent(runtime, effects)
            done = await agent.run(calls("d0", "d1"), session_id="web-s", user_id="ana")
            assert done.output == "done: recorded d0, recorded d1"
            with crashes():
                await agent.run(calls("boom"), session_id="web-t", user_id="ana")
        finally:
            await runtime.aclose()

    anyio.run(run)


def _recorded(dsn: str) -> dict[str, admin.DirectRun]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {run.session_id: run for run in admin.list_direct_runs(conn)}


def test_a_run_outside_celery_is_recorded_and_shown_with_its_journal(fleet: Fleet) -> None:
    _run_directly(fleet.dsn)
    runs = _recorded(fleet.dsn)
    ended, raised = runs["web-s"], runs["web-t"]
    assert (ended.outcome, ended.user_id, ended.epoch) == ("succeeded", "ana", 0)
    assert ended.finished_at is not None and ended.error is None
    assert raised.outcome == "raised" and raised.error == f"{Crash.__name__}: crash in boom"
    # Read as a request of its own kind, with its journal.
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        detail = admin.get_request(conn, ended.run_id)
    assert (detail.kind, detail.status, detail.session_id) == ("direct", "succeeded", "web-s")
    assert {'tool record(tag="d0")', 'tool record(tag="d1")', "model call 1"} <= {
        step.label for step in detail.journal}
    assert all(step.executed_in == 1 for step in detail.journal)

    with TestClient(create_app(settings()), client=("127.0.0.1", 40000),
                    base_url="http://localhost:8040") as client:
        listed = client.get("/requests").text
        rows = dict(re.findall(r'<tr data-direct="([^"]+)">(.*?)</tr>', listed, re.S))
        assert set(rows) == {ended.run_id, raised.run_id}
        assert "succeeded" in rows[ended.run_id] and "raised" in rows[raised.run_id]
        page = client.get(f"/runs/{ended.run_id}").text
        assert 'id="direct-note"' in page and 'id="cancel"' not in page
        assert 'tool record(tag="d0")' in html.unescape(page)
        failed = html.unescape(client.get(f"/runs/{raised.run_id}").text)
        assert "crash in boom" in failed


@pytest.mark.slow
def test_requests_direct_and_show_read_a_run_outside_celery(fleet: Fleet) -> None:
    _run_directly(fleet.dsn)
    ended = _recorded(fleet.dsn)["web-s"]
    listed = cli(fleet, "requests", "--direct")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split()[:3] == ["RUN", "SESSION", "USER"]
    assert any(ended.run_id in line and "succeeded" in line for line in lines), lines
    assert any("web-t" in line and "raised" in line for line in lines), lines
    # Plain `requests` lists requests only, and says where the others are.
    plain = cli(fleet, "requests")
    assert plain.returncode == 0 and ended.run_id not in plain.stdout
    assert "--direct lists them" in plain.stderr
    shown = cli(fleet, "show", ended.run_id)
    assert shown.returncode == 0, shown.stderr
    assert "direct of agent (outside Celery) in session web-s, user ana" in shown.stdout
    assert 'tool record(tag="d1")' in shown.stdout
