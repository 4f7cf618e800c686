"""Operating a fleet: the ledger and journal read for people, pruning, signals, health checks.

Sync functions on psycopg 3 connections, called by the ``loomflow-worker``
command and by the sweeper's retention. Every query lives in
``runtime/sql/queries.sql``; every error names what to do and never a
password (connection strings are shown through ``describe_dsn``).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import psycopg
from loomflow.core.types import ModelChunk, ToolResult
from loomflow.runtime import _codec
from psycopg.rows import class_row, dict_row
from pydantic import ValidationError
from pydantic_settings import SettingsError

from .execution import ledger
from .runtime.codec import CodecStats, decode
from .runtime.errors import DatabaseUnavailable, InvalidInput, LoomflowWorkerError, SchemaError
from .runtime.migrate import latest_version
from .runtime.sql import query
from .runtime.store import describe_dsn
from .runtime.validate import check_id, check_signal_name
from .settings import Settings

Conn = psycopg.Connection[Any]

TERMINAL = tuple(str(s) for s in ledger.TERMINAL)
STATUSES = tuple(str(s) for s in ledger.Status)


class RequestNotFound(LoomflowWorkerError, LookupError):
    """No request with this id in the runs ledger."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(
            f"no request {request_id!r} in the runs ledger (pruned, mistyped, or enqueued "
            "against another database); `loomflow-worker runs` lists the recent ones"
        )


# ---- secrets --------------------------------------------------------------------------------


def secrets_of(settings: Settings) -> list[str]:
    """The passwords in the settings' connection strings (to scrub from any text shown)."""
    found: list[str] = []
    urls = [settings.database_url, settings.broker_url, settings.result_backend]
    if settings.events_url is not None:
        urls.append(settings.events_url)
    for url in urls:
        raw = url.get_secret_value()
        try:
            password = urlsplit(raw).password
        except ValueError:
            password = None
        if not password:
            match = re.search(r"(?:^|\s)password\s*=\s*'?([^'\s]+)", raw)
            password = match[1] if match else None
        if password and len(password) >= 3:
            found.append(password)
    return found


def redact(text: str, secrets: Sequence[str]) -> str:
    """``text`` with every secret (and its URL-encoded form) replaced by ``***``."""
    for secret in secrets:
        for form in {secret, unquote(secret), quote(secret, safe="")}:
            if form:
                text = text.replace(form, "***")
    return text


def validation_message(exc: ValidationError | SettingsError) -> str:
    """A settings error as ``field: message`` lines, without the values given
    (pydantic's own text repeats them, connection strings included). A value
    that is not even JSON (a dict or list setting) is named with the parser's
    complaint, which quotes no part of it."""
    if isinstance(exc, SettingsError):
        cause = exc.__cause__
        detail = f": {_first_line(cause)}" if isinstance(cause, ValueError) else ""
        return f"{exc}{detail}; dict and list settings are read as JSON"
    lines = []
    for error in exc.errors(include_url=False, include_input=False):
        where = ".".join(str(part) for part in error["loc"]) or "settings"
        lines.append(f"{where}: {error['msg']}")
    return "; ".join(lines)


# ---- connections ----------------------------------------------------------------------------


def connect(settings: Settings, *, application_name: str = "loomflow-worker admin") -> Conn:
    """An autocommit connection to the fleet's database, or :class:`DatabaseUnavailable`."""
    dsn = settings.database_url.get_secret_value()
    try:
        return psycopg.connect(
            dsn,
            autocommit=True,
            connect_timeout=settings.connect_timeout,
            application_name=application_name,
        )
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(
            f"can't connect to Postgres at {describe_dsn(dsn)}: {_first_line(exc)}; check "
            "that the server is running and LOOMFLOW_WORKER_DATABASE_URL is right"
        ) from exc
    except psycopg.ProgrammingError as exc:
        # libpq quotes the offending part, which may be the password.
        reason = redact(_first_line(exc), secrets_of(settings))
        raise InvalidInput(
            f"LOOMFLOW_WORKER_DATABASE_URL is not a valid connection string: {reason}"
        ) from exc


@contextmanager
def translated(dsn_hint: str = "") -> Iterator[None]:
    """Driver errors of admin queries as this package's errors, the cause kept."""
    try:
        yield
    except psycopg.errors.UndefinedTable as exc:
        raise SchemaError(
            "the loomflow-worker tables are missing: run `loomflow-worker migrate` against "
            f"this database{dsn_hint}"
        ) from exc
    except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
        raise DatabaseUnavailable(
            f"lost the connection to Postgres{dsn_hint}: {_first_line(exc)}"
        ) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# ---- durations ------------------------------------------------------------------------------

#: The longest duration accepted (Postgres timestamps end 4713 BC).
MAX_DURATION = timedelta(days=365_000)

_DURATION = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")


def parse_duration(text: str) -> timedelta:
    """``"30d"``, ``"12h"``, ``"90m"``, ``"45s"`` or combinations in that order
    (``"1d12h"``); :class:`InvalidInput` otherwise."""
    compact = text.strip().lower().replace(" ", "")
    match = _DURATION.fullmatch(compact)
    if not compact or match is None or not any(match.groups()):
        raise InvalidInput(
            f"{text!r} is not a duration: use a number and a unit, d (days), h (hours), "
            "m (minutes) or s (seconds), largest first, e.g. 30d, 12h, 90m, 45s, 1d12h"
        )
    days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
    try:
        duration = timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    except OverflowError:
        duration = MAX_DURATION + timedelta(days=1)
    if duration > MAX_DURATION:
        raise InvalidInput(
            f"{text!r} is longer than {MAX_DURATION.days}d (about a thousand years), the "
            "longest duration accepted; nothing in the ledger is that old"
        )
    return duration


def format_duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.2f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    parts = [(days, "d"), (hours, "h"), (minutes, "m"), (secs, "s")]
    return "".join(f"{n}{unit}" for n, unit in parts if n) or "0s"


# ---- the runs ledger ------------------------------------------------------------------------


#: The most requests one listing returns.
MAX_LIST = 1_000_000


@dataclass(frozen=True)
class RunRow:
    request_id: str
    session_id: str
    user_id: str | None
    agent: str
    status: str
    attempts: int
    enqueued_at: datetime
    finished_at: datetime | None
    worker: str | None


def list_runs(
    conn: Conn,
    *,
    session_id: str | None = None,
    user_id: str | None = None,
    statuses: Sequence[str] = (),
    older_than: timedelta | None = None,
    newer_than: timedelta | None = None,
    limit: int = 50,
) -> list[RunRow]:
    """Requests, newest first, matching every filter given (ages by enqueue time)."""
    unknown = [s for s in statuses if s not in STATUSES]
    if unknown:
        raise InvalidInput(f"unknown status {unknown[0]!r}; one of {', '.join(STATUSES)}")
    if not 1 <= limit <= MAX_LIST:
        raise InvalidInput(f"limit must be from 1 to {MAX_LIST}, not {limit}")
    params = {
        "session_id": session_id,
        "user_id": user_id,
        "statuses": list(statuses) or None,
        "older": older_than.total_seconds() if older_than is not None else None,
        "newer": newer_than.total_seconds() if newer_than is not None else None,
        "limit": limit,
    }
    with translated():
        return conn.cursor(row_factory=class_row(RunRow)).execute(
            query("admin_list_runs"), params
        ).fetchall()


@dataclass(frozen=True)
class RunStatus:
    status: str
    result: Any
    error: str | None
    error_type: str | None

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL


def run_status(conn: Conn, request_id: str) -> RunStatus:
    """The request's status and outcome, or :class:`RequestNotFound`."""
    with translated():
        row = conn.cursor(row_factory=class_row(RunStatus)).execute(
            query("admin_run_status"), {"request_id": request_id}
        ).fetchone()
    if row is None:
        raise RequestNotFound(request_id)
    return row


def wait_for(
    conn: Conn, request_id: str, *, timeout: float | None = None, poll: float = 0.05
) -> RunStatus:
    """Poll the ledger until the request is finished; ``TimeoutError`` after ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        status = run_status(conn, request_id)
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


@dataclass
class RunDetail:
    request_id: str
    seq: int
    scope: str
    session_id: str
    user_id: str | None
    agent: str
    kind: str
    prompt: str
    metadata: dict[str, Any]
    status: str
    epoch: int | None
    attempts_count: int
    failures: int
    crashes: int
    holder: str | None
    result: Any
    error: str | None
    error_type: str | None
    enqueued_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    attempts: list[AttemptInfo] = field(default_factory=list)
    journal: list[StepInfo] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["attempts"] = [asdict(a) for a in self.attempts]
        data["journal"] = [
            {**asdict(s), "name": s.name, "history": s.history()} for s in self.journal
        ]
        plain: dict[str, Any] = json.loads(json.dumps(data, default=_json_default))
        return plain


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def get_run(conn: Conn, request_id: str) -> RunDetail:
    """The request, its attempts and its journal (with what each attempt
    executed or replayed), or :class:`RequestNotFound`."""
    with translated():
        detail = conn.cursor(row_factory=class_row(RunDetail)).execute(
            query("get_run"), {"request_id": request_id}
        ).fetchone()
        if detail is None:
            raise RequestNotFound(request_id)
        detail.attempts = conn.cursor(row_factory=class_row(AttemptInfo)).execute(
            query("admin_run_attempts"), {"request_id": request_id}
        ).fetchall()
        if detail.epoch is not None:
            ns = str(detail.epoch)
            rows = conn.cursor(row_factory=dict_row).execute(
                query("admin_run_journal"),
                {"scope": detail.scope, "epoch": detail.epoch, "lo": ns + "/", "hi": ns + "0"},
            ).fetchall()
            detail.journal = attribute_steps(
                [(bool(r["stream"]), r["step_name"], float(r["created_at"]), bytes(r["value"]))
                 for r in rows],
                detail.attempts,
                ran_nothing=_attempts_that_ran_nothing(detail),
            )
    return detail


def _attempts_that_ran_nothing(detail: RunDetail) -> set[int]:
    """An attempt that ended before running the agent: cancelled before it started
    (attempts that found the request dead are told by their outcome)."""
    skipped: set[int] = set()
    last = detail.attempts[-1] if detail.attempts else None
    if (
        last is not None
        and last.outcome == "cancelled"
        and detail.error == "cancelled before it started"
    ):
        skipped.add(last.attempt)
    return skipped


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
    for stream, key, created, value in ordered:
        owner = executed_by(created)
        previous = last_write.get(owner)
        if previous is None and owner is not None:
            previous = dict(starts)[owner]
        last_write[owner] = created
        steps.append(
            StepInfo(
                key=key,
                stream=stream,
                written_at=datetime.fromtimestamp(created, tz=UTC),
                took=None if previous is None else max(0.0, created - previous),
                summary=summarize_value(value, key),
                executed_in=owner,
            )
        )
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


def summarize_value(blob: bytes, key: str, width: int = 100) -> str:
    """A one-line account of a journal value: a tool's output, a model call's text
    and tool calls. Only loomflow's JSON encoding is read, never a pickle."""
    ok, value = decode(blob, "json", CodecStats(), key=key)
    if not ok:
        return f"({len(blob)} bytes, not JSON-encoded)"
    return shorten(_describe(value), width)


def _describe(value: Any) -> str:
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


# ---- signals --------------------------------------------------------------------------------


def send_signal(conn: Conn, session_id: str, name: str, payload: Any = None) -> int:
    """Deliver a durable signal to ``session_id`` (what ``PostgresRuntime.signal``
    does: the same row and NOTIFY); returns the signal's id."""
    check_id("session_id", session_id)
    check_signal_name(name)
    try:
        blob = _codec.dumps(payload)
    except TypeError as exc:
        raise InvalidInput(f"signal {name!r}: the payload can't be stored as JSON: {exc}") from exc
    with translated():
        row = conn.cursor(row_factory=dict_row).execute(
            query("send_signal"), {"session_id": session_id, "name": name, "payload": blob}
        ).fetchone()
    assert row is not None
    return int(row["id"])


# ---- pruning --------------------------------------------------------------------------------

# Each table and its batch query, in the order they are pruned.
_PRUNE_ORDER: tuple[tuple[str, str], ...] = (
    ("journal_steps", "admin_prune_steps"),
    ("journal_streams", "admin_prune_streams"),
    ("checkpoints", "admin_prune_checkpoints"),
    ("runs", "admin_prune_runs"),
)
PRUNED_TABLES = tuple(table for table, _ in _PRUNE_ORDER)


def db_cutoff(conn: Conn, older_than: timedelta) -> datetime:
    """The moment ``older_than`` ago on the database's clock (a prune's cutoff:
    a host whose clock is off must not delete what was finished a minute ago)."""
    with translated():
        row = conn.execute(
            query("admin_cutoff"), {"age": older_than.total_seconds()}
        ).fetchone()
    assert row is not None
    cutoff: datetime = row[0]
    return cutoff


def prune_counts(conn: Conn, before: datetime) -> dict[str, int]:
    """How many rows :class:`Pruner` would delete now, per table."""
    with translated():
        row = conn.execute(query("admin_prune_counts"), _prune_params(before, 0)).fetchone()
    assert row is not None
    return dict(zip(PRUNED_TABLES, (int(n) for n in row), strict=True))


def _prune_params(before: datetime, batch: int) -> dict[str, Any]:
    return {"before": before.timestamp(), "cutoff": before, "batch": batch}


class Pruner:
    """Deletes what is older than ``before``, one short transaction per batch.

    Journal entries, streams and checkpoints written before the cutoff (the
    scopes' epoch bookkeeping kept, and scopes with an unfinished request
    spared: a run parked for longer than the cutoff still needs its journal),
    then requests that finished before it (their attempts cascade). Each
    batch skips rows a running step has locked. :meth:`run` goes on until
    everything is gone or a time budget is spent, so the sweeper can prune a
    little on every sweep."""

    def __init__(self, before: datetime, *, batch_size: int = 5000) -> None:
        if batch_size < 1:
            raise InvalidInput(f"batch size must be at least 1, not {batch_size}")
        if before.tzinfo is None:
            raise InvalidInput("the prune cutoff must be an aware datetime")
        self.before = before
        self.batch_size = batch_size
        self.totals: dict[str, int] = dict.fromkeys(PRUNED_TABLES, 0)
        self._left = list(_PRUNE_ORDER)

    @property
    def done(self) -> bool:
        return not self._left

    @property
    def total(self) -> int:
        return sum(self.totals.values())

    def step(self, conn: Conn) -> tuple[str, int]:
        """Delete one batch; returns ``(table, rows deleted)``. Driver errors
        pass through untranslated (the sweeper reconnects on them)."""
        table, name = self._left[0]
        deleted = conn.execute(query(name), _prune_params(self.before, self.batch_size)).rowcount
        self.totals[table] += deleted
        if deleted < self.batch_size:
            self._left.pop(0)
        return table, deleted

    def run(
        self,
        conn: Conn,
        *,
        budget: float | None = None,
        on_batch: Callable[[str, int], None] | None = None,
    ) -> dict[str, int]:
        """Batches until done, or until ``budget`` seconds were spent; the totals so far."""
        if not conn.autocommit:
            # Each batch must be its own short transaction.
            raise InvalidInput("prune needs an autocommit connection")
        deadline = None if budget is None else time.monotonic() + budget
        while not self.done:
            table, deleted = self.step(conn)
            if on_batch is not None and deleted:
                on_batch(table, deleted)
            if deadline is not None and time.monotonic() >= deadline:
                break
        return dict(self.totals)


# ---- doctor ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    hint: str = ""

    def line(self) -> str:
        text = f"{'OK  ' if self.ok else 'FAIL'} {self.name}: {self.detail}"
        return f"{text}; {self.hint}" if self.hint and not self.ok else text


# Up to the last "@" of each URL: a password may hold an unescaped "@".
_URL_PASSWORD = re.compile(r"(//[^:/@;?#]*:)[^;]*@")


def sanitize_url(url: str) -> str:
    """A broker or backend URL (or several, ``;``-separated) for display, each
    password masked (and, when it held an unescaped "@", all up to the URL's
    last "@")."""
    return _URL_PASSWORD.sub(r"\1***@", url)


def check_settings(settings: Settings, grace_period: float) -> list[Check]:
    """Settings that only go wrong together."""
    checks = []
    if settings.is_redis_broker:
        from .execution.registry import agent_time_limit, registered_agents

        limits = [agent_time_limit(name) for name in registered_agents()]
        longest = max([settings.run_time_limit, *(t for t in limits if t is not None)])
        checks.append(Check(
            "visibility timeout",
            settings.visibility_timeout > longest,
            f"{settings.visibility_timeout}s vs the longest run time limit {longest:g}s",
            "the Redis broker hands a message still running after its visibility timeout to "
            "another worker: raise LOOMFLOW_WORKER_VISIBILITY_TIMEOUT above "
            "LOOMFLOW_WORKER_RUN_TIME_LIMIT (and every register_agent(time_limit=...))",
        ))
    checks.append(Check(
        "lease",
        settings.lease > settings.heartbeat_interval,
        f"lease {settings.lease:g}s vs heartbeat interval {settings.heartbeat_interval:g}s",
        "raise LOOMFLOW_WORKER_LEASE above LOOMFLOW_WORKER_HEARTBEAT_INTERVAL, or live runs "
        "look frozen and are fenced",
    ))
    checks.append(Check(
        "soft shutdown",
        settings.soft_shutdown_timeout < grace_period,
        f"soft shutdown timeout {settings.soft_shutdown_timeout:g}s vs grace period "
        f"{grace_period:g}s",
        "keep LOOMFLOW_WORKER_SOFT_SHUTDOWN_TIMEOUT below the orchestrator's grace period "
        "(LOOMFLOW_WORKER_GRACE_PERIOD / --grace-period), or SIGKILL lands before runs are "
        "requeued",
    ))
    return checks


def doctor(settings: Settings, *, grace_period: float, timeout: float = 3.0) -> list[Check]:
    """Every check, each a :class:`Check` with what to do when it fails."""
    checks = [*_check_database(settings), _check_broker(settings, timeout)]
    checks += _check_redis(settings, timeout)
    checks.append(_check_agents(settings))
    checks += check_settings(settings, grace_period)
    return checks


def _check_database(settings: Settings) -> list[Check]:
    where = describe_dsn(settings.database_url.get_secret_value())
    try:
        conn = connect(settings, application_name="loomflow-worker doctor")
    except LoomflowWorkerError as exc:
        return [
            Check("database", False, str(exc)),
            Check("schema", False, "not checked (no database)",
                  "fix the database connection first"),
        ]
    with conn:
        try:
            with translated():
                version_row = conn.execute(query("admin_server_version")).fetchone()
                present = conn.execute(query("admin_schema_present")).fetchone()
                applied = (
                    [r[0] for r in conn.execute(query("schema_versions"))]
                    if present and present[0] else []
                )
        except LoomflowWorkerError as exc:
            return [Check("database", False, f"{where}: {exc}")]
    server = version_row[0] if version_row else "?"
    database = Check("database", True, f"reachable at {where} (PostgreSQL {server})")
    latest = latest_version()
    current = max(applied, default=0)
    if current == latest:
        schema = Check("schema", True, f"at version {latest}")
    elif current < latest:
        schema = Check(
            "schema", False,
            f"at version {current or 'none'}, this loomflow-worker needs {latest}",
            "run `loomflow-worker migrate` (workers also migrate when they start)",
        )
    else:
        schema = Check(
            "schema", False, f"at version {current}, newer than this loomflow-worker's {latest}",
            "upgrade loomflow-worker on this host",
        )
    return [database, schema]


def _check_broker(settings: Settings, timeout: float) -> Check:
    import kombu.connection

    connection: Any = kombu.connection.Connection
    url = settings.broker_url.get_secret_value()
    options = dict(settings.broker_transport_options)
    if settings.is_redis_broker:
        options["visibility_timeout"] = settings.visibility_timeout
    try:
        with connection(url, connect_timeout=timeout, transport_options=options) as conn:
            conn.ensure_connection(
                max_retries=1, interval_start=0, interval_step=0.5, timeout=timeout
            )
    except Exception as exc:
        return Check(
            "broker", False, f"{sanitize_url(url)} unreachable: {_first_line(exc)}",
            "check that the broker is running and LOOMFLOW_WORKER_BROKER_URL is right",
        )
    return Check("broker", True, f"reachable at {sanitize_url(url)}")


def _check_redis(settings: Settings, timeout: float) -> list[Check]:
    import redis

    targets = [("result backend", settings.result_backend.get_secret_value(),
                "LOOMFLOW_WORKER_RESULT_BACKEND")]
    if settings.events_url is not None:
        targets.append(("events", settings.events_url.get_secret_value(),
                        "LOOMFLOW_WORKER_EVENTS_URL"))
    checks = []
    for name, url, variable in targets:
        if not url.startswith(("redis://", "rediss://")):
            checks.append(Check(name, True, f"{sanitize_url(url)} (not Redis: not probed)"))
            continue
        client: redis.Redis = redis.Redis.from_url(
            url, socket_connect_timeout=timeout, socket_timeout=timeout
        )
        try:
            client.ping()
        except (redis.RedisError, OSError) as exc:
            checks.append(Check(
                name, False, f"{sanitize_url(url)} unreachable: {_first_line(exc)}",
                f"check that Redis is running and {variable} is right",
            ))
        else:
            checks.append(Check(name, True, f"reachable at {sanitize_url(url)}"))
        finally:
            client.close()
    return checks


def _check_agents(settings: Settings) -> Check:
    from .execution.registry import import_agent_modules, registered_agents

    if not settings.agents:
        return Check(
            "agents", False, "no agents modules listed",
            "set LOOMFLOW_WORKER_AGENTS to the modules that call register_agent",
        )
    try:
        import_agent_modules(settings.agents)
    except InvalidInput as exc:
        return Check("agents", False, str(exc), "fix PYTHONPATH or LOOMFLOW_WORKER_AGENTS")
    except Exception as exc:
        return Check(
            "agents", False, f"importing {', '.join(settings.agents)} raised "
            f"{type(exc).__name__}: {_first_line(exc)}", "fix the agents module",
        )
    agents = registered_agents()
    if not agents:
        return Check("agents", False, f"{', '.join(settings.agents)} registered no agent",
                     "decorate a factory with @loomflow_worker.register_agent")
    return Check("agents", True, f"{', '.join(settings.agents)} importable; registered: "
                 f"{', '.join(agents)}")
