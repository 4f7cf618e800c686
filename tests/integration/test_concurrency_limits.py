"""Concurrency limits on real Celery workers: a tenant's runs across the
fleet stay within its limit, the requests over it park (no slot, no retry)
and start as slots free, and other tenants run meanwhile."""

from __future__ import annotations

import concurrent.futures
import json
import time
from datetime import datetime

import psycopg
import pytest

from loomflow_worker.execution import ledger
from loomflow_worker.runtime.errors import InvalidInput
from loomflow_worker.tasks import run_agent

from .celery_harness import Fleet, wait_sweeps_for
from .helpers import calls, cell, cli, tool_executions, wait_until

pytestmark = pytest.mark.slow

FAST = {"LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "0.5", "LOOMFLOW_WORKER_SWEEP_INTERVAL": "0.5",
        "LOOMFLOW_WORKER_HANDOFF_GRACE": "1"}


def _most_at_once(spans: list[tuple[datetime, datetime]]) -> int:
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    most = running = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


def _spans(dsn: str, prefix: str) -> list[tuple[datetime, datetime]]:
    return [(started, finished) for tag, _, started, finished in tool_executions(dsn)
            if tag.startswith(prefix) and finished is not None]


def _rows(dsn: str, ids: list[str]) -> list[tuple[str, int, int]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT status, failures, crashes FROM runs WHERE request_id = ANY(%s)",
                            (ids,)).fetchall()


def _waiting(dsn: str, request_id: str) -> str | None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT waiting_for FROM runs WHERE request_id = %s"
                           " AND waiting_slots IS NOT NULL", (request_id,)).fetchone()
    return None if row is None else str(row[0])


def _swept(dsn: str, request_id: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT swept_at IS NOT NULL FROM runs WHERE request_id = %s",
                           (request_id,)).fetchone()
    assert row is not None
    return bool(row[0])


@pytest.mark.parametrize("held", [True, False], ids=["held-at-enqueue", "all-in-the-broker"])
def test_a_limit_per_key_holds_across_three_workers_while_other_keys_run(
    fleet: Fleet, held: bool,
) -> None:
    # A limit of 5 per tenant on three worker processes of four slots each.
    # Set before alice sends her 25 requests, it withholds all but 5 of them
    # in the ledger at enqueue; set after, it finds all of them in the broker,
    # and the workers take up to twelve at once: each run takes a slot of her
    # limit in Postgres, and those beyond 5 park on whichever process took
    # them until a slot frees.
    def limit() -> None:
        assert cli(fleet, "limits", "concurrency", "per_key", "5").returncode == 0
        ledger.HOLD_LIMITS.forget()  # this process reads it before its next enqueue

    if held:
        limit()
    alice = [run_agent.delay(calls(f"alice{i}"), f"a{i}", user_id="alice").id for i in range(25)]
    bob = [run_agent.delay(calls(f"bob{i}"), f"b{i}", user_id="bob").id for i in range(3)]
    if not held:
        limit()
    # The three take the queue once all are up: a process started seconds
    # before the others (a loaded machine) would run her whole backlog.
    for name in ("w1", "w2", "w3"):
        fleet.start(name, concurrency=4, pool="threads", wait=False, **FAST,
                    TEST_TOOL_SLEEP="0.6", args=("-Q", f"{fleet.queue}-idle"))
    for name in ("w1", "w2", "w3"):
        fleet.wait_ready(name)
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM run_attempts").fetchone() == (0,)
    fleet.take_queue(("w1", "w2", "w3"))
    for request_id in alice + bob:
        run_agent.AsyncResult(request_id).get(timeout=90)
    assert _rows(fleet.dsn, alice + bob) == [("succeeded", 0, 0)] * 28
    # Twelve slots in the fleet, but never more than five of alice's runs at
    # once, and her limit reached.
    assert _most_at_once(_spans(fleet.dsn, "alice")) == 5, tool_executions(fleet.dsn)
    # Her runs were spread over the three processes.
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(DISTINCT worker) FROM run_attempts a JOIN runs r"
                           " USING (request_id) WHERE r.user_id = 'alice'").fetchone()
    assert row == (3,), row
    # Withheld, none of hers parked on a worker; all in the broker, the
    # workers parked those beyond her limit.
    parks = _parks(fleet, "limit per_key:alice")
    assert (parks == 0) if held else (parks > 0), parks
    # Bob is not queued behind her backlog: all of his ran before her last.
    last_alice = max(end for _, end in _spans(fleet.dsn, "alice"))
    assert all(end < last_alice for _, end in _spans(fleet.dsn, "bob"))
    listed = cli(fleet, "limits")
    assert listed.stdout.splitlines()[1].split()[:3] == ["per_key", "5", "0"], listed.stdout


def test_a_slot_freed_by_a_killed_worker_goes_to_a_parked_request(fleet: Fleet) -> None:
    # One run of alice's at a time. Her first request's worker is killed mid-
    # run: no run ends to hand its slot on. The sweeper sees the slot free and
    # publishes the parked request at once (within HANDOFF_GRACE), well before
    # the killed one is taken for dead (two heartbeats of 2 s) and resumed.
    # However slowly a busy machine runs the steps before the kill, the first
    # run is still in its tool then (its worker's tool calls take 30 s), and
    # the other worker is up (started before the kill, so its sweeper leads a
    # sweep right after it: the leader's lock goes with the killed worker's
    # connection).
    env = {**FAST, "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "2", "TEST_TOOL_SLEEP": "4",
           "LOOMFLOW_WORKER_LIMITS": json.dumps({"per_key": 1})}
    fleet.start("w1", concurrency=2, pool="threads", **{**env, "TEST_TOOL_SLEEP": "30"})
    first = run_agent.delay(calls("first"), "a0", user_id="alice")
    wait_until(lambda: any(tag == "first" for tag, *_ in tool_executions(fleet.dsn)),
               "the first request never ran its tool")
    second = run_agent.delay(calls("second"), "a1", user_id="alice")
    # Withheld at its enqueue: it waits in the ledger for her slot.
    assert _waiting(fleet.dsn, second.id) == "limit per_key:alice"
    listed = cli(fleet, "requests", "--user", "alice", "--status", "queued")
    header, row = listed.stdout.splitlines()[:2]
    assert cell(header, row, "WAITS") == "limit per_key:alice", listed
    # While the limit is full the sweeper leaves the parked request alone
    # (past its grace of 1 s, it would publish a parked request it thought lost).
    wait_sweeps_for(fleet, 1.5)
    assert _swept(fleet.dsn, second.id) is False
    fleet.start("w2", concurrency=2, pool="threads", **env)
    fleet.kill("w1")
    assert second.get(timeout=60)["output"] == "done: recorded second"
    assert first.get(timeout=60)["output"] == "done: recorded first"
    assert _swept(fleet.dsn, second.id) is True, fleet.log_text()
    assert _rows(fleet.dsn, [second.id]) == [("succeeded", 0, 0)]
    assert _rows(fleet.dsn, [first.id]) == [("succeeded", 0, 1)]  # its worker died
    # The killed run's tool ran until the kill; every finished one ran alone.
    assert _most_at_once(_spans(fleet.dsn, "")) == 1, tool_executions(fleet.dsn)


def test_bad_limits_are_refused_with_nothing_written(fleet: Fleet) -> None:
    for args, says in [(("per_key", "0"), "RUNS"), (("per_key",), "give RUNS"),
                       (("agent:" + "x" * 65, "3"), "at most 64 bytes"),
                       (("", "3"), "non-empty")]:
        refused = cli(fleet, "limits", "concurrency", *args)
        assert refused.returncode == 2 and says in refused.stderr, (args, refused)
    assert cli(fleet, "limits", "concurrency", "anthropic", "200").returncode == 0
    assert cli(fleet, "limits", "concurrency", "per_key", "5").returncode == 0
    rows = [json.loads(line) for line in cli(fleet, "limits", "--json").stdout.splitlines()]
    assert [(r["name"], r["max_runs"]) for r in rows if r["kind"] == "concurrency"] == [
        ("anthropic", 200), ("per_key", 5)]
    assert cli(fleet, "limits", "concurrency", "anthropic", "--none").returncode == 0
    unknown = cli(fleet, "limits", "concurrency", "anthropic", "--none")
    assert unknown.returncode != 0 and "no concurrency limit is named 'anthropic'" in \
        unknown.stderr, unknown
    rows = [json.loads(line) for line in cli(fleet, "limits", "--json").stdout.splitlines()]
    assert [r["name"] for r in rows if r["kind"] == "concurrency"] == ["per_key"]
    bad = cli(fleet, "worker", LOOMFLOW_WORKER_LIMITS='{"per_key": 0}')
    assert bad.returncode != 0 and "limit 'per_key'" in bad.stderr, bad


def test_a_tenants_backlog_waits_in_the_ledger_and_another_tenant_starts_at_once(
    fleet: Fleet,
) -> None:
    # Alice sends 60 requests at once, limited to 3 runs at a time: the rest
    # of her backlog is withheld in the ledger at enqueue, not queued in the
    # broker, so bob's one request, sent after all of hers, is taken next.
    env = {**FAST, "TEST_TOOL_SLEEP": "0.3", "LOOMFLOW_WORKER_LIMITS": json.dumps({"per_key": 3})}
    fleet.start("w1", concurrency=6, pool="threads", **env)
    alice = [run_agent.delay(calls(f"alice{i}"), f"a{i}", user_id="alice").id for i in range(60)]
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM runs WHERE request_id = ANY(%s)"
                           " AND waiting_slots IS NOT NULL", (alice,)).fetchone()
    assert row is not None and row[0] >= 50, row
    sent = time.monotonic()
    bob = run_agent.delay(calls("bob"), "b0", user_id="bob")
    assert bob.get(timeout=30)["output"] == "done: recorded bob"
    assert time.monotonic() - sent < 3.0
    for request_id in alice:
        run_agent.AsyncResult(request_id).get(timeout=120)
    assert _rows(fleet.dsn, alice) == [("succeeded", 0, 0)] * 60
    assert _most_at_once(_spans(fleet.dsn, "alice")) == 3


def test_requests_published_before_their_limit_was_set_park_on_the_worker(fleet: Fleet) -> None:
    # Sent while no limit was set, all six are in the broker; the limit is set
    # at run time, then a worker takes them: two run, four park, and each run
    # that ends hands its slot to the next.
    alice = [run_agent.delay(calls(f"alice{i}"), f"a{i}", user_id="alice").id for i in range(6)]
    assert cli(fleet, "limits", "concurrency", "per_key", "2").returncode == 0
    fleet.start("w1", concurrency=6, pool="threads", **FAST, TEST_TOOL_SLEEP="0.4")
    for request_id in alice:
        run_agent.AsyncResult(request_id).get(timeout=60)
    assert _rows(fleet.dsn, alice) == [("succeeded", 0, 0)] * 6
    assert _most_at_once(_spans(fleet.dsn, "alice")) == 2
    # Each of the four parked (one may park twice: the sweeper may publish one
    # too as a slot frees, and two then try for it).
    log = (fleet.logs / "w1.log").read_text()
    parked = {line.split("request ")[1].split()[0] for line in log.splitlines()
              if "parked: limit per_key:alice full" in line}
    assert len(parked) == 4, log


def test_a_chain_whose_head_is_held_back_at_enqueue_runs_to_its_end(fleet: Fleet) -> None:
    # The chain's head is alice's while her one slot is taken: withheld in the
    # ledger, it is published later with what its message would have carried
    # (the rest of the chain, and a callback), so the chain goes on after it.
    from celery import chain

    env = {**FAST, "TEST_TOOL_SLEEP": "0.5", "LOOMFLOW_WORKER_LIMITS": json.dumps({"per_key": 1})}
    fleet.start("w1", concurrency=4, pool="threads", **env)
    busy = run_agent.delay(calls("busy"), "a0", user_id="alice")
    wait_until(lambda: any(tag == "busy" for tag, *_ in tool_executions(fleet.dsn)),
               "alice's first request never ran its tool")
    head = run_agent.si(calls("A"), "a1", user_id="alice")
    head.link(run_agent.si(calls("linked"), "c1", user_id="carol"))
    flow = chain(head, run_agent.si(calls("B"), "b1", user_id="bob")).apply_async()
    assert flow.parent is not None
    assert _waiting(fleet.dsn, flow.parent.id) == "limit per_key:alice"
    assert flow.get(timeout=30)["output"] == "done: recorded B"
    assert busy.get(timeout=5)["output"] == "done: recorded busy"
    wait_until(lambda: any(tag == "linked" for tag, _, _, end in tool_executions(fleet.dsn)
                           if end is not None), "the head's callback never ran")
    tags = sorted(tag for tag, *_ in tool_executions(fleet.dsn))
    assert tags == ["A", "B", "busy", "linked"], tags


def test_a_fairness_key_given_per_call_decides_whose_limit_a_request_counts_toward(
    fleet: Fleet,
) -> None:
    # Three users of one tenant, "acme", named as the fairness key by the
    # message's header or by the keyword: one limit of 1 for all three.
    env = {**FAST, "TEST_TOOL_SLEEP": "0.4", "LOOMFLOW_WORKER_LIMITS": json.dumps({"per_key": 1})}
    fleet.start("w1", concurrency=3, pool="threads", **env)
    sent = [
        run_agent.apply_async((calls("acme0"), "s0"), {"user_id": "u0"},
                              headers={"fairness_key": "acme"}),
        run_agent.apply_async((calls("acme1"), "s1"), {"user_id": "u1"},
                              headers={"fairness_key": "acme"}),
        run_agent.apply_async((calls("acme2"), "s2"), {"user_id": "u2", "fairness_key": "acme"}),
    ]
    for result in sent:
        result.get(timeout=30)
    assert _most_at_once(_spans(fleet.dsn, "acme")) == 1
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        keys = conn.execute("SELECT DISTINCT fairness_key FROM runs").fetchall()
    assert keys == [("acme",)]
    for bad in ("k" * 65, "", 7):
        with pytest.raises(InvalidInput, match="fairness_key"):
            run_agent.apply_async((calls("x"), "s-bad"), {"fairness_key": bad})
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM runs").fetchone() == (3,)


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"], indirect=True)
def test_requests_waiting_on_a_limit_start_in_the_order_of_their_priority(
    fleet: Fleet, broker: str
) -> None:
    # Withheld behind alice's one running request, in the order 9, 0, 5:
    # they start as their broker would order them (Redis: 0 first; RabbitMQ:
    # the highest first), not in the order they came.
    env = {**FAST, "TEST_TOOL_SLEEP": "0.3", "LOOMFLOW_WORKER_LIMITS": json.dumps({"per_key": 1})}
    fleet.start("w1", concurrency=4, pool="threads", **env)
    busy = run_agent.delay(calls("busy"), "a0", user_id="alice")
    wait_until(lambda: any(tag == "busy" for tag, *_ in tool_executions(fleet.dsn)),
               "alice's first request never ran its tool")
    waiting = [run_agent.apply_async((calls(f"p{p}"), f"a-p{p}"), {"user_id": "alice"},
                                     priority=p) for p in (9, 0, 5)]
    for result in [busy, *waiting]:
        result.get(timeout=30)
    order = [tag for tag, _, started, _ in sorted(tool_executions(fleet.dsn),
                                                  key=lambda e: e[2]) if tag != "busy"]
    assert order == (["p0", "p5", "p9"] if broker == "redis" else ["p9", "p5", "p0"]), order



def _parks(fleet: Fleet, reason: str) -> int:
    """How many deliveries the fleet's workers parked on the limit ``reason`` names."""
    return sum(p.read_text(errors="replace").count(f"parked: {reason} full")
               for p in fleet.logs.glob("*.log"))


def test_a_burst_held_back_on_its_limit_sends_one_message_per_request(fleet: Fleet) -> None:
    # Alice sends 100 short requests at once, 3 runs at a time: 3 are
    # published at enqueue, the rest withheld in the ledger, and her first
    # runs end while she is still sending. Each withheld request is published once,
    # by the run that frees a slot (or the sweeper), and a request sent while
    # others are held waits behind them rather than taking the slot a run that
    # ends hands on: no delivery parks on the worker, which receives 100
    # messages.
    env = {**FAST, "TEST_TOOL_SLEEP": "0.1", "LOOMFLOW_WORKER_LIMITS": json.dumps({"per_key": 3})}
    fleet.start("w1", concurrency=6, pool="threads", **env)
    alice = [run_agent.delay(calls(f"alice{i}"), f"a{i}", user_id="alice").id for i in range(100)]
    for request_id in alice:
        run_agent.AsyncResult(request_id).get(timeout=120)
    assert _rows(fleet.dsn, alice) == [("succeeded", 0, 0)] * 100
    assert _most_at_once(_spans(fleet.dsn, "alice")) == 3
    received = sum(fleet.wait_deliveries(request_id, 1) for request_id in alice)
    assert (_parks(fleet, "limit per_key:alice"), received) == (0, 100)


def test_held_requests_are_not_published_for_slots_messages_are_on_their_way_to(
    fleet: Fleet,
) -> None:
    # Bob's three long runs take the worker's three slots; alice then sends 12
    # requests, 3 at a time: three are published at enqueue and wait behind
    # bob's, her three slots free all the while. The sweeper sees those slots
    # free for seconds, but counts the three messages on their way to them, and
    # publishes none of the nine held ones. When bob's runs end, hers run and
    # the rest follow one per slot: no delivery parks.
    env = {**FAST, "TEST_TOOL_SLEEP": "0.3", "LOOMFLOW_WORKER_LIMITS": json.dumps({"per_key": 3})}
    fleet.start("w1", concurrency=3, pool="threads", **env)
    bob = [run_agent.delay(calls(*(f"bob{i}-{j}" for j in range(25))), f"b{i}", user_id="bob").id
           for i in range(3)]
    wait_until(lambda: {tag.split("-")[0] for tag, *_ in tool_executions(fleet.dsn)}
               == {"bob0", "bob1", "bob2"}, "bob's runs never all started")
    alice = [run_agent.delay(calls(f"alice{i}"), f"a{i}", user_id="alice").id for i in range(12)]
    # Past her withheld requests' grace (1 s) and the sweeper's second look (1 s).
    wait_sweeps_for(fleet, 3.0)
    assert not any(tag.startswith("alice") for tag, *_ in tool_executions(fleet.dsn)), \
        "bob's runs ended before the sweeper had its chance"
    for request_id in alice + bob:
        run_agent.AsyncResult(request_id).get(timeout=120)
    assert _rows(fleet.dsn, alice + bob) == [("succeeded", 0, 0)] * 15
    received = sum(fleet.wait_deliveries(request_id, 1) for request_id in alice)
    assert (_parks(fleet, "limit per_key:alice"), received) == (0, 12)


#: Enqueues at once when a test sends thousands (the enqueue pool's connections).
ENQUEUERS = 4


@pytest.mark.parametrize("limits", [{"per_key": 10}, {"fair_queue": 10}],
                         ids=["per_key", "fair_queue"])
def test_a_tenant_with_one_request_starts_within_seconds_while_anothers_10000_drain(
    fleet: Fleet, limits: dict[str, int],
) -> None:
    # Alice sends 10,000 requests, then bob sends one: with either limit the
    # README recommends (per_key: 10 of alice's runs at most; fair_queue: 10
    # requests in the broker at most, started by fair shares, half the
    # worker's slots), her backlog waits in the ledger, not the broker, and
    # bob's request starts within seconds while thousands of hers still wait
    # (her runs take a second: at most 20 start a second). The test does not
    # wait for hers: the worker is killed and the database dropped at its end.
    for name, size in limits.items():
        assert cli(fleet, "limits", "concurrency", name, str(size)).returncode == 0
    ledger.HOLD_LIMITS.forget()  # this process reads the limits before its next enqueue
    fleet.start("w1", concurrency=20, pool="threads", TEST_TOOL_SLEEP="1",
                LOOMFLOW_WORKER_LIMITS=json.dumps(limits))
    began = time.monotonic()
    # Each enqueue is one ledger statement (a withheld request is not published):
    # a few at once, on the enqueue pool's connections.
    with concurrent.futures.ThreadPoolExecutor(ENQUEUERS) as enqueuers:
        list(enqueuers.map(
            lambda i: run_agent.delay(calls(f"alice{i}"), f"a{i}", user_id="alice").id,
            range(10_000)))
    enqueued = time.monotonic() - began
    bob = run_agent.delay(calls("bob"), "b0", user_id="bob")
    assert bob.get(timeout=60)["output"] == "done: recorded bob"
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM a.started_at - r.enqueued_at)::float8,"
            " (SELECT count(*) FROM runs o WHERE o.user_id = 'alice'"
            "   AND (o.started_at IS NULL OR o.started_at > a.started_at))"
            " FROM runs r JOIN run_attempts a USING (request_id)"
            " WHERE r.request_id = %s AND a.attempt = 1", (bob.id,)).fetchone()
    assert row is not None
    waited, alice_waiting = row
    print(f"enqueued 10,000 in {enqueued:.1f}s; bob started {waited:.2f}s after his enqueue,"
          f" with {alice_waiting} of alice's requests not started")
    assert waited < 5.0
    assert alice_waiting > 8_000
