"""The metrics endpoint of a worker, scraped while it works."""

from __future__ import annotations

import psycopg
import pytest

from loomflow_worker.tasks import run_agent

from .celery_harness import Fleet
from .helpers import calls, scrape, wait_for_execution, wait_until
from .services import free_port

pytestmark = pytest.mark.slow


def test_the_metrics_endpoint_shows_the_counters_moving(fleet: Fleet) -> None:
    port = free_port()
    fleet.start("w1", concurrency=2, cli=True, TEST_TOOL_SLEEP="0.3",
                LOOMFLOW_WORKER_METRICS_PORT=str(port),
                LOOMFLOW_WORKER_PRICES='{"deterministic": {"input": 1, "output": 2}}')
    first = run_agent.delay(calls("m1"), "s1")
    first.get(timeout=60)
    before = scrape(port)
    running = run_agent.delay(calls("m2", "m3", "m4"), "s2")
    queued = run_agent.delay(calls("m5"), "s2")
    wait_for_execution(fleet.dsn, "m3")
    during = scrape(port)
    running.get(timeout=60)
    queued.get(timeout=60)
    after = scrape(port)

    succeeded = 'loomflow_worker_requests_total{status="succeeded"}'
    executed = 'loomflow_worker_steps_total{how="executed"}'
    writes = "loomflow_worker_journal_write_seconds_count"
    assert before[succeeded] == 1
    assert during[writes] > before[writes]  # the running request journals as it goes
    assert after[succeeded] == 3
    assert after[executed] > during.get(executed, 0) > 0
    assert after['loomflow_worker_attempts_total{kind="first"}'] == 3
    assert after.get("loomflow_worker_handoff_seconds_count", 0) >= 1  # m5 waited for m2-m4
    # The model calls' tokens and cost, as the ledger has them (no replays here).
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT agent, sum(input_tokens), sum(output_tokens), sum(cost) "
                           "FROM runs GROUP BY agent").fetchone()
    assert row is not None
    agent, input_tokens, output_tokens, cost = row
    tokens = 'loomflow_worker_model_tokens_total{{agent="{}",kind="{}",model_key="deterministic"}}'
    assert after[tokens.format(agent, "input")] == input_tokens
    assert after[tokens.format(agent, "output")] == output_tokens
    assert after[f'loomflow_worker_model_cost_dollars_total{{agent="{agent}",'
                 'model_key="deterministic"}'] == pytest.approx(float(cost)) and cost > 0
    assert not any("fairness_key" in name for name in after)  # no tenant labels unless asked
    # The event loop's lag is sampled as the process runs.
    assert after["loomflow_worker_loop_lag_seconds_count"] > during.get(
        "loomflow_worker_loop_lag_seconds_count", 0) > 0


def test_a_threads_worker_shows_its_admission_and_lock_queue(fleet: Fleet) -> None:
    port = free_port()
    fleet.start("w1", concurrency=20, cli=True, pool="threads",
                LOOMFLOW_WORKER_METRICS_PORT=str(port))
    run_agent.delay(calls("a1"), "s1").get(timeout=60)
    # Idle, it takes requests and nothing waits for its lock connections, once
    # a stamp taken after the run says so (one taken while it ran may show it
    # waiting, or paused while a loaded machine made its loop late).
    def shown() -> list[tuple[str, float]]:
        return sorted((name.split("{")[0], v) for name, v in scrape(port).items()
                      if name.startswith(("loomflow_worker_lock_queue_depth",
                                          "loomflow_worker_admitting")))

    wait_until(shown, "admitting and no lock queue", 30, every=0.2,
               until=lambda seen: seen == [("loomflow_worker_admitting", 1.0),
                                           ("loomflow_worker_lock_queue_depth", 0.0)])
