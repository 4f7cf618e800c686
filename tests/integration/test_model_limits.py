"""Model-call budgets and provider rate limits, on real Celery workers.

The workers' "claude" agent drives loomflow's real ``AnthropicModel`` against
the local Messages API of ``messages_api``, which meters requests as a
provider meters a key: past its limit it answers 429 with ``retry-after``.
A 429 or 529 must make the model call wait, never fail the run, count a
retry or replay a journal; a fleet-wide budget keeps the calls under the
provider's limit so it never has to say so.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator

import psycopg
import pytest

from loomflow_worker.tasks import run_agent

from .celery_harness import Fleet
from .helpers import calls, cli, steps_journaled_twice
from .messages_api import API_KEY, MODEL, MessagesAPI, serving

pytestmark = pytest.mark.slow


@pytest.fixture
def api() -> Iterator[MessagesAPI]:
    with serving() as server:
        yield server


def _start(fleet: Fleet, name: str, api: MessagesAPI, concurrency: int, **env: str) -> None:
    fleet.start(name, concurrency=concurrency, pool="threads", ANTHROPIC_BASE_URL=api.url,
                ANTHROPIC_API_KEY=API_KEY, **env)


def _send(count: int) -> list[str]:
    """``count`` requests of three model calls each, every one on a session of its own."""
    return [run_agent.delay(calls(f"t{i}a", f"t{i}b"), f"s{i}", agent="claude").id
            for i in range(count)]


def _rows(dsn: str, ids: list[str]) -> list[tuple[str, int, int, int]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            "SELECT status, attempts, failures, crashes FROM runs WHERE request_id = ANY(%s)",
            (ids,),
        ).fetchall()


def _wait_all(fleet: Fleet, ids: list[str], timeout: float = 120) -> None:
    for request_id in ids:
        run_agent.AsyncResult(request_id).get(timeout=timeout)
    rows = _rows(fleet.dsn, ids)
    # Every request ran once to its end: no failure, no retry, no second
    # attempt replaying a journal.
    assert rows == [("succeeded", 1, 0, 0)] * len(ids), (rows, fleet.log_text())
    assert steps_journaled_twice(fleet.dsn) == []


def test_a_provider_rate_limit_makes_the_calls_wait_and_no_run_fail(
    fleet: Fleet, api: MessagesAPI
) -> None:
    # 6 requests a 3 s window (120 a minute) against 8 runs of 3 calls at once,
    # and the first two calls answered 529 (overloaded).
    api.per_window, api.window, api.overloaded = 6, 3.0, 2
    _start(fleet, "w1", api, concurrency=8)
    ids = _send(8)
    _wait_all(fleet, ids)
    statuses = api.statuses()
    assert statuses.count(200) == 24, statuses  # each call answered once
    assert statuses.count(429) > 0 and statuses.count(529) == 2, statuses
    log = fleet.log_text()
    assert "was rate limited or overloaded by its provider" in log, log


def test_a_fleet_wide_budget_keeps_two_workers_under_the_providers_limit(
    fleet: Fleet, api: MessagesAPI
) -> None:
    # The provider allows 6 requests at once, refilled at 6 per 3 s (120 a
    # minute); the fleet's budget for the model is 110 a minute, 3 s of it at
    # once, shared by two worker processes.
    api.per_window, api.window = 6, 3.0
    limits = json.dumps({MODEL: {"rpm": 110, "burst": 3}})
    for name in ("w1", "w2"):
        _start(fleet, name, api, concurrency=4, LOOMFLOW_WORKER_MODEL_LIMITS=limits)
    ids = _send(8)
    _wait_all(fleet, ids)
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        budgets = conn.execute("SELECT key, rpm, tpm FROM model_budgets").fetchall()
    assert budgets == [(MODEL, 110, None)]
    statuses = api.statuses()
    admitted = sorted(api.admitted())
    # The provider never had to refuse one.
    assert statuses == [200] * 24, (statuses, admitted, fleet.log_text())
    # Paced, not merely lucky: 5 calls at once, then 19 at 110 a minute.
    assert admitted[-1] - admitted[0] >= 19 * 60 / 110 - 0.5, admitted
    assert {fleet.worker_of(pid) for pid in _pids(fleet.dsn)} == {"w1", "w2"}


def test_a_thousand_runs_against_a_key_of_300_a_minute_all_succeed_at_its_pace(
    fleet: Fleet, api: MessagesAPI
) -> None:
    # Issue 18's scale: a provider key of 300 requests a minute (a bucket of a
    # minute's worth, refilled as it goes), 1,000 one-call runs on one worker of
    # 200 slots, a fleet budget of 291 a minute.
    api.per_window, api.window = 300, 60.0
    limits = json.dumps({MODEL: {"rpm": 291}})
    _start(fleet, "w1", api, concurrency=200, LOOMFLOW_WORKER_MODEL_LIMITS=limits)
    ids = [run_agent.delay(f"hello {i}", f"k{i}", agent="claude").id for i in range(1000)]
    for request_id in ids:
        run_agent.AsyncResult(request_id).get(timeout=400)
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        ended = conn.execute(
            "SELECT status, failures, crashes, count(*) FROM runs WHERE request_id = ANY(%s)"
            " GROUP BY 1, 2, 3", (ids,)).fetchall()
        outcomes = dict(conn.execute(
            "SELECT coalesce(outcome, 'open'), count(*) FROM run_attempts"
            " WHERE request_id = ANY(%s) GROUP BY 1", (ids,)).fetchall())
    # Every run succeeded, none failed, crashed or retried: an attempt either
    # succeeded or gave its slot back to wait for its booked call (paused).
    assert ended == [("succeeded", 0, 0, 1000)], (ended, outcomes)
    assert set(outcomes) <= {"succeeded", "paused"} and outcomes["succeeded"] == 1000, outcomes
    assert steps_journaled_twice(fleet.dsn) == []
    statuses = api.statuses()
    # Each call was answered once, and the provider never had to refuse one.
    assert statuses == [200] * 1000, (statuses.count(429), statuses.count(200))
    # At close to the key's pace once its first minute's bucket has gone.
    admitted = sorted(api.admitted())
    later = [t for t in admitted if t >= admitted[0] + 60]
    per_minute = 60 * (len(later) - 1) / (later[-1] - later[0])
    assert 250 <= per_minute <= 300, per_minute
    print(f"\n1,000 runs at {per_minute:.1f} calls a minute after the first; "
          f"{outcomes.get('paused', 0)} attempts paused")


def _pids(dsn: str) -> set[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {pid for (pid,) in conn.execute("SELECT DISTINCT pid FROM run_attempts")}


def test_limits_are_listed_and_changed_at_run_time_and_bad_ones_refused(fleet: Fleet) -> None:
    listed = cli(fleet, "limits")
    assert listed.returncode == 0 and "no model limits" in listed.stdout, listed
    done = cli(fleet, "limits", "set", "anthropic", "--rpm", "300", "--tpm", "400000")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "model key 'anthropic': 300 requests a minute, 400000 tokens a minute")
    table = cli(fleet, "limits").stdout.splitlines()
    assert table[0].split() == ["MODEL", "KEY", "RPM", "TPM", "BURST", "PAUSED", "CHANGED"]
    assert table[1].split()[:5] == ["anthropic", "300", "400000", "60s", "-"]
    for bad, says in [(("--rpm", "0"), "--rpm"), (("--tpm", "-5"), "--tpm"), ((), "--none")]:
        refused = cli(fleet, "limits", "set", "anthropic", *bad)
        assert refused.returncode == 2 and says in refused.stderr, refused
        assert "Traceback" not in refused.stderr
    too_long = cli(fleet, "limits", "set", "k" * 65, "--rpm", "5")
    assert too_long.returncode == 2 and "at most 64 bytes" in too_long.stderr, too_long
    rows = [json.loads(line) for line in cli(fleet, "limits", "--json").stdout.splitlines()]
    assert [(r["key"], r["rpm"], r["tpm"]) for r in rows if r["kind"] == "model"] == [
        ("anthropic", 300, 400000)]
    assert cli(fleet, "limits", "set", "anthropic", "--none").returncode == 0
    rows = [json.loads(line) for line in cli(fleet, "limits", "--json").stdout.splitlines()]
    assert [(r["key"], r["rpm"], r["tpm"]) for r in rows if r["kind"] == "model"] == [
        ("anthropic", None, None)]


def test_a_run_that_would_wait_long_for_its_budget_gives_its_slot_back(
    fleet: Fleet, api: MessagesAPI
) -> None:
    # One model call each 10 s for the fleet, and one slot: the second and
    # third requests would each hold the slot 10 s waiting for their place.
    # They give it back (PARK_AFTER 2 s) and resume at their place, so the
    # request behind them, on an agent with no budget, runs at once.
    limits = json.dumps({MODEL: {"rpm": 6, "burst": 0}})
    _start(fleet, "w1", api, concurrency=1, LOOMFLOW_WORKER_MODEL_LIMITS=limits,
           LOOMFLOW_WORKER_PARK_AFTER="2")
    paced = [run_agent.delay(f"hello {i}", f"s{i}", agent="claude").id for i in range(3)]
    # Timed from the first one's end: its first run of the agent (the model
    # client's imports, seconds on a busy machine) is not the slot's wait.
    run_agent.AsyncResult(paced[0]).get(timeout=60)
    sent = time.monotonic()
    behind = run_agent.delay(calls("q"), "s-free")
    assert behind.get(timeout=30)["output"] == "done: recorded q"
    assert time.monotonic() - sent < 8, fleet.log_text()
    shown = cli(fleet, "show", paced[2])
    assert f"waits     waiting for model key '{MODEL}' (its budget), until " in shown.stdout, shown
    for request_id in paced:
        run_agent.AsyncResult(request_id).get(timeout=60)
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT r.request_id, r.status, r.failures, r.crashes, r.waiting_for,"
            " array_agg(a.outcome ORDER BY a.attempt)"
            " FROM runs r JOIN run_attempts a USING (request_id)"
            " WHERE r.request_id = ANY(%s) GROUP BY 1, 2, 3, 4, 5", (paced,)).fetchall()
    outcomes = sorted(row[5] for row in rows)
    assert outcomes == [["paused", "succeeded"]] * 2 + [["succeeded"]], rows
    assert {row[1:5] for row in rows} == {("succeeded", 0, 0, None)}, rows
    # Each resumed call took the place it booked: 10 s apart, not booked again
    # at the end of the schedule when it resumed.
    admitted = sorted(api.admitted())
    assert len(admitted) == 3 and api.statuses() == [200] * 3, api.statuses()
    gaps = [later - earlier for earlier, later in itertools.pairwise(admitted)]
    assert all(9 <= gap <= 12 for gap in gaps), gaps
    assert "gives its slot back" in fleet.log_text()
