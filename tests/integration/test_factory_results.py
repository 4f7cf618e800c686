"""A register_agent factory may return a loomflow Workflow or a Team (an
Agent whose workers are its sub-agents): each runs as a request on real
workers, its nested agent runs journaled under the request, and a worker
killed mid-run leaves a request that resumes without running its completed
steps again."""

from __future__ import annotations

import json

import psycopg
import pytest

from loomflow_worker.tasks import run_agent

from . import flow_agents  # noqa: F401  (the enqueuing side knows the agents)
from .celery_harness import Fleet, ledger
from .helpers import calls, tool_counts, wait_for_execution

pytestmark = pytest.mark.slow

AGENTS = {"LOOMFLOW_WORKER_AGENTS": "tests.integration.flow_agents",
          "LOOMFLOW_WORKER_SWEEP_INTERVAL": "0.5",
          "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "0.5",
          "LOOMFLOW_WORKER_LEASE": "3",
          "TEST_TOOL_SLEEP": "0.4"}


def _nested_steps(dsn: str) -> list[str]:
    """Journal keys written in a child run (a namespace of 16 hex digits)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT step_name FROM journal_steps WHERE step_name ~ '^[0-9a-f]{16}/' "
            "UNION ALL SELECT step_name FROM journal_streams "
            "WHERE step_name ~ '^[0-9a-f]{16}/'").fetchall()
    return [str(r[0]) for r in rows]


def _killed_and_resumed(fleet: Fleet, agent: str, prompt: str, in_flight: str) -> dict[str, object]:
    """Run ``prompt`` on ``agent``; kill its worker while the tool call of
    ``in_flight`` runs; another worker finishes it. Its result."""
    fleet.start("w1", concurrency=1, pool="threads", **AGENTS)
    result = run_agent.delay(prompt, f"{agent}-s", user_id="ana", agent=agent)
    wait_for_execution(fleet.dsn, in_flight)
    fleet.kill("w1")
    fleet.start("w2", concurrency=1, pool="threads", **AGENTS)
    done: dict[str, object] = result.get(timeout=60)
    row = ledger(fleet.dsn, result.id)
    assert (row["status"], row["attempts"]) == ("succeeded", 2), row
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        # A worker's runs are requests: none is recorded as a run outside Celery.
        assert conn.execute("SELECT count(*) FROM direct_runs").fetchone() == (0,)
    return done


def test_a_workflow_runs_as_a_request_and_resumes_after_a_crash(fleet: Fleet) -> None:
    done = _killed_and_resumed(fleet, "flow", calls("a0", "a1"), "a1-checked")
    assert done["output"] == "done: recorded a0-checked, recorded a1-checked"
    assert done["visited"] == ["record", "plan_checks", "check"], done
    counts = tool_counts(fleet.dsn)
    # Completed steps never ran again; only the one in flight at the kill may have.
    assert counts["a0"] == counts["a1"] == counts["a0-checked"] == 1, counts
    assert counts["a1-checked"] in (1, 2), counts
    nested = _nested_steps(fleet.dsn)
    assert sum("tool_call_" in key for key in nested) >= 4, nested
    # A second request on the session is a new run: it replays nothing of the first.
    again = run_agent.delay(calls("a0", "a1"), "flow-s", user_id="ana", agent="flow")
    assert again.get(timeout=60)["output"] == done["output"]
    assert tool_counts(fleet.dsn)["a0"] == 2


def test_a_team_runs_as_a_request_and_resumes_after_a_crash(fleet: Fleet) -> None:
    told = calls("t0", "t1", "t2")
    prompt = "call delegate " + json.dumps({"worker": "scribe", "instructions": told})
    done = _killed_and_resumed(fleet, "team", prompt, "t1")
    output = str(done["output"])
    assert output.startswith("done: ") and "recorded t0, recorded t1, recorded t2" in output, done
    counts = tool_counts(fleet.dsn)
    assert counts["t0"] == 1 and counts["t2"] == 1 and counts["t1"] in (1, 2), counts
    nested = _nested_steps(fleet.dsn)
    assert sum("tool_call_" in key for key in nested) >= 3, nested
