"""Many runs in one worker process: a lost lock connection, a SIGKILL of the
whole process, and a soft shutdown, each with every run in flight."""

from __future__ import annotations

import os
import signal
from datetime import datetime, timedelta

import psycopg
import pytest

from loomflow_worker.tasks import run_agent
from tests.chaos.checks import (
    Sent,
    assert_sound,
    install_journal_audit,
    running_count,
    send,
    verdict,
    wait_terminal,
)
from tests.integration.celery_harness import Fleet
from tests.integration.helpers import backends, tcp_connections, wait_until

pytestmark = pytest.mark.slow

FAST_RECOVERY = {
    "LOOMFLOW_WORKER_SWEEP_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_LEASE": "3",
    "LOOMFLOW_WORKER_MAX_CRASHES": "20",
    # Each tool call takes a second: every run is in flight when the fault comes.
    "TEST_TOOL_SLEEP": "1.0",
}


def _ids(sent: list[Sent]) -> list[str]:
    return [s.request_id for s in sent]


def _wait_running(dsn: str, ids: list[str], timeout: float = 60) -> None:
    wait_until(lambda: running_count(dsn, ids), f"all {len(ids)} running (seen as: how many)",
               timeout, until=lambda running: running >= len(ids), every=0.05)


def _lock_backends(dsn: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = 'loomflow-worker lock'"
        ).fetchall()
    return [int(r[0]) for r in rows]


def _resumed(dsn: str, sent: list[Sent] | list[str], after: datetime) -> list[datetime]:
    """When each request's first attempt started after ``after``."""
    ids = [s if isinstance(s, str) else s.request_id for s in sent]
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT request_id, min(started_at) FROM run_attempts "
            "WHERE request_id = ANY(%s) AND started_at > %s GROUP BY request_id",
            (ids, after),
        ).fetchall()
    return [r[1] for r in rows]


#: How long a tool call lasts in the process that is killed, frozen or stopped.
W1_TOOL_SLEEP = "20"


def _fill_one_process(
    fleet: Fleet, runs: int, *, cli: bool = False, **env: str
) -> tuple[list[Sent], datetime]:
    """``runs`` requests in flight in worker w1 (threads pool), a spare worker w2 ready;
    returns them and the database's clock at that moment. w1's tool calls last
    long enough that every run is still in flight in it once w2 is ready,
    however slowly w2 starts on a loaded machine."""
    fleet.start("w1", concurrency=runs, cli=cli, pool="threads",
                **{**env, "TEST_TOOL_SLEEP": W1_TOOL_SLEEP})
    sent = [send(i, f"s{i}", "u", letters="abc") for i in range(runs)]
    _wait_running(fleet.dsn, _ids(sent))
    fleet.start("w2", concurrency=runs, pool="threads", **env)
    with psycopg.connect(fleet.dsn, autocommit=True) as admin:
        row = admin.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return sent, row[0]


def test_fifty_runs_on_one_lock_connection_fenced_together(fleet: Fleet) -> None:
    install_journal_audit(fleet.dsn)
    fleet.start("w1", concurrency=50, pool="threads",
                LOOMFLOW_WORKER_LOCK_CONNECTIONS="1", **FAST_RECOVERY)
    sent = [send(i, f"s{i}", "u", letters="abc") for i in range(50)]
    _wait_running(fleet.dsn, _ids(sent))

    # The 50 session locks live on one connection; the process needs a few in all.
    lock_backends = _lock_backends(fleet.dsn)
    assert len(lock_backends) == 1, lock_backends
    assert backends(fleet.dsn, "loomflow-worker%") <= 5

    with psycopg.connect(fleet.dsn, autocommit=True) as admin:
        ended = admin.execute(
            "SELECT pg_terminate_backend(%s, 5000)", (lock_backends[0],)).fetchone()
        assert ended == (True,)
        cut = admin.execute("SELECT clock_timestamp()").fetchone()
    assert cut is not None
    fleet.start("w2", concurrency=50, pool="threads", **FAST_RECOVERY)

    wait_terminal(fleet.dsn, sent, timeout=120)
    v = verdict(fleet.dsn, sent)
    assert_sound(v, v.summary())
    # Every run was fenced and resumed by a new attempt ...
    resumed = _resumed(fleet.dsn, sent, cut[0])
    assert len(resumed) == 50, v.summary()
    # ... and no fenced attempt wrote to the journal after the cut: every entry
    # of a scope written since came after its request's next attempt began.
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        row = conn.execute(
            """
            SELECT count(*) FROM journal_writes w
              JOIN runs r ON r.scope = w.session_id
             WHERE r.request_id = ANY(%(ids)s) AND w.written_at > %(cut)s
               AND w.written_at < (SELECT min(a.started_at) FROM run_attempts a
                                    WHERE a.request_id = r.request_id
                                      AND a.started_at > %(cut)s)
            """,
            {"ids": [s.request_id for s in sent], "cut": cut[0]},
        ).fetchone()
    assert row == (0,)


#: A hundred runs at once; in the spare worker that resumes them, each tool
#: call takes a second.
HUNDRED = {**FAST_RECOVERY, "TEST_TOOL_SLEEP": "1"}


def test_a_process_killed_with_a_hundred_runs_in_flight(fleet: Fleet) -> None:
    install_journal_audit(fleet.dsn)
    sent, cut = _fill_one_process(fleet, 100, **HUNDRED)
    assert running_count(fleet.dsn, _ids(sent)) == 100
    fleet.kill("w1")

    wait_terminal(fleet.dsn, sent, timeout=180)
    v = verdict(fleet.dsn, sent)
    assert_sound(v, v.summary())
    resumed = _resumed(fleet.dsn, sent, cut)
    assert len(resumed) == 100, v.summary()
    last = (max(resumed) - cut).total_seconds()
    print(f"the last of 100 runs resumed {last:.2f}s after the kill")
    # The killed process's attempts were ended as their requests' next attempts
    # started: none stays open, each says it died, and a death shared by a
    # hundred runs is charged to none of them.
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        ended = conn.execute(
            "SELECT outcome, count(*), count(ended_at) FROM run_attempts "
            "WHERE request_id = ANY(%s) AND started_at < %s GROUP BY outcome",
            (_ids(sent), cut)).fetchall()
    assert ended == [("died", 100, 100)], ended
    assert v.crashes == 0, v.summary()


#: Three hundred runs that wait on their model (and open no connection of
#: their own), long enough that every one is still in flight once the spare
#: worker is ready.
ORPHANS = 300
WAITING_ON_THE_MODEL = {**FAST_RECOVERY, "TEST_MODEL_LATENCY": "20"}

#: How soon after their lease ran out (their last heartbeat, plus the two
#: heartbeat intervals after which the sweeper takes a run whose lock is free
#: for dead) the sweeper has dispatched every run of a SIGKILLed process (a
#: sweep interval to notice, then one batch), and every one has resumed in the
#: spare worker (which takes and starts 300 runs in 1 to 2.5 s on this 2-CPU
#: machine, up to 4.5 s while other tests load it).
DISPATCHED_WITHIN = 1.0
RESUMED_WITHIN = 6.0


@pytest.mark.slow
@pytest.mark.serial  # its bounds are a second or a few: alone, not beside other tests
def test_three_hundred_orphans_resume_in_seconds_dispatched_in_one_batch(fleet: Fleet) -> None:
    """A process with 300 runs in flight is SIGKILLed: the sweeper dispatches
    its orphans as one batch (one ledger statement, one round trip to the
    broker), within DISPATCHED_WITHIN seconds of their lease running out (one
    by one, at some 9 ms each, it took 2.6 s), the last resumes in the spare
    worker within RESUMED_WITHIN seconds of it, and each is dispatched once."""
    env = WAITING_ON_THE_MODEL
    fleet.start("w1", concurrency=ORPHANS, pool="threads", **env)
    sent = [run_agent.delay(f"hello {i}", f"s{i}", agent="slow-model") for i in range(ORPHANS)]
    ids = [r.id for r in sent]
    _wait_running(fleet.dsn, ids)
    # The spare's model answers 10 s after a run resumed: no run ends there
    # while the others resume (within RESUMED_WITHIN), and none waits 20 s.
    fleet.start("w2", concurrency=ORPHANS, pool="threads",
                **{**env, "TEST_MODEL_LATENCY": "10"})
    assert running_count(fleet.dsn, ids) == ORPHANS
    fleet.kill("w1")
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT clock_timestamp(), max(heartbeat_at) FROM runs "
                           "WHERE request_id = ANY(%s)", (ids,)).fetchone()
    assert row is not None
    killed, last_beat = row
    lease_out = last_beat + timedelta(
        seconds=2 * float(env["LOOMFLOW_WORKER_HEARTBEAT_INTERVAL"]))
    resumed = wait_until(lambda: _resumed(fleet.dsn, ids, killed),
                         f"all {ORPHANS} resumed (seen as: those resumed)", 60,
                         until=lambda resumed: len(resumed) >= ORPHANS, every=0.1)
    for result in sent:
        assert result.get(timeout=60)["output"]
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        swept = conn.execute("SELECT min(swept_at), max(swept_at) FROM runs "
                             "WHERE request_id = ANY(%s)", (ids,)).fetchone()
        dispatches = conn.execute(
            "SELECT count(*), count(DISTINCT request_id) FROM sweeper_actions "
            "WHERE action = 'redispatch' AND request_id = ANY(%s)", (ids,)).fetchone()
        attempts = conn.execute(
            "SELECT count(*), count(DISTINCT request_id) FROM run_attempts "
            "WHERE request_id = ANY(%s) AND started_at > %s", (ids, killed)).fetchone()
    assert swept is not None
    first, last = ((at - lease_out).total_seconds() for at in (min(resumed), max(resumed)))
    began, dispatched = ((at - lease_out).total_seconds() for at in swept)
    print(f"\n{ORPHANS} orphans: the sweeper dispatched them {began:.2f}s to {dispatched:.2f}s "
          f"after their lease ran out; the first resumed {first:.2f}s, the last {last:.2f}s "
          f"after it ({(max(resumed) - killed).total_seconds():.2f}s after the kill)")
    # Each dispatched again once, and started once more.
    assert dispatches == (ORPHANS, ORPHANS) and attempts == (ORPHANS, ORPHANS), (
        dispatches, attempts)
    assert dispatched < DISPATCHED_WITHIN, f"dispatched {dispatched:.2f}s after the lease"
    assert last < RESUMED_WITHIN, f"the last orphan resumed {last:.2f}s after its lease"


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_deploy_whose_replacement_takes_the_runs_slowly_gets_no_second_dispatch(
    fleet: Fleet, pool: str
) -> None:
    """A rolling deploy: the old worker, with 24 runs in flight, shuts down
    (soft shutdown, then its runs are stopped and their messages requeued),
    and its replacement, taking 6 at a time, works through them for seconds.
    Their messages are in the broker or held by the replacement the whole
    time: the sweeper dispatches none of them again, and each runs once more."""
    env = {**FAST_RECOVERY, "LOOMFLOW_WORKER_SOFT_SHUTDOWN_TIMEOUT": "0.5"}
    count = 24 if pool == "threads" else 8
    # The old worker's runs wait on their model until it stops them; the
    # replacement's take 1.5 s each, a quarter of them at a time.
    fleet.start("w1", concurrency=count, cli=True, pool=pool, TEST_MODEL_LATENCY="60", **env)
    sent = [run_agent.delay(f"hello {i}", f"s{i}", agent="slow-model") for i in range(count)]
    ids = [r.id for r in sent]
    _wait_running(fleet.dsn, ids)
    fleet.start("w2", concurrency=count // 4, cli=True, pool=pool, TEST_MODEL_LATENCY="1.5",
                **env)
    fleet.terminate("w1", timeout=30)
    for result in sent:
        assert result.get(timeout=90)["output"]
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        dispatched = conn.execute(
            "SELECT request_id, detail FROM sweeper_actions WHERE action = 'redispatch'"
        ).fetchall()
        attempts = conn.execute(
            "SELECT count(*) FROM run_attempts WHERE request_id = ANY(%s)", (ids,)).fetchone()
    assert dispatched == [], f"{len(dispatched)} dispatched again: {dispatched[:3]}"
    assert attempts == (2 * count,), attempts


def test_soft_shutdown_with_a_hundred_runs_in_flight_loses_none(fleet: Fleet) -> None:
    install_journal_audit(fleet.dsn)
    env = {**HUNDRED, "LOOMFLOW_WORKER_SOFT_SHUTDOWN_TIMEOUT": "1"}
    sent, _ = _fill_one_process(fleet, 100, cli=True, **env)
    fleet.terminate("w1", timeout=30)

    wait_terminal(fleet.dsn, sent, timeout=180)
    v = verdict(fleet.dsn, sent)
    assert_sound(v, v.summary())
    # Interrupted by a deploy, not crashed.
    assert v.crashes == 0, v.summary()


def test_a_frozen_process_is_fenced_as_a_whole(fleet: Fleet) -> None:
    install_journal_audit(fleet.dsn)
    sent, cut = _fill_one_process(fleet, 30, **HUNDRED)
    assert running_count(fleet.dsn, _ids(sent)) == 30
    frozen = fleet.workers["w1"]
    os.killpg(frozen.pid, signal.SIGSTOP)
    try:
        wait_terminal(fleet.dsn, sent, timeout=120)
        # Its lock connections were ended by the sweeper, all of them.
        assert _lock_backends_of(fleet, "w1") == []
        v = verdict(fleet.dsn, sent)
        assert_sound(v, v.summary())
        assert len(_resumed(fleet.dsn, sent, cut)) == 30, v.summary()
        # Frozen, not crashed: the sweeper recorded their attempts lost.
        assert v.crashes == 0, v.summary()
        written = _journal_writes(fleet.dsn)
    finally:
        os.killpg(frozen.pid, signal.SIGCONT)
    # Continued, the frozen process finishes the tool calls it was in (their side
    # effects are its own), then finds every run fenced: its attempts end having
    # journaled nothing more.
    fleet.wait_tasks_ended("w1", [s.request_id for s in sent])
    assert _journal_writes(fleet.dsn) == written
    logs = "".join(p.read_text(errors="replace") for p in fleet.logs.glob("*.log"))
    assert "ended their worker's lock connection" in logs


def _journal_writes(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM journal_writes").fetchone()
    assert row is not None
    return int(row[0])


def _lock_backends_of(fleet: Fleet, name: str) -> list[int]:
    """The lock connections' backends of one worker, by the client port's owner."""
    pid = fleet.workers[name].pid
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid, client_port FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = 'loomflow-worker lock'"
        ).fetchall()
    ports = {local for local, _ in tcp_connections([pid])}
    return [int(backend) for backend, port in rows if port in ports]
