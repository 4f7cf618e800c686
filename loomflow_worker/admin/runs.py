"""The runs ledger and journal read for people: requests listed, one request's
attempts and journal (which attempt executed or replayed each step). The
ledger's rows come from :mod:`loomflow_worker.execution.ledger_reads`."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, Protocol

from psycopg.rows import dict_row

from ..defaults import MAX_LIST as MAX_LIST
from ..execution import ledger_reads
from ..execution import statuses as ledger_statuses
from ..execution.request_errors import RequestNotFound
from ..execution.statuses import STATUSES as STATUSES
from ..execution.versions import VersionInfo as VersionInfo
from ..runtime.conns import SyncConn
from ..runtime.errors import InvalidInput, translated
from ..runtime.sql import query

TERMINAL = tuple(str(s) for s in ledger_statuses.TERMINAL)


@dataclass(frozen=True)
class RequestSummary:
    """One request as `loomflow-worker requests` lists it."""

    request_id: str
    session_id: str
    user_id: str | None
    agent: str
    status: str
    attempts: int
    enqueued_at: datetime
    finished_at: datetime | None
    worker: str | None
    # When it may start (apply_async's countdown or eta; None: at once).
    not_before: datetime | None = None
    # Why a queued request waits, when not merely for its turn: a limit ("limit
    # per_key:alice"), its model key, a signal.
    waiting_for: str | None = None
    # The version of its agent it is pinned to (None: not started), and since
    # when it waits, queued, for a worker of that version.
    agent_version: str | None = None
    version_wait_since: datetime | None = None
    # Its model calls' executed (billed) tokens and cost in dollars, and
    # whether some call's price is unknown.
    model_calls: int = 0
    tokens: int = 0
    cost: Decimal = Decimal(0)
    price_unknown: bool = False

    def waits(self) -> str | None:
        """Why it waits, when not merely for its turn."""
        if self.version_wait_since is not None:
            return f"a worker of version {self.agent_version}"
        return self.waiting_for


def list_requests(
    conn: SyncConn,
    *,
    session_id: str | None = None,
    user_id: str | None = None,
    statuses: Sequence[str] = (),
    older_than: timedelta | None = None,
    newer_than: timedelta | None = None,
    min_cost: Decimal | None = None,
    by_cost: bool = False,
    limit: int = 50,
) -> list[RequestSummary]:
    """Requests, newest first (``by_cost``: the costliest first), matching
    every filter given (ages by enqueue time; ``min_cost``: at least that
    many dollars)."""
    unknown = [s for s in statuses if s not in STATUSES]
    if unknown:
        raise InvalidInput(f"unknown status {unknown[0]!r}; one of {', '.join(STATUSES)}")
    if min_cost is not None and not min_cost >= 0:
        raise InvalidInput(f"a minimum cost is a number of dollars from 0 up, not {min_cost}")
    if not 1 <= limit <= MAX_LIST:
        raise InvalidInput(f"limit must be from 1 to {MAX_LIST}, not {limit}")
    with translated("query"):
        rows = ledger_reads.list_requests(
            conn, session_id=session_id, user_id=user_id, statuses=statuses,
            older_than=older_than, newer_than=newer_than, min_cost=min_cost, by_cost=by_cost,
            limit=limit,
        )
    return [RequestSummary(**row) for row in rows]


@dataclass(frozen=True)
class RequestStatus:
    status: str
    result: Any
    error: str | None
    error_type: str | None

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL


def request_status(conn: SyncConn, request_id: str) -> RequestStatus:
    """The request's status and outcome, or :class:`RequestNotFound`."""
    with translated("query"):
        row = ledger_reads.request_status(conn, request_id)
    if row is None:
        raise RequestNotFound(request_id)
    return RequestStatus(**row)


def wait_for(
    conn: SyncConn, request_id: str, *, timeout: float | None = None, poll: float = 0.05
) -> RequestStatus:
    """Poll the ledger until the request is finished; ``TimeoutError`` after ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        status = request_status(conn, request_id)
        if status.finished:
            return status
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(
                f"request {request_id} still {status.status} after {timeout:g}s"
            )
        time.sleep(poll)
        poll = min(poll * 1.5, 0.5)


@dataclass(frozen=True)
class AttemptInfo:
    attempt: int
    worker: str
    pid: int
    epoch: int
    started_at: datetime
    ended_at: datetime | None
    outcome: str | None
    # When the attempt after it started (None: the last): where the console's
    # lane of an attempt whose worker died ends.
    next_started_at: datetime | None = None
    # The version of its agent it ran (None: a release that recorded none).
    agent_version: str | None = None
    # How apart from other runs it ran: 0 in a shared process, 1 in quarantine
    # among a few suspected requests, 2 alone.
    isolation: int = 0
    # Its worker died under it together with other runs of its process (or in
    # quarantine among other suspects): not a crash of this request. How many
    # other requests' runs died in that process.
    shared: bool = False
    died_with: int = 0
    # Its model calls (None: it recorded none, e.g. its process was killed):
    # "executed" and "replayed", each calls, tokens by kind and cost (dollars,
    # None: unknown), and the same by model key under "keys".
    usage: dict[str, Any] | None = None

    @property
    def died(self) -> bool:
        """Its worker died under it: ended "died" as the next attempt started, or
        (a release that left such attempts open) never ended, another after it."""
        return self.outcome == "died" or (
            self.outcome is None and self.ended_at is None and self.next_started_at is not None)

    def said(self, *, last: bool, running: bool) -> str:
        """How it ended, as ``show`` and the console's lanes say it."""
        if self.outcome == "died":
            return "worker died"
        if self.outcome:
            return self.outcome
        return "running" if last and running else "worker died"

    def explained(self, *, last: bool, running: bool) -> str | None:
        """Why it ended so, and what that counts as for the request (a crash,
        a failure, nothing): the words :meth:`said` uses, explained; ``None``
        when the outcome says it all (succeeded, running)."""
        said = self.said(last=last, running=running)
        if said == "worker died":
            return self._death_explained()
        where = {1: " (it ran in quarantine, among a few suspected requests)",
                 2: " (it ran alone, in a process of its own)"}.get(self.isolation, "")
        why = OUTCOMES_EXPLAINED.get(said)
        return None if why is None else why + where

    def _death_explained(self) -> str:
        if not self.shared:
            alone = {1: "in quarantine", 2: "alone"}.get(self.isolation, "")
            return (f"its worker process died while it ran{' ' + alone if alone else ''} with "
                    "no other request's run dying there: a crash of this request, counted "
                    "toward its limit (LOOMFLOW_WORKER_MAX_CRASHES), after which it ends dead")
        if self.died_with:
            others = (f"{self.died_with} other request's run" if self.died_with == 1
                      else f"{self.died_with} other requests' runs")
            cause = f"its worker process died with {others} in it"
        else:
            cause = ("its worker process, a quarantine of a few suspected requests, died "
                     "after running others")
        return (f"{cause}: a death shared with other runs is not a crash of this request "
                "(any of them may have killed the process), so its crash count did not rise; "
                "it makes the request a suspect instead, and after two such deaths in a row "
                "without completing a step it runs in quarantine, then alone, where a death "
                "counts as its crash")


#: What an attempt's outcome means for its request (see AttemptInfo.explained).
OUTCOMES_EXPLAINED = {
    "interrupted": "its worker shut down (a deploy or a stop) and requeued it: not a crash "
                   "and not a failure; the next attempt replays what it journaled",
    "lost": "its worker lost its lock connection to Postgres (or stopped heartbeating past "
            "the lease) and stopped it, so that no other attempt ran beside it: not a crash; "
            "two such attempts in a row and it runs alone (LOOMFLOW_WORKER_MAX_LOST ends it)",
    "paused": "it gave its slot back to wait for its model key (a budget or a provider's "
              "pause) and was queued again: not a failure",
    "retry": "its run raised an error: a failure of this request, run again after a backoff "
             "(LOOMFLOW_WORKER_MAX_RETRIES ends it failed)",
    "handed_back": "a suspect, it ran apart until it completed a step, which cleared it: "
                   "it was handed back to run among other requests again",
    "dead": "the request had crashed too often (or lost its lock too often): this attempt "
            "ended it dead without running it",
}


@dataclass
class StepInfo:
    """One journal entry of a run and what each attempt did with it.

    ``executed_in`` is the attempt during which the entry was written (None:
    before this request's first attempt, by an earlier request of the same
    epoch, e.g. the run a ``resume_agent`` continues). ``replayed_in`` are
    the later attempts that read it back; ``rerun_in`` the later attempts
    that ran the same step again under a new key (its inputs changed)."""

    key: str
    stream: bool
    written_at: datetime
    took: float | None
    summary: str
    executed_in: int | None = None
    # The step as a person reads it: "model call 2", "tool charge(order=3)"
    # (:func:`step_label`; empty: its name).
    label: str = ""
    replayed_in: list[int] = field(default_factory=list)
    rerun_in: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return step_name(self.key)

    def history(self) -> str:
        """``"executed in attempt 1, replayed in 2"`` and the like."""
        if self.executed_in is None:
            parts = ["written before this request"]
        else:
            parts = [f"executed in attempt {self.executed_in}"]
        if self.replayed_in:
            parts.append("replayed in " + ", ".join(map(str, self.replayed_in)))
        if self.rerun_in:
            parts.append("run again (new inputs) in " + ", ".join(map(str, self.rerun_in)))
        return ", ".join(parts)


def agent_versions(conn: SyncConn) -> list[VersionInfo]:
    """Every version of every agent the fleet knows, newest build first per agent."""
    with translated("query"):
        return [VersionInfo(**row) for row in ledger_reads.agent_versions(conn)]


@dataclass(frozen=True)
class UpgradeInfo:
    """A move of a request to another version of its agent (``upgrade``, or
    its agent's on_version_gone policy): when, from and to which version, by whom."""

    at: datetime
    from_version: str | None
    to_version: str
    by: str


@dataclass
class RequestDetail:
    """One request as the ledger has it, its attempts and its journal (each
    entry with the attempt that executed it and those that replayed it): what
    ``show`` prints and the console's run page draws."""

    request_id: str
    seq: int
    scope: str
    session_id: str
    user_id: str | None
    agent: str
    kind: str
    # Whole, or cut where the reader asked (the console's page); prompt_length
    # is the whole one's.
    prompt: str
    prompt_length: int
    metadata: dict[str, Any]
    status: str
    epoch: int | None
    attempts_count: int
    failures: int
    crashes: int
    # The worker running it now (node:pid), the ledger's `holder` column.
    worker: str | None
    cancel_requested: bool
    result: Any
    error: str | None
    error_type: str | None
    enqueued_at: datetime
    started_at: datetime | None
    heartbeat_at: datetime | None
    finished_at: datetime | None
    # When it may start (apply_async's countdown or eta, or a retry's backoff).
    not_before: datetime | None
    # The database's clock when it was read.
    now: datetime
    # Why a queued request waits, when it gave its slot back (e.g. "waiting for
    # model key 'anthropic' (its budget)").
    waiting_for: str | None = None
    # The version of its agent its first attempt pinned it to (None: not
    # started yet, it runs on any version); since when it waits, queued, for a
    # worker of that version; whether a live worker serves that version, and
    # when a worker of it was last seen (None: none known).
    agent_version: str | None = None
    version_wait_since: datetime | None = None
    version_live: bool | None = None
    version_seen_at: datetime | None = None
    # Deaths it shared with other runs of its process since it last completed
    # a step: at two, it runs apart (see AttemptInfo.explained).
    suspicion: int = 0
    # Its model calls: executed (billed) tokens by kind and cost in dollars,
    # whether some call's price is unknown, and what replays from the journal
    # saved (calls, tokens, cost).
    model_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    cost: Decimal = Decimal(0)
    price_unknown: bool = False
    replayed_calls: int = 0
    replayed_tokens: int = 0
    replayed_cost: Decimal = Decimal(0)
    attempts: list[AttemptInfo] = field(default_factory=list)
    # Its moves to another version of its agent, oldest first.
    upgrades: list[UpgradeInfo] = field(default_factory=list)
    journal: list[StepInfo] = field(default_factory=list)
    # The journal holds more entries than the reader's limit, which were left out.
    journal_cut: bool = False

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL

    def version_said(self) -> str | None:
        """The version it is pinned to, and whether it waits for a worker of it
        (``"3f2a9c1b0d4e; waits for a worker of this version since 12:03:07;
        none alive since 12:02:55"``); ``None`` when not pinned."""
        if self.agent_version is None:
            return None
        if self.version_wait_since is None:
            return self.agent_version
        since = f"since {self.version_wait_since:%Y-%m-%d %H:%M:%S}"
        if self.version_live:
            alive = "a worker of it is alive: it starts there soon"
        elif self.version_seen_at is not None:
            alive = f"none alive since {self.version_seen_at:%Y-%m-%d %H:%M:%S}"
        else:
            alive = "no worker of it known"
        return (f"{self.agent_version}; waits for a worker of agent {self.agent} version "
                f"{self.agent_version} {since} (UTC); {alive} "
                f"(start one, or move it: loomflow-worker upgrade {self.request_id})")

    def counts(self) -> str:
        """Its attempts, failures and crashes, as `show` and the run page say them."""
        return ", ".join(f"{n} {word if n == 1 else plural}" for n, word, plural in (
            (self.attempts_count, "attempt", "attempts"), (self.failures, "failure", "failures"),
            (self.crashes, "crash", "crashes")))

    def counts_explained(self) -> list[str]:
        """What its crash count counts, when an attempt's worker died: each
        death charged to it (a crash) or shared with other runs (none), and
        how suspected that leaves it."""
        notes = []
        for i, attempt in enumerate(self.attempts):
            last = i == len(self.attempts) - 1
            if attempt.said(last=last, running=self.status == "running") != "worker died":
                continue
            if attempt.shared:
                notes.append(f"attempt {attempt.attempt}'s worker died with other runs of its "
                             "process: not counted as a crash of this request")
            else:
                notes.append(f"attempt {attempt.attempt}'s worker died while no other run "
                             "died with it: counted as a crash")
        if self.suspicion and not self.finished:
            notes.append(f"suspected: {self.suspicion} shared death"
                         f"{'s' if self.suspicion != 1 else ''} since it last completed a "
                         "step (at 2 it runs apart from other requests)")
        return notes

    @property
    def prompt_cut(self) -> bool:
        return self.prompt_length > len(self.prompt)

    @property
    def holder(self) -> str | None:
        """The old name of :attr:`worker`, kept for code that reads it."""
        return self.worker

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        # `show --json` printed the worker as "holder" first: scripts read it.
        data["holder"] = self.worker
        data["attempts"] = [asdict(a) for a in self.attempts]
        data["upgrades"] = [asdict(u) for u in self.upgrades]
        data["journal"] = [
            {**asdict(s), "name": s.name, "history": s.history()} for s in self.journal
        ]
        plain: dict[str, Any] = json.loads(json.dumps(data, default=_json_default))
        return plain


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def get_request(conn: SyncConn, request_id: str) -> RequestDetail:
    """The request, its attempts and its journal (with what each attempt
    executed or replayed), or :class:`RequestNotFound`. The console reads the
    same three queries on its own pool (``console.data.get_request``)."""
    with translated("query"):
        row = ledger_reads.request_row(conn, request_params(request_id))
        if row is None:
            direct = get_direct_run(conn, request_id)
            if direct is not None:
                return direct
            raise RequestNotFound(request_id)
        detail = RequestDetail(**row)
        detail.attempts = [
            AttemptInfo(**attempt) for attempt in ledger_reads.request_attempts(conn, request_id)
        ]
        detail.upgrades = [
            UpgradeInfo(**move) for move in ledger_reads.request_upgrades(conn, request_id)
        ]
        if detail.epoch is not None:
            rows = conn.cursor(row_factory=dict_row).execute(
                query("get_run_journal"), journal_params(detail)
            ).fetchall()
            add_journal(detail, rows)
    return detail


@dataclass(frozen=True)
class DirectRun:
    """A run made through PostgresRuntime outside Celery (a web process's own
    ``agent.run``), as ``requests --direct`` lists it. ``outcome`` ``None``:
    still running, or its process died before it ended."""

    run_id: str
    session_id: str
    user_id: str | None
    epoch: int
    process: str
    started_at: datetime
    finished_at: datetime | None
    outcome: str | None
    error: str | None


def list_direct_runs(
    conn: SyncConn, *, session_id: str | None = None, user_id: str | None = None, limit: int = 50
) -> list[DirectRun]:
    """Runs made outside Celery, newest first."""
    if not 1 <= limit <= MAX_LIST:
        raise InvalidInput(f"limit must be from 1 to {MAX_LIST}, not {limit}")
    with translated("query"):
        rows = conn.cursor(row_factory=dict_row).execute(query("list_direct_runs"), {
            "session_id": session_id, "user_id": user_id, "limit": limit}).fetchall()
    return [DirectRun(**row) for row in rows]


def direct_detail(row: Mapping[str, Any]) -> RequestDetail:
    """A ``get_direct_run`` row as a request of kind ``direct``, with its one
    attempt (its process's), its journal still to add."""
    fields = dict(row)
    pid, outcome = fields.pop("pid"), fields.pop("outcome")
    detail = RequestDetail(**fields)
    detail.attempts = [AttemptInfo(
        attempt=1, worker=str(detail.worker), pid=int(pid), epoch=int(fields["epoch"]),
        started_at=fields["started_at"], ended_at=fields["finished_at"],
        outcome={"raised": "failed"}.get(outcome, outcome))]
    return detail


def get_direct_run(conn: SyncConn, run_id: str) -> RequestDetail | None:
    """A run made outside Celery read as a request (``show``), or ``None``."""
    with translated("query"):
        row = conn.cursor(row_factory=dict_row).execute(
            query("get_direct_run"), {"request_id": run_id}).fetchone()
        if row is None:
            return None
        detail = direct_detail(row)
        rows = conn.cursor(row_factory=dict_row).execute(
            query("get_run_journal"), journal_params(detail)).fetchall()
    add_journal(detail, rows)
    return detail


def request_params(request_id: str, *, prompt_chars: int | None = None) -> dict[str, Any]:
    """The ``get_run`` query's parameters: the prompt cut to ``prompt_chars``
    characters (``None``: whole)."""
    return {"request_id": request_id, "prompt_chars": prompt_chars}


def journal_params(detail: RequestDetail, *, limit: int | None = None) -> dict[str, Any]:
    """The ``get_run_journal`` query's parameters for the run's namespace: at
    most ``limit`` entries (one more, to tell that some were left out)."""
    ns = str(detail.epoch)
    return {"scope": detail.scope, "epoch": detail.epoch, "lo": ns + "/", "hi": ns + "0",
            "limit": None if limit is None else limit + 1}


def add_journal(
    detail: RequestDetail, rows: Sequence[Mapping[str, Any]], *, limit: int | None = None
) -> None:
    """Give ``detail`` the journal ``get_run_journal`` read (``rows``), each
    entry with the attempts that executed and replayed it."""
    entries = [(bool(r["stream"]), str(r["step_name"]), float(r["created_at"]),
                bytes(r["value"])) for r in rows]
    detail.journal_cut = limit is not None and len(entries) > limit
    detail.journal = attribute_steps(
        entries[:limit], detail.attempts,
        ran_nothing=attempts_that_ran_nothing(detail.error, detail.attempts),
    )


class _Ended(Protocol):
    @property
    def attempt(self) -> int: ...
    @property
    def outcome(self) -> str | None: ...


def attempts_that_ran_nothing(error: str | None, attempts: Sequence[_Ended]) -> set[int]:
    """An attempt that ended before running the agent: cancelled before it started
    (attempts that found the request dead are told by their outcome). ``error``
    is the request's; the console reads the same rule."""
    last = attempts[-1] if attempts else None
    if last is not None and last.outcome == "cancelled" and error == "cancelled before it started":
        return {last.attempt}
    return set()


_KEY_HASH = re.compile(r"(@[0-9a-f]{16}|:[0-9a-f]{64})$")
# loomflow numbers its own steps by position in the run (model_call_2,
# tool_call_1_0, persist_episode_3, signal_go_1): the same name under another
# key in a later attempt is that step run again with other inputs.
_POSITIONAL = re.compile(r"_\d+$")


_EPOCH_PREFIX = re.compile(r"^\d+/")


def step_name(key: str) -> str:
    """A journal key without its epoch namespace and its inputs' fingerprint:
    ``3/model_call_1@ab..`` is ``model_call_1``; ``idem:tool_call_1_0:<sha256>``
    is ``idem:tool_call_1_0``."""
    return _KEY_HASH.sub("", _EPOCH_PREFIX.sub("", key))


def attribute_steps(
    entries: Sequence[tuple[bool, str, float, bytes]],
    attempts: Sequence[AttemptInfo],
    *,
    ran_nothing: set[int] | None = None,
    now: float | None = None,
) -> list[StepInfo]:
    """Which attempt executed each journal entry and which attempts replayed it.

    Every attempt writes only the steps it executes, so an entry whose last
    write (``created_at``) falls within attempt k (from its start to the next
    attempt's start) was executed by attempt k; each later attempt that ran
    replayed it, unless that attempt wrote the same step under a new key (its
    inputs changed, so it ran again instead). ``entries`` are ``(stream, key,
    created_at, value)``."""
    # An attempt that found the request dead ran nothing (no replay either).
    skipped = (ran_nothing or set()) | {a.attempt for a in attempts if a.outcome == "dead"}
    starts = [(a.attempt, a.started_at.timestamp()) for a in attempts]
    now = time.time() if now is None else now

    def executed_by(at: float) -> int | None:
        owner = None
        for number, started in starts:
            if started <= at:
                owner = number
        return owner

    ordered = sorted(entries, key=lambda e: (e[2], e[1]))
    steps: list[StepInfo] = []
    last_write: dict[int | None, float] = {}
    calls = _ToolCalls()
    values: list[Any] = []
    for stream, key, created, blob in ordered:
        owner = executed_by(created)
        previous = last_write.get(owner)
        if previous is None and owner is not None:
            previous = dict(starts)[owner]
        last_write[owner] = created
        ok, value = _decoded(blob, key)
        values.append(value)
        calls.note(step_name(key), value)
        steps.append(
            StepInfo(
                key=key,
                stream=stream,
                written_at=datetime.fromtimestamp(created, tz=UTC),
                took=None if previous is None else max(0.0, created - previous),
                summary=(shorten(_describe(value), SUMMARY_WIDTH) if ok
                         else _undecoded(blob)),
                executed_in=owner,
            )
        )
    for step, value in zip(steps, values, strict=True):
        step.label = step_label(step.name, value, calls)
    ran_again: dict[tuple[bool, str], set[int]] = {}
    for step in steps:
        if step.executed_in is not None and _POSITIONAL.search(step.name):
            ran_again.setdefault((step.stream, step.name), set()).add(step.executed_in)
    for step in steps:
        first = step.executed_in or 0
        for number, _ in starts:
            if number <= first or number in skipped:
                continue
            if number in ran_again.get((step.stream, step.name), set()):
                step.rerun_in.append(number)
            else:
                step.replayed_in.append(number)
    return steps


#: How long a journal value's one-line account is.
SUMMARY_WIDTH = 100


def summarize_value(blob: bytes, key: str, width: int = SUMMARY_WIDTH) -> str:
    """A one-line account of a journal value: a tool's output, a model call's text
    and tool calls. Only loomflow's JSON encoding is read, never a pickle."""
    ok, value = _decoded(blob, key)
    return shorten(_describe(value), width) if ok else _undecoded(blob)


def _decoded(blob: bytes, key: str) -> tuple[bool, Any]:
    # The codec loads loomflow: listing requests never needs it.
    from ..runtime.codec import CodecStats, decode

    return decode(blob, "json", CodecStats(), key=key)


def _undecoded(blob: bytes) -> str:
    return f"({len(blob)} bytes, not JSON-encoded)"


_MODEL_CALL = re.compile(r"model_call_(\d+)")
_TOOL_CALL = re.compile(r"(?:idem:)?tool_call_(\d+)_(\d+)")
_EPISODE = re.compile(r"persist_episode_(\d+)")
# The request's own step around a registered Workflow (execution.runnables).
_WORKFLOW = re.compile(r"workflow_(.+)")
#: How long a tool call's arguments are shown in its label.
ARGS_WIDTH = 60


class _ToolCalls:
    """The tool calls a run's model calls asked for, by call id and by their
    place (the turn of the model call, the call's slot in its reply): how a
    tool step, whose key holds only a digest of the call, is named by the
    call it ran."""

    def __init__(self) -> None:
        self.by_id: dict[str, Any] = {}
        self.by_place: dict[tuple[int, int], Any] = {}

    def note(self, name: str, value: Any) -> None:
        found = _MODEL_CALL.fullmatch(name)
        if found is None:
            return
        for slot, call in enumerate(_calls_of(value)):
            self.by_id.setdefault(str(call.id), call)
            self.by_place[(int(found[1]), slot)] = call

    def of(self, turn: int, slot: int, value: Any) -> Any:
        """The call a tool step ran (its value a ``ToolResult``), or ``None``."""
        call_id = getattr(value, "call_id", None)
        if call_id is not None and call_id in self.by_id:
            return self.by_id[call_id]
        return self.by_place.get((turn, slot))


def _calls_of(value: Any) -> list[Any]:
    """The tool calls in a model call's journaled reply: streamed chunks, or
    the ``(text, tool_calls, usage, finish_reason)`` of a call not streamed."""
    from loomflow.core.types import ModelChunk, ToolCall

    if isinstance(value, list) and all(isinstance(v, ModelChunk) for v in value):
        return [c.tool_call for c in value if c.kind == "tool_call" and c.tool_call is not None]
    if isinstance(value, list | tuple) and len(value) == 4 and isinstance(value[1], list):
        return [c for c in value[1] if isinstance(c, ToolCall)]
    return []


def step_label(name: str, value: Any, calls: _ToolCalls) -> str:
    """A journal step as a person reads it: ``model call 2``, ``tool
    charge(order=3)`` (the call found in the run's model calls; ``tool call
    2.0``, its turn and slot, when none is), ``episode saved (turn 3)``; any
    other step by its name."""
    found = _MODEL_CALL.fullmatch(name)
    if found is not None:
        return f"model call {found[1]}"
    found = _TOOL_CALL.fullmatch(name)
    if found is not None:
        turn, slot = int(found[1]), int(found[2])
        call = calls.of(turn, slot, value)
        if call is None:
            return f"tool call {turn}.{slot}"
        args = ", ".join(f"{k}={json.dumps(v, default=str)}" for k, v in call.args.items())
        return f"tool {call.tool}({shorten(args, ARGS_WIDTH)})"
    found = _EPISODE.fullmatch(name)
    if found is not None:
        return f"episode saved (turn {found[1]})"
    found = _WORKFLOW.fullmatch(name)
    if found is not None:
        return f"workflow {found[1]} started (its nodes journal in child runs)"
    return name


def _describe(value: Any) -> str:
    from loomflow.core.types import ModelChunk, ToolResult

    if isinstance(value, ToolResult):
        if value.ok:
            return f"ok: {_text(value.output)}"
        return f"error: {value.error or value.reason or 'failed'}"
    if isinstance(value, list) and value and all(isinstance(v, ModelChunk) for v in value):
        text = "".join(c.text or "" for c in value if c.kind == "text")
        calls = [
            f"{c.tool_call.tool}({json.dumps(c.tool_call.args, sort_keys=True)})"
            for c in value if c.kind == "tool_call" and c.tool_call is not None
        ]
        parts = []
        if text:
            parts.append(repr(text))
        if calls:
            parts.append("calls " + ", ".join(calls))
        return "model: " + ("; ".join(parts) or "(no output)")
    return _text(value)


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return repr(value)


def shorten(text: str, width: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


# The first names of the reads above, which spoke of a "run" for the ledger's request: kept
# for the code that calls them.
RunRow = RequestSummary
RunStatus = RequestStatus
RunDetail = RequestDetail
list_runs = list_requests
run_status = request_status
get_run = get_request
