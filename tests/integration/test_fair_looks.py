"""The fair look (``loomflow_worker_fair_next``) against a model of start-time
fair queueing written in Python, on random ledgers: keys with weights set or
stated, priorities, virtual times ahead of and behind the clock, requests
withheld between looks. The keys it weighs are those ``fairness_keys`` marks
as having requests withheld; a mark left by a request that ended otherwise is
dropped, and an enqueue that withholds a request while a look runs keeps its
key marked whichever of the two holds the key's row first."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from loomflow_worker.runtime.prune import Pruner
from loomflow_worker.runtime.sql import query

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass
class Model:
    """What a look should send and write, computed from the ledger's rules."""

    #: request id -> (key, priority rank, enqueued at), while withheld.
    withheld: dict[str, tuple[str, int, datetime]] = field(default_factory=dict)
    vtime: dict[str, float] = field(default_factory=dict)
    weight: dict[str, float] = field(default_factory=dict)
    clock: float = 0.0

    def look(self, room: int) -> list[str]:
        keys = {key for key, _, _ in self.withheld.values()}
        start = {k: max(self.vtime.get(k, 0.0), self.clock) for k in keys}
        mine = {k: sorted((rank, at, rid) for rid, (key, rank, at) in self.withheld.items()
                          if key == k) for k in keys}
        firsts = sorted(keys, key=lambda k: (start[k] + 1 / self.weight.get(k, 1.0),
                                             mine[k][0][1], k))[:room]
        tagged = [(start[k] + (i + 1) / self.weight.get(k, 1.0), at, rid, k)
                  for k in firsts for i, (_, at, rid) in enumerate(mine[k][:room])]
        chosen = sorted(tagged)[:room]
        moved: dict[str, float] = {}
        for tag, _, rid, k in chosen:
            moved[k] = max(moved.get(k, tag), tag)
            del self.withheld[rid]
        self.vtime.update(moved)
        after = {**start, **moved}
        if after:
            self.clock = max(self.clock, min(after.values()))
        return sorted(rid for _, _, rid, _ in chosen)


def _hold(conn: psycopg.Connection[Any], rid: str, key: str, rank: int, at: datetime) -> None:
    conn.execute(
        "INSERT INTO runs (request_id, scope, session_id, agent, prompt, status, fairness_key,"
        " waiting_for, waiting_slots, dispatched_at, received_at, enqueued_at, priority_rank)"
        " VALUES (%s, %s, %s, 'a', 'p', 'queued', %s, 'limit fair_queue', '{}', now(), now(),"
        " %s, %s)", (rid, f"s-{rid}", f"s-{rid}", key, at, rank))


def _look(conn: psycopg.Connection[Any], page: int) -> list[str]:
    return sorted(r[0] for r in conn.execute(query("fair_next"), {"wait": True, "page": page}))


def _no_limit(conn: psycopg.Connection[Any]) -> None:
    """fair_queue 0: a look's room is its page, whatever the broker holds."""
    conn.execute("INSERT INTO concurrency_limits (name, max_runs) VALUES ('fair_queue', 0)"
                 " ON CONFLICT (name) DO UPDATE SET max_runs = 0")


def test_looks_send_what_start_time_fair_queueing_sends_on_random_ledgers(dsn: str) -> None:
    """40 random ledgers, a dozen looks each with requests withheld between
    them: every look sends the requests the model sends, and the keys'
    virtual times and the clock end where the model's do."""
    rng = random.Random(20261207)
    with psycopg.connect(dsn, autocommit=True) as conn:
        _no_limit(conn)
        for trial in range(40):
            _trial(conn, rng, trial, prune=False)


def test_a_prune_deletes_only_keys_a_look_takes_for_new_ones(dsn: str) -> None:
    """The same random ledgers, with a prune of the fairness keys at rest
    before most looks (in batches of 3, as the sweeper's go): each look still
    sends what the model, which never forgets a key, sends; every key the
    prune deleted was at rest by the model's reckoning, and it deleted some."""
    rng = random.Random(20261208)
    pruned = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        _no_limit(conn)
        for trial in range(40):
            pruned += _trial(conn, rng, trial, prune=True)
    assert pruned > 20, pruned


def _trial(conn: psycopg.Connection[Any], rng: random.Random, trial: int, prune: bool) -> int:
    """One random ledger and its looks against the model; with ``prune``, the
    keys at rest pruned before most looks. Returns how many keys went."""
    conn.execute("DELETE FROM runs; DELETE FROM fairness_keys; DELETE FROM fair_clock")
    model = Model(clock=rng.choice([0.0, 0.5, 2.0]))
    conn.execute("INSERT INTO fair_clock (id, vtime) VALUES (1, %s)", (model.clock,))
    keys = [f"k{trial}-{i:02d}" for i in range(rng.randint(2, 12))]
    stated: set[str] = set()
    for key in keys:
        weight = rng.choice([None, None, 0.5, 2.0, 3.0])
        call_weight = rng.choice([None, None, 4.0])
        vtime = rng.choice([0.0, 0.0, 1.0, 2.5, 4.0])
        # A weight removed by command (none, which holds over the settings').
        source = "command" if weight is None and prune and rng.random() < 0.2 else None
        if weight is None and call_weight is None and source is None and vtime == 0.0:
            continue
        conn.execute("INSERT INTO fairness_keys (fairness_key, weight, call_weight,"
                     " weight_source, vtime) VALUES (%s, %s, %s, %s, %s)",
                     (key, weight, call_weight, source, vtime))
        model.vtime[key] = vtime
        model.weight[key] = weight or call_weight or 1.0
        if weight is not None or call_weight is not None or source is not None:
            stated.add(key)
    seconds = pruned = 0
    for look in range(12):
        for _ in range(rng.choice([0, 0, 3, 8, 20])):
            seconds += 1
            rid, key = f"r{trial}-{seconds}", rng.choice(keys)
            rank, at = rng.choice([-1, 0, 0, 1]), T0 + timedelta(seconds=seconds)
            _hold(conn, rid, key, rank, at)
            model.withheld[rid] = (key, rank, at)
        if prune and rng.random() < 0.7:
            pruned += _prune_at_rest(conn, model, stated, (trial, look))
        page = rng.randint(1, 9)
        assert _look(conn, page) == model.look(page), (trial, look)
    times = dict(conn.execute("SELECT fairness_key, vtime FROM fairness_keys"
                              " WHERE vtime <> 0").fetchall())
    # A key pruned is one the model has at rest: at or behind the clock.
    assert all(model.vtime[k] == v for k, v in times.items()), trial
    assert all(k in times or v == 0 or (prune and v <= model.clock and k not in stated)
               for k, v in model.vtime.items()), (trial, times, model.vtime)
    kept = {r[0] for r in conn.execute("SELECT fairness_key FROM fairness_keys")}
    assert stated <= kept, (trial, stated - kept)
    clock = conn.execute("SELECT vtime FROM fair_clock").fetchone()
    assert clock is not None and clock[0] == model.clock, trial
    return pruned


def _prune_at_rest(conn: psycopg.Connection[Any], model: Model, stated: set[str],
                   where: object) -> int:
    """Prune (every table, in batches of 3); the keys it deleted, each at rest
    by the model's reckoning: none withheld, no weight set, removed or stated,
    not ahead of the clock."""
    before = {r[0] for r in conn.execute("SELECT fairness_key FROM fairness_keys")}
    totals = Pruner(None, batch_size=3).run(conn)
    gone = before - {r[0] for r in conn.execute("SELECT fairness_key FROM fairness_keys")}
    waiting = {key for key, _, _ in model.withheld.values()}
    assert totals["fairness_keys"] == len(gone), (where, totals, gone)
    assert all(k not in waiting and k not in stated and model.vtime.get(k, 0.0) <= model.clock
               for k in gone), (where, gone, model.vtime, model.clock)
    return len(gone)


def _cancel(conn: psycopg.Connection[Any], *ids: str) -> None:
    conn.execute("UPDATE runs SET status = 'cancelled', finished_at = now()"
                 " WHERE request_id = ANY(%s)", (list(ids),))


def test_marks_left_by_requests_that_ended_otherwise_change_nothing_a_look_sends(
        dsn: str) -> None:
    """Withheld requests cancelled leave their keys' marks behind. A look still
    sends what it would without them: past 100 dead marks at a room of one; a
    key whose oldest request went is weighed by its next one; a dead mark of a
    light key does not hold the clock back (each look here as the model's)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        _no_limit(conn)
        for i in range(100):
            _hold(conn, f"dead-{i}", f"dead-{i:03d}", 0, T0 + timedelta(seconds=i))
        _cancel(conn, *[f"dead-{i}" for i in range(100)])
        _hold(conn, "alice-0", "alice", 0, T0 + timedelta(days=1))
        assert _look(conn, 1) == ["alice-0"]
        assert conn.execute("SELECT count(*) FROM fairness_keys"
                            " WHERE withheld_at IS NOT NULL").fetchone() == (0,)
        # x's oldest went; y's is older than x's next: y goes first.
        _hold(conn, "x-0", "x", 0, T0 + timedelta(days=2))
        _hold(conn, "x-1", "x", 0, T0 + timedelta(days=2, seconds=10))
        _hold(conn, "y-0", "y", 0, T0 + timedelta(days=2, seconds=5))
        _cancel(conn, "x-0")
        assert _look(conn, 1) == ["y-0"]
        assert _look(conn, 1) == ["x-1"]
        # A light key's one request cancelled: the clock moves as a and b send.
        conn.execute("DELETE FROM fair_clock; DELETE FROM fairness_keys")
        conn.execute("INSERT INTO fairness_keys (fairness_key, weight) VALUES ('s', 0.1)")
        _hold(conn, "s-0", "s", 0, T0 + timedelta(days=3))
        _cancel(conn, "s-0")
        for i in range(4):
            _hold(conn, f"a-{i}", "a", 0, T0 + timedelta(days=3, seconds=1 + 2 * i))
            _hold(conn, f"b-{i}", "b", 0, T0 + timedelta(days=3, seconds=2 + 2 * i))
        assert [_look(conn, 1) for _ in range(4)] == [["a-0"], ["b-0"], ["a-1"], ["b-1"]]
        clock = conn.execute("SELECT vtime FROM fair_clock").fetchone()
        assert clock == (2.0,)


def _mark(dsn: str, key: str) -> Any:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT withheld_at FROM fairness_keys WHERE fairness_key = %s",
                           (key,)).fetchone()
        return row[0] if row else None


def test_an_enqueue_during_a_look_keeps_its_key_marked_whichever_holds_the_key_first(
        dsn: str) -> None:
    """A look sends tenant a's last withheld request while an enqueue withholds
    another of a's. Look first: the enqueue waits for the look's end and marks
    a again, and the next look sends it. Enqueue first: the look waits for the
    enqueue's end on a's row and sends both."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        _no_limit(conn)
        _hold(conn, "a-0", "a", 0, T0)
    looker, enqueuer = psycopg.connect(dsn), psycopg.connect(dsn)
    try:
        # Look first.
        assert _look(looker, 5) == ["a-0"]  # its transaction still open
        thread = threading.Thread(target=lambda: (
            _hold(enqueuer, "a-1", "a", 0, T0 + timedelta(seconds=1)), enqueuer.commit()))
        thread.start()
        time.sleep(0.3)
        assert thread.is_alive(), "the enqueue did not wait for the look"
        looker.commit()
        thread.join(10)
        assert _mark(dsn, "a") is not None
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert _look(conn, 5) == ["a-1"]
            _hold(conn, "a-2", "a", 0, T0 + timedelta(seconds=2))
        # Enqueue first.
        _hold(enqueuer, "a-3", "a", 0, T0 + timedelta(seconds=3))  # not committed
        sent: list[str] = []
        thread = threading.Thread(target=lambda: (sent.extend(_look(looker, 5)),
                                                  looker.commit()))
        thread.start()
        time.sleep(0.3)
        assert thread.is_alive(), "the look did not wait for the enqueue"
        enqueuer.commit()
        thread.join(10)
        assert sent == ["a-2", "a-3"]
    finally:
        looker.close()
        enqueuer.close()


def test_a_worker_look_offers_its_free_slots_as_they_are_not_as_its_last_stamp(dsn: str) -> None:
    """No fair_queue limit: what may wait in the broker is the fleet's free
    slots as the rows say them (at least the floor, 32). A worker's row
    stamped full offers the floor only; the same worker's look, saying it
    carries no run now, writes that in its row first and offers its 64 free
    slots, less the 32 already on their way. A look saying it takes no new
    requests (admission paused it) writes that too, and then its slots are not
    offered, until a look says it takes them again. With nothing withheld a
    look writes nothing."""
    from dataclasses import asdict

    from loomflow_worker.execution.ledger import WorkerBeat

    beat = WorkerBeat(worker="w-a", hostname="h", pid=1, slots=64, interval=10.0, runs=64)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(query("worker_seen"), asdict(beat))
        for i in range(200):
            _hold(conn, f"r{i:03d}", "k", 0, T0 + timedelta(seconds=i))

        def look(runs: int, admitting: bool = True) -> int:
            return len(conn.execute(query("fair_next_stamped"), {
                "wait": True, "page": 500, "worker": "w-a", "runs": runs,
                "admitting": admitting}).fetchall())

        def row() -> tuple[int, bool]:
            found = conn.execute("SELECT runs, admitting FROM workers WHERE worker = 'w-a'"
                                 ).fetchone()
            assert found is not None
            return int(found[0]), bool(found[1])

        def received() -> None:
            """The requests on their way started: none waits in the broker."""
            conn.execute("UPDATE runs SET status = 'running', received_at = now()"
                         " WHERE status = 'queued' AND waiting_for IS NULL")

        assert look(64) == 32 and row() == (64, True)
        assert look(64) == 0  # the floor's 32 still on their way
        assert look(0) == 32 and row() == (0, True)  # 64 free, 32 on their way
        received()
        assert look(0, admitting=False) == 32 and row() == (0, False)  # the floor only
        received()
        assert look(0) == 64 and row() == (0, True)
        conn.execute("DELETE FROM runs WHERE waiting_for = 'limit fair_queue'")
        assert look(7, admitting=False) == 0 and row() == (0, True)
