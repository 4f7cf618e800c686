"""Shared pieces of the chaos tests: what to kill, and the checks every test makes.

Each request is sent with unique tool tags ``<session>-r<index>-<letter>``, so
the effects table (one row per tool execution, with its pid, start and end)
says which request ran which execution, in which process and when."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import psycopg
from celery.result import AsyncResult
from psycopg.conninfo import conninfo_to_dict

from loomflow_worker.tasks import run_agent
from tests.integration.celery_harness import Fleet
from tests.integration.helpers import calls, tool_executions, wait_until
from tests.needs import ADMIN_DSN

TERMINAL = ("succeeded", "failed", "cancelled", "dead")

#: Fast recovery: the sweeper and heartbeats every half second, a short lease.
RECOVERY = {
    "LOOMFLOW_WORKER_SWEEP_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_LEASE": "3",
    "LOOMFLOW_WORKER_MAX_CRASHES": "20",
}

#: Runs sharing a worker process, with tool calls of a second.
SHARING = {
    "LOOMFLOW_WORKER_SWEEP_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_LEASE": "10",
    "TEST_TOOL_SLEEP": "1.0",
}


@dataclass(frozen=True)
class Sent:
    """One request the test enqueued."""

    index: int
    session: str
    user: str
    tags: tuple[str, ...]
    result: AsyncResult

    @property
    def request_id(self) -> str:
        return str(self.result.id)

    @property
    def expected(self) -> str:
        return "done: " + ", ".join(f"recorded {tag}" for tag in self.tags)


def send(index: int, session: str, user: str, letters: str = "ab") -> Sent:
    tags = tuple(f"{session}-r{index:03d}-{letter}" for letter in letters)
    result = run_agent.delay(calls(*tags), session, user_id=user)
    return Sent(index, session, user, tags, result)


def request_key(tag: str) -> str:
    """``s3-r042`` of the tag ``s3-r042-a``."""
    return tag.rsplit("-", 1)[0]


@dataclass(frozen=True)
class Execution:
    tag: str
    pid: int
    started_at: datetime
    finished_at: datetime | None


def executions(dsn: str) -> list[Execution]:
    """Every execution of the effects tool; each started when its tool was
    called (a start recorded late, its process stopped as it connected, still
    says when it began)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT tag, pid, coalesce(entered_at, started_at), finished_at "
            "FROM loomflow_worker_effects ORDER BY id"
        ).fetchall()
    return [Execution(*row) for row in rows]


def statuses(dsn: str, sent: list[Sent]) -> dict[str, str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT request_id, status FROM runs WHERE request_id = ANY(%s)",
            ([s.request_id for s in sent],),
        ).fetchall()
    return {str(r[0]): str(r[1]) for r in rows}


def ledger_rows(dsn: str, sent: list[Sent]) -> dict[str, dict[str, Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(
            "SELECT request_id, status, attempts, failures, crashes, error, result "
            "FROM runs WHERE request_id = ANY(%s)",
            ([s.request_id for s in sent],),
        )
        names = [d.name for d in cur.description or ()]
        return {str(row[0]): dict(zip(names, row, strict=True)) for row in cur.fetchall()}


def running_count(dsn: str, ids: list[str], status: str = "running") -> int:
    """How many of the requests ``ids`` are running (or of another ``status``)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM runs WHERE request_id = ANY(%s) AND status = %s",
            (ids, status),
        ).fetchone()
    assert row is not None
    return int(row[0])


def all_terminal(dsn: str, sent: list[Sent]) -> bool:
    found = statuses(dsn, sent)
    return len(found) == len(sent) and all(s in TERMINAL for s in found.values())


def wait_terminal(dsn: str, sent: list[Sent], timeout: float) -> dict[str, str]:
    """Poll the ledger until every request is terminal (or ``timeout`` passes)."""
    def all_terminal(found: dict[str, str]) -> bool:
        return len(found) == len(sent) and all(s in TERMINAL for s in found.values())

    with contextlib.suppress(AssertionError):  # the caller says which are not
        return wait_until(lambda: statuses(dsn, sent), "every request terminal", timeout,
                          until=all_terminal, every=0.2)
    return statuses(dsn, sent)


AUDIT_DDL = r"""
CREATE TABLE chaos_journal_audit (
    id         BIGSERIAL PRIMARY KEY,
    session_id TEXT NOT NULL,
    step_name  TEXT NOT NULL,
    tag        TEXT NOT NULL,
    at         TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    backend    INTEGER NOT NULL DEFAULT pg_backend_pid()
);
CREATE FUNCTION chaos_journal_audit() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    tag TEXT := substring(encode(NEW.value, 'escape') from '"output":"recorded ([^"]*)"');
BEGIN
    IF tag IS NOT NULL THEN
        INSERT INTO chaos_journal_audit (session_id, step_name, tag)
        VALUES (NEW.session_id, NEW.step_name, tag);
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER chaos_journal_audit AFTER INSERT OR UPDATE ON journal_steps
    FOR EACH ROW EXECUTE FUNCTION chaos_journal_audit();
"""


def install_journal_audit(dsn: str) -> None:
    """Record, in the test database only, when each tool result was journaled
    (the trigger's row commits with the journal write, or not at all)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(AUDIT_DDL)


@dataclass(frozen=True)
class Journaled:
    tag: str
    session_id: str
    step_name: str
    at: datetime


def journal_writes(dsn: str) -> list[Journaled]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT tag, session_id, step_name, at FROM chaos_journal_audit ORDER BY id"
        ).fetchall()
    return [Journaled(*row) for row in rows]


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (a worker's pool children)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def fleet_pids(fleet: Fleet) -> dict[str, list[int]]:
    """Each worker's main pid followed by its pool children."""
    return {name: [proc.pid, *children(proc.pid)] for name, proc in fleet.workers.items()}


@dataclass
class Verdict:
    """What the ledger, the results and the effects table say after a test."""

    lost: list[str] = field(default_factory=list)  # requests not `succeeded`
    completed_twice: dict[str, int] = field(default_factory=dict)  # tag -> extra completions
    # G1 exactly: an execution that started after its tag's result was journaled.
    g1_violations: list[str] = field(default_factory=list)
    # one tag's result journaled under more than one key (namespace trouble)
    keys_per_tag: list[str] = field(default_factory=list)
    # a completed execution run again before its result was ever journaled (the
    # at-least-once window G1 allows: killed between the tool's end and the write)
    reruns_in_window: list[str] = field(default_factory=list)
    # two executions of one tool call at the same time (two attempts running at once)
    concurrent_runs: list[str] = field(default_factory=list)
    never_completed: list[str] = field(default_factory=list)  # tags with no completion
    interrupted: list[Execution] = field(default_factory=list)  # finished_at NULL
    order_violations: list[str] = field(default_factory=list)
    overlaps: list[str] = field(default_factory=list)
    wrong_outputs: list[str] = field(default_factory=list)  # ledger result
    result_problems: list[str] = field(default_factory=list)  # Celery AsyncResult
    attempts: int = 0
    crashes: int = 0
    failures: int = 0

    def summary(self) -> str:
        return (
            f"lost={len(self.lost)} completed_twice={sum(self.completed_twice.values())} "
            f"(in the at-least-once window: {len(self.reruns_in_window)}) "
            f"g1_violations={len(self.g1_violations)} multi_key_tags={len(self.keys_per_tag)} "
            f"concurrent_runs={len(self.concurrent_runs)} "
            f"never_completed={len(self.never_completed)} interrupted={len(self.interrupted)} "
            f"order_violations={len(self.order_violations)} overlaps={len(self.overlaps)} "
            f"wrong_outputs={len(self.wrong_outputs)} "
            f"result_problems={len(self.result_problems)} "
            f"attempts={self.attempts} crashes={self.crashes} failures={self.failures}"
        )


def verdict(dsn: str, sent: list[Sent], result_timeout: float = 30.0) -> Verdict:
    """Every check on the finished test, gathered (the caller asserts and prints)."""
    out = Verdict()
    rows = ledger_rows(dsn, sent)
    for s in sent:
        row = rows.get(s.request_id)
        if row is None or row["status"] != "succeeded":
            status = None if row is None else row["status"]
            error = None if row is None else row["error"]
            out.lost.append(f"{s.request_id} ({s.session} r{s.index}): {status} {error}")
            continue
        out.attempts += int(row["attempts"])
        out.crashes += int(row["crashes"])
        out.failures += int(row["failures"])
        output = (row["result"] or {}).get("output")
        if output != s.expected:
            out.wrong_outputs.append(f"{s.request_id}: {output!r} != {s.expected!r}")

    # The Celery result of each request (stored by the worker, not the ledger).
    deadline = time.monotonic() + result_timeout
    for s in sent:
        if time.monotonic() > deadline:  # one slow result must not eat the others' time
            deadline = time.monotonic() + 2.0
        try:
            value = s.result.get(timeout=max(0.5, deadline - time.monotonic()),
                                 propagate=False)
        except Exception as exc:  # a timeout or a backend error: report, not raise
            out.result_problems.append(
                f"{s.request_id} ({s.session} r{s.index}): {type(exc).__name__}: {exc}"
            )
            continue
        if not isinstance(value, dict) or value.get("output") != s.expected:
            out.result_problems.append(
                f"{s.request_id} ({s.session} r{s.index}): state {s.result.state}, {value!r}"
            )

    found = executions(dsn)
    completed = Counter(e.tag for e in found if e.finished_at is not None)
    out.completed_twice = {tag: n - 1 for tag, n in completed.items() if n > 1}
    out.never_completed = [t for s in sent for t in s.tags if completed[t] == 0]
    out.interrupted = [e for e in found if e.finished_at is None]

    writes: dict[str, list[Journaled]] = {}
    for w in journal_writes(dsn):
        writes.setdefault(w.tag, []).append(w)
    for tag, ws in writes.items():
        if len({(w.session_id, w.step_name) for w in ws}) > 1:
            out.keys_per_tag.append(
                f"{tag}: " + ", ".join(sorted({f"{w.session_id} {w.step_name}" for w in ws}))
            )
    runs_of: dict[str, list[Execution]] = {}
    for e in found:
        runs_of.setdefault(e.tag, []).append(e)
    for tag, runs in runs_of.items():
        first_write = min((w.at for w in writes.get(tag, [])), default=None)
        for e in runs:
            if first_write is not None and e.started_at > first_write:
                out.g1_violations.append(
                    f"{tag}: execution in pid {e.pid} started {e.started_at:%T.%f}, after its "
                    f"result was journaled at {first_write:%T.%f}"
                )
        ordered = sorted(runs, key=lambda e: e.started_at)
        for earlier, later in pairwise(ordered):
            if earlier.finished_at is not None and earlier.finished_at > later.started_at:
                out.concurrent_runs.append(
                    f"{tag}: pid {earlier.pid} ran it until {earlier.finished_at:%T.%f} while "
                    f"pid {later.pid} started it at {later.started_at:%T.%f}"
                )
        done = sorted((e for e in runs if e.finished_at is not None),
                      key=lambda e: e.started_at)
        if len(done) > 1 and not any(
            first_write is not None and e.started_at > first_write for e in done
        ):
            # Each completion before the first journal write was cut off by a
            # fault before its write (two faults in a row can hit one call twice).
            for earlier, later in pairwise(done):
                out.reruns_in_window.append(
                    f"{tag}: completed at {earlier.finished_at:%T.%f} (pid {earlier.pid}), "
                    f"run again from {later.started_at:%T.%f} (pid {later.pid}); first "
                    f"journaled {'never' if first_write is None else f'{first_write:%T.%f}'}"
                )

    by_request: dict[str, list[Execution]] = {}
    for e in found:
        by_request.setdefault(request_key(e.tag), []).append(e)
    for session in sorted({s.session for s in sent}):
        mine = [s for s in sent if s.session == session]
        spans: list[tuple[datetime, datetime | None, int]] = []
        for s in mine:
            runs = by_request.get(request_key(s.tags[0]), [])
            if not runs:
                continue
            ends = [e.finished_at for e in runs if e.finished_at is not None]
            spans.append((min(e.started_at for e in runs), max(ends) if ends else None, s.index))
        spans.sort(key=lambda span: span[0])
        order = [index for _, _, index in spans]
        if order != sorted(order):
            out.order_violations.append(f"{session}: ran in order {order}")
        for (start_a, end_a, index_a), (start_b, _, index_b) in pairwise(spans):
            if end_a is None or end_a > start_b:
                out.overlaps.append(
                    f"{session}: r{index_a} [{start_a:%T.%f}, "
                    f"{'?' if end_a is None else f'{end_a:%T.%f}'}] overlaps r{index_b} "
                    f"starting {start_b:%T.%f}"
                )
    return out


def assert_sound(v: Verdict, context: str) -> None:
    """What every fault-injection run must show, whatever it did to the fleet."""
    assert v.lost == [], context
    assert v.g1_violations == [], context
    assert v.keys_per_tag == [], context
    assert v.concurrent_runs == [], context
    # A completed tool call may run again only when the fault fell between its
    # end and its journal write (G1's at-least-once window; the audit tells).
    assert sum(v.completed_twice.values()) == len(v.reruns_in_window), context
    assert v.never_completed == [], context
    assert v.order_violations == [], context
    assert v.overlaps == [], context
    assert v.wrong_outputs == [], context
    assert v.result_problems == [], context


def slowest(dsn: str, sent: list[Sent], fleet: Fleet, count: int = 3) -> str:
    """The requests that became terminal last: their ledger timeline and log lines."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT request_id FROM runs WHERE request_id = ANY(%s) "
            "ORDER BY finished_at DESC NULLS FIRST LIMIT %s",
            ([s.request_id for s in sent], count),
        ).fetchall()
    return timeline(dsn, fleet, [str(r[0]) for r in rows])


def timeline(dsn: str, fleet: Fleet, request_ids: list[str]) -> str:
    """Requests' ledger rows, attempts and log lines, for a failure message."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT request_id, session_id, status, attempts, crashes, failures, "
            "enqueued_at, dispatched_at, swept_at, started_at, finished_at "
            "FROM runs WHERE request_id = ANY(%s) ORDER BY finished_at DESC NULLS FIRST",
            (request_ids,),
        ).fetchall()
        attempts = conn.execute(
            "SELECT request_id, attempt, worker, pid, started_at, ended_at, outcome "
            "FROM run_attempts WHERE request_id = ANY(%s) ORDER BY request_id, attempt",
            ([r[0] for r in rows],),
        ).fetchall()
    lines = []
    for r in rows:
        lines.append(
            f"{r[0]} {r[1]} {r[2]} attempts={r[3]} crashes={r[4]} failures={r[5]} "
            f"enqueued={r[6]:%T.%f} dispatched={r[7]:%T.%f} "
            f"swept={'-' if r[8] is None else f'{r[8]:%T.%f}'} "
            f"started={'-' if r[9] is None else f'{r[9]:%T.%f}'} "
            f"finished={'-' if r[10] is None else f'{r[10]:%T.%f}'}"
        )
        for a in attempts:
            if a[0] == r[0]:
                lines.append(f"    attempt {a[1]} {a[2]} pid {a[3]} {a[4]:%T.%f} -> "
                             f"{'-' if a[5] is None else f'{a[5]:%T.%f}'} {a[6]}")
        lines.append(grep_logs(fleet, r[0], limit=30))
    return "\n".join(lines)


def grep_logs(fleet: Fleet, *needles: str, limit: int = 40) -> str:
    """Lines of every worker log (whole files, not tails) holding any needle."""
    lines = []
    for path in sorted(fleet.logs.glob("*.log")) + sorted(fleet.logs.glob("*.out")):
        for line in path.read_text(errors="replace").splitlines():
            if any(n in line for n in needles):
                lines.append(f"{path.name}: {line}")
    return "\n".join(lines[-limit:])


def problem_lines(fleet: Fleet, limit: int = 60) -> str:
    return grep_logs(
        fleet, "ERROR", "WARNING", "Traceback", "dead", "failed", "fenced", "Error", limit=limit
    )


def kill_postgres_backends(dsn: str) -> tuple[datetime, Counter[str]]:
    """End every backend of ``dsn``'s database but our own, in one statement;
    returns when (server clock) and how many of each application name."""
    dbname = conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT application_name, pg_terminate_backend(pid), clock_timestamp() "
            "FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (dbname,),
        ).fetchall()
    at = min((row[2] for row in rows), default=datetime.now(UTC))
    return at, Counter(str(name) or "(unnamed)" for name, ok, _ in rows if ok)


def wait_in_tool(dsn: str, tags: tuple[str, ...], times: int, timeout: float = 90) -> None:
    """Wait until the tool call of each of ``tags`` runs for the ``times``-th
    time (its model call before it is journaled)."""
    def runs() -> dict[str, list[object]]:
        """The end of each execution of each tag's tool call (None: running)."""
        found: dict[str, list[object]] = {}
        for tag, _, _, finished in tool_executions(dsn):
            found.setdefault(tag, []).append(finished)
        return found

    wait_until(runs, f"{', '.join(tags)} running for time {times}", timeout, every=0.05,
               until=lambda seen: all(len(seen.get(tag, [])) == times and seen[tag][-1] is None
                                      for tag in tags))


def quarantined(fleet: Fleet, env: dict[str, str],
                tags: tuple[str, str] = ("alone-1", "neighbour-1")) -> tuple[str, str]:
    """Two requests (sessions t and n, a tool call tagged by ``tags`` each)
    that died twice with their shared process without completing a step, now
    running in quarantine (together, or each alone with QUARANTINE_GROUP=1);
    their ids."""
    fleet.start("w1", concurrency=10, cli=True, pool="threads", **env)
    suspect = run_agent.delay(calls(tags[0]), "t", user_id="u")
    neighbour = run_agent.delay(calls(tags[1]), "n", user_id="u")
    for attempt in (1, 2):
        # Killed in its tool: a kill before its first model call was journaled
        # would let its next attempt complete that call, clearing it.
        wait_in_tool(fleet.dsn, tags, attempt)
        fleet.kill("w1")
        fleet.start("w1", concurrency=10, cli=True, pool="threads", **env)
    return suspect.id, neighbour.id
