"""Postgres and Redis connection loss while runs are in flight.

The services themselves can't be restarted here, so their connections are
ended instead, which is what a restart does to every client:

- Postgres: from an admin connection, ``pg_terminate_backend`` of every
  backend of the test database but the admin's own (pool connections, lock
  connections and their advisory locks, the sweeper, the tool's own
  connections, the test's enqueue pool);
- Redis: ``CLIENT KILL`` of every connection the fleet's processes and this
  test process hold (broker, result backend, pub/sub). Only ours: Redis is
  shared with other test runs on this machine, which ``CLIENT KILL TYPE
  normal`` would hit too.

Each is done twice, while tool calls are in flight. Afterwards every request
is ``succeeded`` with the right output (ledger and Celery result); no tool
call ran after its result was journaled (G1, checked exactly by an audit
trigger on journal_steps), so a completed call ran twice only inside G1's
at-least-once window; no tool call ran on two workers at once; every session
kept its order without overlap."""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections import Counter
from collections.abc import Callable
from functools import partial

import psycopg
import pytest
import redis

from tests.chaos.checks import (
    Sent,
    assert_sound,
    executions,
    fleet_pids,
    grep_logs,
    install_journal_audit,
    kill_postgres_backends,
    problem_lines,
    send,
    verdict,
    wait_terminal,
)
from tests.integration.celery_harness import REDIS_PORT, REDIS_URL, Fleet
from tests.integration.helpers import tcp_connections, wait_until

pytestmark = pytest.mark.slow

ENV = {
    "TEST_TOOL_SLEEP": "0.3",
    "LOOMFLOW_WORKER_SWEEP_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_MAX_CRASHES": "10",
    "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_LEASE": "5",
}
REQUESTS = 10
SESSIONS = 3
ROUNDS = 2


def _start(fleet: Fleet) -> list[Sent]:
    install_journal_audit(fleet.dsn)
    fleet.start("w1", 2, cli=False, **ENV)
    fleet.start("w2", 2, cli=False, **ENV)
    return [send(i, f"s{i % SESSIONS}", f"u{i % SESSIONS}", "abc") for i in range(REQUESTS)]


def _wait_in_flight(dsn: str, after: float, count: int = 2, timeout: float = 30) -> list[str]:
    """Wait until ``count`` tool calls that started after ``after`` (epoch seconds)
    are in flight; returns their tags (fewer if the runs ended first)."""
    def tags() -> list[str]:
        return [e.tag for e in executions(dsn)
                if e.finished_at is None and e.started_at.timestamp() > after]

    with contextlib.suppress(AssertionError):  # fewer: the runs ended first
        return wait_until(tags, f"{count} tool calls in flight", timeout,
                          until=lambda found: len(found) >= count)
    return tags()


def _open_attempts(dsn: str) -> set[tuple[str, int]]:
    """The attempts the ledger has open (started and not ended)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT request_id, attempt FROM run_attempts WHERE ended_at IS NULL"
        ).fetchall()
    return {(str(request_id), int(attempt)) for request_id, attempt in rows}


def _all_ended(dsn: str, attempts: set[tuple[str, int]]) -> bool:
    return not attempts & _open_attempts(dsn)


def kill_redis_clients(pids: list[int]) -> Counter[str]:
    """``CLIENT KILL`` every Redis connection held by ``pids``; counts by client name
    and command."""
    ports = {local for local, remote in tcp_connections(pids) if remote == REDIS_PORT}
    admin = redis.Redis.from_url(REDIS_URL)
    killed: Counter[str] = Counter()
    try:
        me = int(admin.client_id())
        for entry in admin.client_list():
            client_port = int(str(entry["addr"]).rsplit(":", 1)[1])
            ours = client_port in ports and int(entry["id"]) != me
            if ours and admin.client_kill_filter(_id=entry["id"]):
                killed[str(entry.get("cmd") or "?")] += 1
    finally:
        admin.close()
    return killed


def _check(fleet: Fleet, sent: list[Sent], label: str, in_flight: list[list[str]]) -> None:
    final = wait_terminal(fleet.dsn, sent, timeout=90)
    v = verdict(fleet.dsn, sent)
    def count(needle: str) -> int:
        return len(grep_logs(fleet, needle, limit=10_000).splitlines())

    # A lost lock connection fences every run on it: "... fencing its N runs".
    fenced = sum(map(int, re.findall(r"fencing its (\d+) runs",
                                     grep_logs(fleet, "fencing its", limit=10_000))))
    retries = count("retrying in")
    redispatched, parked = count("dispatched request"), count("parked")
    duplicates = count(" already succeeded")
    print(f"[{label}] {v.summary()} in_flight_at_kills={sum(map(len, in_flight))} "
          f"fenced={fenced} retries={retries} sweeper_redispatches={redispatched} "
          f"parked={parked} duplicates_of_finished={duplicates} "
          f"statuses={sorted(set(final.values()))}")
    for name, items in (
        ("lost", v.lost), ("completed twice", list(v.completed_twice.items())),
        ("G1 violation", v.g1_violations), ("re-run in window", v.reruns_in_window),
        ("several keys", v.keys_per_tag), ("concurrent runs", v.concurrent_runs),
        ("never completed", v.never_completed), ("order", v.order_violations),
        ("overlap", v.overlaps), ("wrong output", v.wrong_outputs),
        ("celery result", v.result_problems),
    ):
        for item in items[:10]:
            print(f"[{label}] {name}: {item}")
    context = f"worker log lines:\n{problem_lines(fleet)}"
    assert_sound(v, context)
    # Interrupted: the calls in flight at the kills, plus at most one a fenced
    # attempt started before it noticed (its failed heartbeat then stops it).
    assert len(v.interrupted) <= sum(map(len, in_flight)) + fenced, context


def _kill_in_rounds(fleet: Fleet, label: str, kill: Callable[[int, list[str]], None]) -> None:
    """Send the runs, then up to ROUNDS times: wait for tool calls in flight and
    ``kill(round_no, tags)`` connections under them; then check every run."""
    began = time.monotonic()
    sent = _start(fleet)
    in_flight: list[list[str]] = []
    after = 0.0
    for round_no in range(ROUNDS):
        tags = _wait_in_flight(fleet.dsn, after)
        if not tags:
            break
        after = time.time()
        open_at_kill = _open_attempts(fleet.dsn)
        kill(round_no, tags)
        in_flight.append(tags)
        # The fleet noticed before the next round is looked for: every attempt
        # open at the kill has ended (lost with its lock connection, or done).
        wait_until(partial(_all_ended, fleet.dsn, open_at_kill),
                   f"round {round_no + 1}: the attempts open at the kill ended")
    _check(fleet, sent, label, in_flight)
    print(f"[{label}] took {time.monotonic() - began:.1f}s")


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_postgres_connections_killed_mid_run(fleet: Fleet, broker: str) -> None:
    label = f"postgres/{broker}"

    def kill(round_no: int, tags: list[str]) -> None:
        at, killed = kill_postgres_backends(fleet.dsn)
        print(f"\n[{label}] round {round_no + 1} at {at:%T.%f}: in flight {tags}; "
              f"terminated {sum(killed.values())} backends {dict(killed)}")
        assert killed["loomflow-worker lock"] >= 1, "no lock connection was ended"

    _kill_in_rounds(fleet, label, kill)


def test_redis_connections_killed_mid_run(fleet: Fleet) -> None:
    label = "redis/redis"

    def kill(round_no: int, tags: list[str]) -> None:
        pids = [pid for group in fleet_pids(fleet).values() for pid in group]
        killed = kill_redis_clients([*pids, os.getpid()])
        print(f"\n[{label}] round {round_no + 1}: in flight {tags}; "
              f"killed {sum(killed.values())} Redis connections by last command {dict(killed)}")
        assert sum(killed.values()) >= 1, "no Redis connection was killed"

    _kill_in_rounds(fleet, label, kill)
