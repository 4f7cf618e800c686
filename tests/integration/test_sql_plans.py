"""The queries that ask ``loomflow_worker_unfinished(status)`` still use the
partial index of unfinished requests (``runs_scope_open``, whose predicate is
the literal list): the planner inlines the function. On a ledger of many
finished requests, a plan without the index would scan them all."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import psycopg
import pytest

from loomflow_worker.execution.ledger import EnqueuePool
from loomflow_worker.execution.request import RunRequest
from loomflow_worker.runtime.keys import scope_lock_key
from loomflow_worker.runtime.sql import query
from loomflow_worker.runtime.store import open_pool
from loomflow_worker.settings import Settings
from loomflow_worker.sweeper.leader import Sweeper

PARAMS: dict[str, Any] = {
    "scope": "scope-7", "request_id": "r-7", "stale": 5, "key": 1, "may_lock": False,
    "worker": "h", "pid": 1, "boot": "b", "attempt": 1, "new_epoch": 2, "epoch_value": b"LJ12",
    "status": "succeeded", "result": None, "error": None, "error_type": None,
    "before": 0.0, "cutoff": None, "batch": 1000, "isolation": 0,
    "kind": "run", "session_id": "scope-7", "user_id": None, "agent": "a",
    "prompt_sha256": b"", "lease": 30.0, "interval": 2.0, "version": None,
    "metadata": "{}",
}

HOT = ["scope_busy", "hand_off", "precheck_run", "start_request", "finish_request",
       "prune_steps", "prune_counts"]


@pytest.fixture
def big_ledger(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO journal_steps (session_id, step_name, value, created_at)"
            " SELECT 'scope-' || i, 'k', 'LJ11'::bytea, 0 FROM generate_series(1, 2000) AS i"
        )
        conn.execute(
            "INSERT INTO runs (request_id, scope, session_id, agent, prompt, status,"
            " finished_at)"
            " SELECT 'r-' || i, 'scope-' || (i % 2000), 'scope-' || (i % 2000), 'a', 'p',"
            " CASE WHEN i % 500 = 0 THEN 'queued' ELSE 'succeeded' END,"
            " CASE WHEN i % 500 = 0 THEN NULL ELSE now() END"
            " FROM generate_series(1, 40000) AS i"
        )
        conn.execute("ANALYZE runs")
        conn.execute("ANALYZE journal_steps")
    return dsn


@pytest.mark.parametrize("name", HOT)
def test_a_hot_query_finds_unfinished_requests_through_the_partial_index(
    big_ledger: str, name: str
) -> None:
    with psycopg.connect(big_ledger, autocommit=True) as conn:
        plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + query(name), PARAMS))
    assert "runs_scope_open" in plan, plan


#: The named parts (migration 0042) each long statement is composed of.
PARTS = {"orphans": ["loomflow_worker_in_broker", "loomflow_worker_held",
                     "loomflow_worker_scope_heads", "loomflow_worker_advisory_locks"],
         "start_request": ["loomflow_worker_open_attempt", "loomflow_worker_scope_epochs"]}
SWEEP = {"after": 60.0, "queued_after": 10.0, "queues": ["celery"], "waiting": [3],
         "default_queue": "celery", "held_within": 20.0, "dead_after": 30.0, "limit": 100}


@pytest.mark.parametrize("name", sorted(PARTS))
def test_a_long_statements_named_parts_are_inlined(big_ledger: str, name: str) -> None:
    """The views and functions a long statement is composed of are planned as
    if spelt out: none is called (a strict or volatile function would be: a
    scan of its whole result, or a call per row), and its unfinished requests
    are read through an index."""
    assert all(part in query(name) for part in PARTS[name])
    with psycopg.connect(big_ledger, autocommit=True) as conn:
        plan = "\n".join(r[0] for r in conn.execute(
            "EXPLAIN " + query(name), {**PARAMS, **SWEEP}))
    called = [part for part in PARTS[name]
              if f"Function Scan on {part}" in plan or f"{part}(" in plan]
    assert called == [], plan
    assert "runs_scope_open" in plan or "runs_status_seq" in plan, plan


def test_a_recheck_walks_the_finished_requests_in_their_index(big_ledger: str) -> None:
    """A re-check of the result backend reads the finished requests a batch at
    a time in the order they ended, each batch from the index (``runs_finished``),
    not by sorting the ledger."""
    params = {"at": datetime.now(UTC) - timedelta(days=1), "seq": -1, "until": None,
              "limit": 200}
    with psycopg.connect(big_ledger, autocommit=True) as conn:
        plan = "\n".join(r[0] for r in conn.execute(
            "EXPLAIN " + query("results_to_recheck"), params))
        rows = conn.execute(query("results_to_recheck"), params).fetchall()
        after = conn.execute(query("results_to_recheck"), {
            **params, "at": rows[-1][1], "seq": rows[-1][2]}).fetchall()
    assert "runs_finished" in plan and "Sort" not in plan, plan
    assert len(rows) == len(after) == 200
    assert not {r[0] for r in rows} & {r[0] for r in after}


def test_every_way_a_request_ends_queues_one_result_check(dsn: str) -> None:
    """A request that ends (finished by its worker, cancelled while queued, or
    recorded already failed) gets one row in ``results_to_check``; its start
    and heartbeats get none; the sweeper's mark removes the checked rows."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        def waiting() -> list[str]:
            rows = conn.execute("SELECT request_id FROM results_to_check ORDER BY 1")
            return [r[0] for r in rows]

        for rid in ("a", "b"):
            conn.execute("INSERT INTO runs (request_id, scope, session_id, agent, prompt)"
                         " VALUES (%s, 's', 's', 'x', 'p')", (rid,))
        conn.execute("INSERT INTO runs (request_id, scope, session_id, agent, prompt, status,"
                     " finished_at) VALUES ('c', 's', 's', 'x', 'p', 'failed', now())")
        conn.execute("UPDATE runs SET status = 'running' WHERE request_id = 'a'")
        conn.execute("UPDATE runs SET heartbeat_at = now() WHERE request_id = 'a'")
        assert waiting() == ["c"]
        conn.execute("UPDATE runs SET status = 'succeeded', finished_at = now()"
                     " WHERE request_id = 'a'")
        conn.execute("UPDATE runs SET status = 'cancelled', finished_at = now()"
                     " WHERE request_id = 'b'")
        conn.execute("UPDATE runs SET result_stored = false WHERE request_id = 'a'")
        assert waiting() == ["a", "b", "c"]
        unchecked = conn.execute(query("unchecked_results"),
                                 {"after": -1, "alive_after": -1, "within": 3600,
                                  "limit": 10}).fetchall()
        assert sorted(r[0] for r in unchecked) == ["a", "b", "c"]
        outcomes = conn.execute(query("request_outcomes"),
                                {"request_ids": ["a", "b", "gone"]}).fetchall()
        assert sorted((r[0], r[1]) for r in outcomes) == [("a", "succeeded"), ("b", "cancelled")]
        conn.execute(query("mark_result_checked"), {"request_ids": ["a", "c"], "within": 3600})
        assert waiting() == ["b"]


def test_a_result_nobody_wants_or_its_worker_stored_is_never_checked(dsn: str) -> None:
    """A request enqueued with ``ignore_result`` never enters ``results_to_check``
    (nor ``result_stored = false``); a worker's stamp takes off the results it
    stored since its last one."""
    beat = {"worker": "w:1", "hostname": "w", "pid": 1, "slots": 1, "interval": 2.0, "runs": 0,
            "loop_lag": 0.0, "lock_queue": 0, "admitting": True, "boot": "b1"}
    with psycopg.connect(dsn, autocommit=True) as conn:
        def waiting() -> list[str]:
            rows = conn.execute("SELECT request_id FROM results_to_check ORDER BY 1")
            return [r[0] for r in rows]

        for rid, ignored in (("kept", False), ("ignored", True), ("stored", False)):
            conn.execute("INSERT INTO runs (request_id, scope, session_id, agent, prompt,"
                         " ignore_result) VALUES (%s, 's', 's', 'x', 'p', %s)", (rid, ignored))
        conn.execute("UPDATE runs SET status = 'succeeded', finished_at = now()")
        assert waiting() == ["kept", "stored"]
        conn.execute(query("mark_result_unstored"), {"request_id": "ignored"})
        assert conn.execute(query("unstored_results"), {"limit": 10}).fetchall() == []
        conn.execute(query("worker_seen"), {**beat, "stored": ["stored", "gone"]})
        assert waiting() == ["kept"]
        conn.execute(query("worker_stopped"), {"worker": "w:1", "stored": ["kept"]})
        assert waiting() == []


def test_the_next_orphan_is_due_when_its_lease_runs_out(dsn: str) -> None:
    """``next_orphan`` says in how long the next running request whose lock
    nobody holds (its worker just died) is an orphan, so the leader sweeps
    then; a request whose lock is held, or already an orphan, does not count."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        def due() -> float | None:
            row = conn.execute(query("next_orphan"), {"dead_after": 4.0}).fetchone()
            assert row is not None
            return None if row[0] is None else float(row[0])

        assert due() is None
        for rid, key, beat in (("dead", 71, 1.0), ("older", 72, 9.0), ("held", 73, 3.0)):
            conn.execute("INSERT INTO runs (request_id, scope, session_id, agent, prompt,"
                         " status, lock_key, heartbeat_at) VALUES (%s, %s, %s, 'a', 'p',"
                         " 'running', %s, now() - make_interval(secs => %s))",
                         (rid, rid, rid, key, beat))
        conn.execute("SELECT pg_advisory_lock(73)")
        found = due()
        assert found is not None and 2.9 < found <= 3.0, found
        conn.execute("SELECT pg_advisory_unlock(73)")
        found = due()
        assert found is not None and 0.9 < found <= 1.0, found


def test_a_keys_held_requests_are_read_in_their_index_whatever_their_number(dsn: str) -> None:
    """An enqueue under the per_key limit asks whether its fairness key has
    requests withheld, and a run that frees a slot takes the first of them:
    each reads runs_waiting_for in its order, whatever the key's backlog, not a
    bitmap of all of them (10,000 enqueues would be quadratic)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO runs (request_id, scope, session_id, user_id, agent, prompt,"
            " fairness_key, waiting_for, waiting_slots, received_at)"
            " SELECT 'h-' || i, 'h-' || i, 'h-' || i, 'alice', 'a', 'p', 'alice',"
            " 'limit per_key:alice', '{1,2}', now() FROM generate_series(1, 5000) AS i")
        plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + query("insert_run"), {
            **PARAMS, "request_id": "new", "scope": "new", "session_id": "new",
            "user_id": "alice", "fairness_key": "alice", "prompt": "p", "metadata": "{}",
            "lock_key": 9, "countdown": None, "eta": None, "ignore_result": False,
            "routing": None, "options": "{}", "priority_rank": 0, "hold_after": 10,
            "slots": [1, 2], "fair_depth": None}))
        assert "runs_waiting_for" in plan and "BitmapAnd" not in plan, plan
        # The enqueue pool plans it once, for any values (see generic_plans).
        plan = _generic_plan(conn, "insert_run")
        assert "runs_waiting_for" in plan and "BitmapAnd" not in plan, plan
        assert "Seq Scan on runs" not in plan, plan
        plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + query("next_on_limit"), {
            "reason": "limit per_key:alice", "count": 1}))
        assert "runs_waiting_for" in plan and "BitmapAnd" not in plan, plan
        assert "Sort" not in plan, plan


def _generic_plan(conn: psycopg.Connection[Any], name: str) -> str:
    """The plan Postgres makes of the query ``name`` for any values of its
    parameters, as a connection that says ``generic_plans`` uses it."""
    params: list[str] = []

    def numbered(found: re.Match[str]) -> str:
        if found[1] not in params:
            params.append(found[1])
        return f"${params.index(found[1]) + 1}"

    text = re.sub(r"%\((\w+)\)s", numbered, query(name)).replace("%%", "%")
    conn.execute(query("generic_plans"))
    conn.execute(f"PREPARE generic AS {text}")  # type: ignore[arg-type]
    try:
        nulls = ", ".join("NULL" for _ in params)
        return "\n".join(r[0] for r in conn.execute(
            f"EXPLAIN EXECUTE generic({nulls})"))  # type: ignore[arg-type]
    finally:
        conn.execute("DEALLOCATE generic")
        conn.execute("RESET plan_cache_mode")


def test_an_enqueue_plans_its_insert_once_not_at_every_call(dsn: str) -> None:
    """insert_run's checks of the per_key and fair_queue limits, skipped by
    their parameters at run time, count in the cost of a plan for any values:
    left to choose, Postgres planned it again at every enqueue (0.76 ms of its
    CPU, against 0.17 ms to run it). The enqueue pool's connections plan their
    prepared statements once."""
    enqueue = EnqueuePool()
    try:
        for i in range(12):
            req = RunRequest(prompt="p", session_id=f"s-{i}", user_id="alice", agent="a",
                             metadata={})
            # Options given: the fair_queue check is part of the statement.
            enqueue.insert(dsn, 5, f"r-{i}", req, options={})
        with enqueue.connection(dsn, 5) as conn:
            rows = conn.execute(
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
                " WHERE statement LIKE '%%INSERT INTO runs%%'").fetchall()
    finally:
        enqueue.close()
    assert len(rows) == 1, rows  # one connection, the insert prepared on it
    generic, custom = rows[0]
    assert generic >= 6 and custom == 0, rows


def test_a_signals_sender_finds_the_requests_parked_for_it_in_their_index(
    big_ledger: str,
) -> None:
    with psycopg.connect(big_ledger, autocommit=True) as conn:
        plan = "\n".join(r[0] for r in conn.execute(
            "EXPLAIN " + query("signal_waiters"), {"session_id": "box", "name": "go"}))
    assert "runs_signal_waiting" in plan, plan


def test_a_request_parked_for_a_signal_is_published_once_by_its_sender_or_the_sweeper(
    dsn: str,
) -> None:
    """A request parked waiting for a signal is claimed (marked by
    ``mark_swept``) by the signal's sender or by the sweeper, whichever comes
    first; the other finds it taken and publishes nothing. The sweeper takes
    it again only ``again_after`` seconds later (its message may be lost)."""
    from loomflow_worker.execution import signal_waits
    from loomflow_worker.sweeper import ledger_recovery as recovery

    def orphans() -> list[str]:
        found = recovery.orphans(conn, waiting={}, default_queue="q", after=60, queued_after=60,
                                 held_within=60, dead_after=60, limit=10)
        return [pending.request_id for pending, _ in found]

    with psycopg.connect(dsn, autocommit=True) as conn:
        for rid, key in (("by-sender", 81), ("by-sweeper", 82)):
            conn.execute(
                "INSERT INTO runs (request_id, scope, session_id, user_id, agent, prompt, lock_key,"
                " dispatched_at, received_at, waiting_signal, waiting_signal_session,"
                " waiting_for)"
                " VALUES (%s, %s, %s, 'alice', 'a', 'p', %s, now() - interval '1 hour', now(),"
                " 'go', %s, 'waiting for signal')", (rid, rid, rid, key, f"box-{rid}"))
        assert signal_waits.claim(conn, "box-by-sender", "go") == []
        assert orphans() == []
        # Bob's signal is not for alice's run; one to no user is.
        for user in ("bob", None):
            for box in ("box-by-sender", "box-by-sweeper"):
                conn.execute("INSERT INTO signals (session_id, user_id, name, payload)"
                             " VALUES (%s, %s, 'go', 'x')", (box, user))
            if user == "bob":
                assert signal_waits.claim(conn, "box-by-sender", "go") == []
        assert sorted(orphans()) == ["by-sender", "by-sweeper"]

        # The sender first: the sweeper, which saw it an instant before, marks nothing.
        claimed = signal_waits.claim(conn, "box-by-sender", "go")
        assert [pending.request_id for pending in claimed] == ["by-sender"]
        assert signal_waits.claim(conn, "box-by-sender", "go") == []
        assert recovery.mark_swept(conn, ["by-sender"], 60) == set()
        # The sweeper first: the sender marks nothing.
        assert recovery.mark_swept(conn, ["by-sweeper"], 60) == {"by-sweeper"}
        assert signal_waits.claim(conn, "box-by-sweeper", "go") == []
        assert orphans() == []
        # A message lost since: the sweeper publishes it again after again_after.
        assert recovery.mark_swept(conn, ["by-sender", "by-sweeper"], 0) == {
            "by-sender", "by-sweeper"}


def test_a_start_reads_a_few_pages_whatever_the_size_of_the_ledger(big_ledger: str) -> None:
    """The start of a request that is its scope's first (every request of a
    service that makes a session per request) reads the pages of its own rows,
    not the ledger's: looking for the request before it on its scope went
    through runs_session, not back along every older request's seq."""
    with psycopg.connect(big_ledger) as conn:
        conn.execute("INSERT INTO runs (request_id, scope, session_id, agent, prompt)"
                     " VALUES ('fresh', 'fresh-scope', 'fresh-scope', 'a', 'p')")
        row = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query("start_request"),
                           {**PARAMS, "request_id": "fresh", "scope": "fresh-scope"}).fetchone()
        conn.rollback()
    assert row is not None
    top = row[0][0]["Plan"]
    pages = top["Shared Hit Blocks"] + top["Shared Read Blocks"]
    assert pages < 200, f"{pages} pages read by a start, in a ledger of 40,000 requests"


def _plans_with_jit(conn: psycopg.Connection[Any]) -> bool:
    """Whether the sweeper's ``orphans`` is compiled by JIT on ``conn``."""
    params = {"after": 60, "queued_after": 5, "queues": ["celery"], "waiting": [2000],
              "default_queue": "celery", "held_within": 4, "dead_after": 4, "limit": 500}
    row = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + query("orphans"), params).fetchone()
    assert row is not None
    return "JIT" in row[0][0]


def test_the_sweeper_and_the_worker_pool_compile_no_statement(dsn: str) -> None:
    """With a backlog (3,000 unfinished requests), the estimated cost of
    ``orphans`` passes Postgres' jit_above_cost: compiled at each sweep, it
    cost seconds of CPU for a statement that runs in milliseconds. The
    sweeper's connection and the worker's pool turn JIT off."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO runs (request_id, scope, session_id, agent, prompt, lock_key, status,"
            " dispatched_at, started_at, heartbeat_at)"
            " SELECT 'r-' || i, 's-' || i, 's-' || i, 'a', 'p', i,"
            " CASE WHEN i <= 1000 THEN 'running' ELSE 'queued' END, now(),"
            " CASE WHEN i <= 1000 THEN now() END, CASE WHEN i <= 1000 THEN now() END"
            " FROM generate_series(1, 3000) AS i")
        conn.execute("ANALYZE runs")
        available = conn.execute("SELECT pg_jit_available()").fetchone()
        if available is not None and available[0]:
            assert _plans_with_jit(conn), "a plain connection compiles orphans (the control)"
    sweeper = Sweeper(Settings(database_url=dsn), lambda _: None)  # type: ignore[arg-type]
    with sweeper._connect() as conn:
        assert not _plans_with_jit(conn)

    async def pool_jit() -> str:
        pool = await open_pool(dsn, min_size=1, max_size=1, connect_timeout=5)
        try:
            async with pool.connection() as conn:
                cur = await conn.execute("SHOW jit")
                row = await cur.fetchone()
                return str(row[0]) if row else "?"
        finally:
            await pool.close()

    assert anyio.run(pool_jit) == "off"


def test_a_fair_look_writes_the_times_of_the_keys_that_sent_only(dsn: str) -> None:
    """With 500 tenants waiting their fair turn, a look that publishes 32 of
    their requests writes the virtual times of those 32 keys, not of the 500
    (3,000 upserts a look at 3,000 tenants); the next look picks the others."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO runs (request_id, scope, session_id, agent, prompt, status,"
            " fairness_key, waiting_for, dispatched_at, received_at)"
            " SELECT 'r-' || i, 's-' || i, 's-' || i, 'a', 'p', 'queued', 'k-' || i,"
            " 'limit fair_queue', now(), now() FROM generate_series(1, 500) AS i")
        sent: list[str] = []
        for _ in range(2):
            sent += [r[0] for r in conn.execute(query("fair_next"), {"wait": True, "page": 32})]
            keys = conn.execute("SELECT count(*) FROM fairness_keys WHERE vtime <> 0").fetchone()
            assert keys is not None and keys[0] == len(sent), (keys, len(sent))
            # The workers took them and they ended: room for the next look.
            conn.execute("UPDATE runs SET status = 'succeeded', finished_at = now()"
                         " WHERE request_id = ANY(%s)", (sent,))
    assert len(sent) == len(set(sent)) == 64


def _loops(plan: dict[str, Any]) -> Iterator[tuple[str, int]]:
    """Each scan of the lock table or of a CTE in ``plan``, with how many times it ran."""
    name = plan.get("Function Name") if plan["Node Type"] == "Function Scan" else (
        plan.get("CTE Name") if plan["Node Type"] == "CTE Scan" else None)
    if name is not None:
        yield str(name), int(plan.get("Actual Loops", 0))
    for child in plan.get("Plans", []):
        yield from _loops(child)


def test_the_orphans_look_reads_the_locks_and_each_part_once(dsn: str) -> None:
    """With a backlog (1,000 running requests holding their locks, 2,000
    queued) that the ledger's statistics lag behind, ``orphans`` reads the lock
    table once and each of its parts once: planned as a loop over the heads, it
    read every broker message (or the lock table) again for each, 0.2-1.7 s a
    sweep in the backlog benchmark, against 20-40 ms."""
    keys = [scope_lock_key(f"s-{i}") for i in range(3000)]
    with psycopg.connect(dsn, autocommit=True) as conn, \
            psycopg.connect(dsn, autocommit=True) as holder:
        conn.execute("SET jit = off")
        # Statistics taken while the backlog was a tenth of its size, as a ledger's
        # lag behind a burst: the planner's estimates are the bench's.
        for first, last in ((1, 300), (301, 3000)):
            conn.execute(
                "INSERT INTO runs (request_id, scope, session_id, agent, prompt, lock_key,"
                " status, dispatched_at, started_at, heartbeat_at)"
                " SELECT 'r-' || i, 's-' || i, 's-' || i, 'a', 'p', k,"
                " CASE WHEN i <= 1000 THEN 'running' ELSE 'queued' END, now(),"
                " CASE WHEN i <= 1000 THEN now() END, CASE WHEN i <= 1000 THEN now() END"
                " FROM unnest(%s::bigint[]) WITH ORDINALITY AS t(k, i)"
                " WHERE i BETWEEN %s AND %s", (keys, first, last))
            if first == 1:
                conn.execute("ANALYZE runs")
        holder.execute("SELECT count(pg_advisory_lock(k)) FROM unnest(%s::bigint[]) AS k",
                       (keys[:1000],))
        params = {"after": 60, "queued_after": 5, "queues": ["celery"], "waiting": [2000],
                  "default_queue": "celery", "held_within": 4, "dead_after": 4, "limit": 500}
        row = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + query("orphans"),
                           params).fetchone()
    assert row is not None
    scans = list(_loops(row[0][0]["Plan"]))
    assert ("pg_lock_status", 1) in scans
    assert all(loops <= 1 for _, loops in scans), scans


def _pages(conn: psycopg.Connection[Any]) -> int:
    """The pages this database read or found in its buffers so far."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    row = conn.execute("SELECT blks_hit + blks_read FROM pg_stat_database"
                       " WHERE datname = current_database()").fetchone()
    assert row is not None
    return int(row[0])


def test_a_fair_look_weighs_the_tenants_it_sends_first_not_every_tied_one(dsn: str) -> None:
    """2,000 tenants wait their fair turn, a request each, all at the clock
    (tied on their first tag): a look sends the oldest requests, whatever their
    tenants' names, and reads about the walk over the tenants, not each tied
    tenant's requests as well (12,000 pages a look at 2,000 tenants before)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        # Tenant k-1 enqueued last, k-2000 first: names and ages in opposite orders.
        conn.execute(
            "INSERT INTO runs (request_id, scope, session_id, agent, prompt, status,"
            " fairness_key, waiting_for, dispatched_at, received_at, enqueued_at)"
            " SELECT 'r-' || i, 's-' || i, 's-' || i, 'a', 'p', 'queued', 'k-' || i,"
            " 'limit fair_queue', now(), now(), now() - i * interval '1 second'"
            " FROM generate_series(1, 2000) AS i")
        conn.execute("ANALYZE runs")
        before = _pages(conn)
        sent = [r[0] for r in conn.execute(query("fair_next"), {"wait": True, "page": 5})]
        pages = _pages(conn) - before
    assert sorted(sent) == ["r-1996", "r-1997", "r-1998", "r-1999", "r-2000"]
    assert pages < 9000, f"{pages} pages read by a look at 2,000 tied tenants"


def test_a_look_reads_the_marks_not_a_probe_of_runs_for_every_waiting_tenant(dsn: str) -> None:
    """20,000 tenants wait, a request each: a look of 7 reads the marks of the
    20,000 (``fairness_keys``) and probes runs for the 7 it weighs, where the
    walk over every tenant's withheld requests read some 60,000 pages."""
    page = {"wait": True, "page": 7}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO concurrency_limits (name, max_runs) VALUES ('fair_queue', 0)")
        conn.execute(
            "INSERT INTO runs (request_id, scope, session_id, agent, prompt, status,"
            " fairness_key, waiting_for, waiting_slots, dispatched_at, received_at, enqueued_at)"
            " SELECT 'r-' || i, 's-' || i, 's-' || i, 'a', 'p', 'queued', 'k-' || i,"
            " 'limit fair_queue', '{}', now(), now(), now() - i * interval '1 second'"
            " FROM generate_series(1, 20000) AS i")
        conn.execute("ANALYZE runs")
        conn.execute("ANALYZE fairness_keys")
        conn.execute(query("fair_next"), page)  # its plans made
        before = _pages(conn)
        sent = sorted(r[0] for r in conn.execute(query("fair_next"), page))
        pages = _pages(conn) - before
    assert sent == sorted(f"r-{i}" for i in range(19987, 19994))
    assert pages < 3000, f"{pages} pages read by a look at 20,000 tenants"


def test_a_prune_of_fairness_keys_reads_the_clock_once_and_calls_nothing_a_row(
    dsn: str,
) -> None:
    """200,000 keys with requests withheld, ahead of the clock or weighed, and
    20 at rest: a batch of the prune reads the clock once and tests each key
    with the function's expression spelt out (a function called for each row
    took 665 ms over 200,000 keys; spelt out, a few)."""
    params = {"scope": None, "batch": 1000, "before": None, "cutoff": None}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO fair_clock (id, vtime) VALUES (1, 5)")
        conn.execute(
            "INSERT INTO fairness_keys (fairness_key, vtime, weight, withheld_at)"
            " SELECT 'k-' || i, CASE WHEN i % 3 = 0 THEN 9 ELSE 1 END,"
            " CASE WHEN i % 3 = 1 THEN 2 END, CASE WHEN i % 3 = 2 THEN now() END"
            " FROM generate_series(1, 200000) AS i")
        conn.execute("INSERT INTO fairness_keys (fairness_key, vtime)"
                     " SELECT 'rest-' || i, 4 FROM generate_series(1, 20) AS i")
        conn.execute("ANALYZE fairness_keys")
        plans = ["\n".join(r[0] for r in conn.execute("EXPLAIN " + query(name), params))
                 for name in ("prune_fairness_keys", "prune_counts")]
        deleted = conn.execute(query("prune_fairness_keys"), params).rowcount
    for plan in plans:
        assert "loomflow_worker_fair_key_at_rest" not in plan, plan
        assert plan.count(" on fair_clock ") == 1 and "SubPlan" not in plan, plan
    assert deleted == 20
