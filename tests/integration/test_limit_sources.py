"""Limits and weights in settings hold from the first enqueue, before any worker
started; the newest settings win over older ones, never over the command, and a
process whose settings change or lose to the fleet's says so."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pytest

from loomflow_worker import tasks
from loomflow_worker.execution import limits
from loomflow_worker.settings import budget_of
from loomflow_worker.tasks import run_agent

from .celery_harness import Fleet
from .helpers import calls


def _configure(**update: Any) -> None:
    """This process's settings, with ``update`` (a new process's, in effect)."""
    tasks.configure(tasks.settings().model_copy(update=update))


def _held(dsn: str, ids: list[str]) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [str(r[0]) for r in conn.execute(
            "SELECT request_id FROM runs WHERE request_id = ANY(%s) AND waiting_for IS NOT NULL"
            " ORDER BY enqueued_at", (ids,)).fetchall()]


def _limits(dsn: str) -> dict[str, tuple[int, str]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {row.name: (row.max_runs, row.source) for row in limits.read(conn)}


def _weights(dsn: str) -> dict[str, tuple[float | None, str | None]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {w.fairness_key: (w.weight, w.source) for w in limits.read_weights(conn)}


def test_limits_in_an_enqueuing_processs_settings_hold_before_any_worker_started(
    fleet: Fleet,
) -> None:
    assert _limits(fleet.dsn) == {}
    _configure(limits={"per_key": 2}, fairness_weights={"bob": 3.0})
    sent = [run_agent.delay(calls(f"a{i}"), f"s{i}", user_id="alice").id for i in range(5)]
    # No worker ever started: the third of alice's requests on is withheld
    # in the ledger by the limit this process's settings declared.
    assert _held(fleet.dsn, sent) == sent[2:]
    assert _limits(fleet.dsn) == {"per_key": (2, "settings")}
    assert _weights(fleet.dsn) == {"bob": (3.0, "settings")}


def test_the_newest_settings_win_and_say_so(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    _configure(limits={"per_key": 2})
    run_agent.delay(calls("a"), "s1", user_id="alice")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="loomflow_worker.execution.limits"):
        _configure(limits={"per_key": 5})  # a process of a newer release
        run_agent.delay(calls("b"), "s2", user_id="alice")
    assert _limits(fleet.dsn) == {"per_key": (5, "settings")}
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "limit 'per_key' is now 5" in said[0] and "it was 2" in said[0]


def test_a_budget_in_settings_changed_to_another_unit_and_period_says_so(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    # The same amount in another unit and period is a change all the same.
    _configure(budgets={"acme": budget_of(1000, "tokens", "day")})
    run_agent.delay(calls("a"), "s1", user_id="acme")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="loomflow_worker.execution.limits"):
        _configure(budgets={"acme": budget_of(1000, "usd", "month")})
        run_agent.delay(calls("b"), "s2", user_id="acme")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "the budget of 'acme' is now $1,000.00 a month" in said[0] \
        and "it was 1,000 tokens a day" in said[0], said


def test_a_limit_set_with_the_command_holds_over_settings_and_says_so(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        limits.write(conn, "per_key", 1)
        limits.write_weight(conn, "bob", 2.0)
    with caplog.at_level(logging.WARNING, logger="loomflow_worker.execution.limits"):
        _configure(limits={"per_key": 50}, fairness_weights={"bob": 9.0})
        sent = [run_agent.delay(calls(f"a{i}"), f"s{i}", user_id="alice").id for i in range(3)]
    assert _limits(fleet.dsn) == {"per_key": (1, "command")}
    assert _weights(fleet.dsn) == {"bob": (2.0, "command")}
    assert _held(fleet.dsn, sent) == sent[1:]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all("set with `loomflow-worker limits`" in s for s in said), said
    # Removed with the command, settings apply again at their next declaration.
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        limits.write(conn, "per_key", None)
    _configure(limits={"per_key": 50}, queue=tasks.settings().queue + "-next")
    run_agent.delay(calls("b"), "s9", user_id="alice")
    assert _limits(fleet.dsn) == {"per_key": (50, "settings")}
