"""Shared pieces of the chaos tests: what to kill, and the checks every test makes.

Each request is sent with unique tool tags ``<session>-r<index>-<letter>``, so
the effects table (one row per tool execution, with its pid, start and end)
says which request ran which execution, in which process and when."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import psycopg
from celery.result import AsyncResult

from loomflow_worker.tasks import run_agent
from tests.integration.celery_harness import Fleet
from tests.integration.helpers import calls

TERMINAL = ("succeeded", "failed", "cancelled", "dead")


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
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT tag, pid, started_at, finished_at FROM loomflow_worker_effects ORDER BY id"
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


def all_terminal(dsn: str, sent: list[Sent]) -> bool:
    found = statuses(dsn, sent)
    return len(found) == len(sent) and all(s in TERMINAL for s in found.values())


def wait_terminal(dsn: str, sent: list[Sent], timeout: float) -> dict[str, str]:
    """Poll the ledger until every request is terminal (or ``timeout`` passes)."""
    deadline = time.monotonic() + timeout
    found = statuses(dsn, sent)
    while time.monotonic() < deadline:
        found = statuses(dsn, sent)
        if len(found) == len(sent) and all(s in TERMINAL for s in found.values()):
            break
        time.sleep(0.2)
    return found


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
