"""The fleet's registry of agents lives in Postgres: a process that enqueues
needs loomflow_worker and the database, not the agents' code. Each worker
records the agents it builds (worker_agents); an enqueue of an agent the
process did not register reads it from there, with what enqueuing needs of
it (its fairness key here)."""

from __future__ import annotations

import json
import subprocess
import sys

import psycopg
import pytest

from tests.integration.celery_harness import Fleet

pytestmark = pytest.mark.slow

#: A web process: no agents module of its own (LOOMFLOW_WORKER_AGENTS empty).
ENQUEUE = """
import json, sys
from loomflow_worker.execution.registry import registered_agents
from loomflow_worker import InvalidInput
from loomflow_worker.tasks import run_agent
try:
    handle = run_agent.delay('call record {"tag": "web-1"}', 'web-session', agent='deploy')
except InvalidInput as exc:
    print(json.dumps({"refused": str(exc), "registered": registered_agents()}))
    sys.exit(0)
print(json.dumps({"id": handle.id, "output": handle.get(timeout=60)["output"],
                  "registered": registered_agents()}))
"""


def _enqueue(fleet: Fleet) -> dict[str, object]:
    env = {**fleet.env, "LOOMFLOW_WORKER_AGENTS": ""}
    done = subprocess.run([sys.executable, "-c", ENQUEUE], env=env, capture_output=True,
                          text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    found: dict[str, object] = json.loads(done.stdout)
    return found


def test_a_process_without_the_agents_code_enqueues_once_a_worker_registered_them(
    fleet: Fleet,
) -> None:
    # Before any worker has started, nobody knows agent "deploy": refused at
    # the enqueue, saying so, and nothing written.
    refused = _enqueue(fleet)
    assert refused["registered"] == []
    assert "unknown agent 'deploy'" in str(refused["refused"])
    assert "by the fleet's workers: none yet" in str(refused["refused"])
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM runs").fetchone() == (0,)

    # A worker records the agents it serves as it starts: the same process
    # enqueues now, with the agent's fairness key from the registry.
    fleet.start("w1", concurrency=2, pool="threads",
                LOOMFLOW_WORKER_AGENTS="tests.integration.version_agents",
                TEST_FAIRNESS_KEY="tenant-7")
    done = _enqueue(fleet)
    assert done["registered"] == [] and done["output"] == "done: recorded web-1"
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT fairness_key, agent_version FROM runs WHERE request_id = %s",
                           (done["id"],)).fetchone()
        registered = conn.execute(
            "SELECT version FROM worker_agents WHERE agent = 'deploy'").fetchall()
    assert row is not None and row[0] == "tenant-7"
    assert [(row[1],)] == registered
