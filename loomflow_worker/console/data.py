"""What the console reads: the ledger, the journal and the fleet's traces in Postgres.

The ledger is read through :mod:`~loomflow_worker.execution.ledger_views`
(its gateway), the rest by the queries of ``console/sql/console.sql``,
on a small pool of read-only connections; rows come back as the dataclasses
below (psycopg's ``class_row``). A run's page reads what ``loomflow-worker show``
reads, as its model (``admin.RequestDetail``). A prompt leaves the database cut to
``PROMPT_CHARS`` characters, except on a run's own page when asked for.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from psycopg.rows import class_row, dict_row
from psycopg_pool import AsyncConnectionPool

from .. import admin
from ..admin.usage_report import UsageRow, ordered, totals, usage_params
from ..durations import shown
from ..execution import budgets, ledger_views
from ..execution.budgets import BudgetRow
from ..execution.versions import VersionInfo
from ..runtime.conns import Conn
from ..runtime.errors import InvalidInput
from ..runtime.sql import query
from ..runtime.validate import check_id
from ..settings import Settings

Pool = AsyncConnectionPool[Conn]
Row = TypeVar("Row")

#: How much of a prompt the lists show (and fetch).
PROMPT_CHARS = 120
#: Requests per page of the list, and of a session's page.
PAGE_SIZE = 50
#: The most journal entries a run's page loads.
MAX_JOURNAL = 5000
#: How far back the fleet page looks for attempts (seconds).
RECENT_WINDOW = 3600.0
#: How far back the fleet page looks for worker processes' heartbeats (seconds).
WORKERS_WINDOW = 900.0
#: How many worker processes, and sweeper actions, the fleet page lists.
MAX_WORKERS = 200
MAX_ACTIONS = 50


def make_pool(settings: Settings, *, max_size: int = 4) -> Pool:
    """The console's connections: opened by :func:`Pool.open`, each one read
    only, and planning each statement with its values (``prepare_threshold``
    None: no generic plan), so an absent filter costs nothing."""
    return AsyncConnectionPool(
        settings.database_url.get_secret_value(),
        min_size=1,
        max_size=max_size,
        open=False,
        name="loomflow-worker console",
        check=AsyncConnectionPool.check_connection,
        timeout=settings.connect_timeout,
        kwargs={
            "autocommit": True,
            "prepare_threshold": None,
            "connect_timeout": settings.connect_timeout,
            "application_name": "loomflow-worker console",
            "options": "-c default_transaction_read_only=on",
        },
    )


async def _rows(
    conn: Conn, name: str, params: Mapping[str, Any], row: type[Row]
) -> list[Row]:
    """The rows of one of the console's own queries (the fleet's processes and
    connections, the sweeper's leader and actions: no ledger table)."""
    async with conn.cursor(row_factory=class_row(row)) as cur:
        await cur.execute(query(name), params)
        return await cur.fetchall()


# ---- the requests list ------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestRow:
    request_id: str
    seq: int
    session_id: str
    user_id: str | None
    agent: str
    kind: str
    status: str
    attempts: int
    crashes: int
    prompt: str
    prompt_length: int
    enqueued_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    # The worker running it (node:pid), the ledger's `holder` column.
    worker: str | None

    @property
    def prompt_cut(self) -> bool:
        return self.prompt_length > len(self.prompt)


_ISO_HINT = "a duration ago (30m, 2h, 1d12h) or a UTC time (2025-06-01 14:02, 2025-06-01T14:02:00)"


def parse_when(what: str, text: str, now: datetime) -> datetime:
    """A time filter: a duration ago (``2h``) or an ISO date and time (UTC
    unless it names its offset); :class:`InvalidInput` naming the filter."""
    text = text.strip()
    if re.fullmatch(r"[\d\sdhms]+", text.lower(), re.ASCII):
        try:
            return now - admin.parse_duration(text)
        except InvalidInput as exc:
            raise InvalidInput(f"{what}: {exc}") from exc
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidInput(f"{what}: {shown(text)} is neither {_ISO_HINT}") from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


#: The largest sequence number (the ledger's ``seq`` is a Postgres BIGINT).
MAX_SEQ = 2**63 - 1


def parse_seq(text: str) -> int:
    """The ``before`` filter: a request's sequence number, ASCII digits within
    BIGINT's range; :class:`InvalidInput` otherwise."""
    if re.fullmatch(r"[0-9]{1,19}", text) is None or int(text) > MAX_SEQ:
        raise InvalidInput(
            f"before must be a request's sequence number (ASCII digits, at most {MAX_SEQ}), "
            f"not {shown(text)}; use the page's 'older' link"
        )
    return int(text)


@dataclass(frozen=True)
class Filters:
    """The requests list's filters, as given in the page's query string."""

    status: str | None = None
    session_id: str | None = None
    user_id: str | None = None
    agent: str | None = None
    since: str | None = None
    until: str | None = None
    before: int | None = None

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> Filters:
        """From query parameters; empty ones are absent. :class:`InvalidInput`
        names a bad one and what it takes."""
        known = {"status", "session", "user", "agent", "since", "until", "before"}
        unknown = sorted(set(params) - known)
        if unknown:
            raise InvalidInput(
                f"unknown filter {unknown[0]!r}; the list takes {', '.join(sorted(known))}"
            )
        given = {k: v.strip() for k, v in params.items() if v.strip()}
        status = given.get("status")
        if status is not None and status not in admin.STATUSES:
            raise InvalidInput(
                f"status {status!r} is not a status; one of {', '.join(admin.STATUSES)}"
            )
        for key, what in (("session", "session"), ("user", "user"), ("agent", "agent")):
            if key in given:
                check_id(what, given[key])
        before = None if "before" not in given else parse_seq(given["before"])
        return cls(status, given.get("session"), given.get("user"), given.get("agent"),
                   given.get("since"), given.get("until"), before)

    def window(self, now: datetime) -> tuple[datetime | None, datetime | None]:
        since = None if self.since is None else parse_when("since", self.since, now)
        until = None if self.until is None else parse_when("until", self.until, now)
        if since is not None and until is not None and since >= until:
            raise InvalidInput("since must be earlier than until")
        return since, until

    def query_string(self, **change: Any) -> dict[str, str]:
        """The filters as query parameters (for links), with ``change`` applied."""
        values = {
            "status": self.status, "session": self.session_id, "user": self.user_id,
            "agent": self.agent, "since": self.since, "until": self.until,
            "before": self.before, **change,
        }
        return {k: str(v) for k, v in values.items() if v is not None}


async def list_requests(
    pool: Pool, filters: Filters, *, limit: int = PAGE_SIZE
) -> list[RequestRow]:
    """One page of requests, newest first (``limit`` + 1 rows: one more says
    there is an older page)."""
    since, until = filters.window(datetime.now(UTC))
    async with pool.connection() as conn:
        return await ledger_views.list_requests(
            conn, RequestRow, status=filters.status, session_id=filters.session_id,
            user_id=filters.user_id, agent=filters.agent, since=since, until=until,
            before=filters.before, limit=limit + 1, prompt_chars=PROMPT_CHARS,
        )


#: How many runs made outside Celery the requests page lists.
DIRECT_RUNS = 20


async def direct_runs(pool: Pool, filters: Filters, *, limit: int = DIRECT_RUNS
                      ) -> list[admin.DirectRun]:
    """The latest runs made through PostgresRuntime outside Celery (of the
    filters' session and user), newest first: not requests, listed apart."""
    async with pool.connection() as conn:
        return await _rows(conn, "list_direct_runs", {
            "session_id": filters.session_id, "user_id": filters.user_id, "limit": limit,
        }, admin.DirectRun)


# ---- a session --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionRow(RequestRow):
    cancel_requested: bool = False
    holds_lock: bool = False


@dataclass
class ScopeView:
    """One (session, user) scope: its requests in order, the one holding or
    next to take the scope, and those waiting behind it."""

    user_id: str | None
    requests: list[SessionRow]
    head: SessionRow | None = None
    waiting: list[SessionRow] = field(default_factory=list)


async def session_scopes(pool: Pool, session_id: str) -> list[ScopeView]:
    """The session's latest requests, by scope (user), oldest first."""
    check_id("session", session_id)
    async with pool.connection() as conn:
        rows = await ledger_views.session_requests(
            conn, SessionRow, session_id, limit=PAGE_SIZE * 4, prompt_chars=PROMPT_CHARS
        )
    scopes: dict[str | None, ScopeView] = {}
    for row in reversed(rows):
        view = scopes.setdefault(row.user_id, ScopeView(row.user_id, []))
        view.requests.append(row)
        if row.status in ("queued", "running"):
            if view.head is None:
                view.head = row
            else:
                view.waiting.append(row)
    return list(scopes.values())


# ---- a run ------------------------------------------------------------------------------------


async def request_status(
    pool: Pool, request_id: str, *, full_prompt: bool = False
) -> admin.RequestDetail:
    """The request's ledger row (``show``'s read model, without its attempts
    and journal), or :class:`~loomflow_worker.admin.RequestNotFound`."""
    async with pool.connection() as conn:
        return await _request_row(conn, request_id, full_prompt=full_prompt)


async def _request_row(conn: Conn, request_id: str, *, full_prompt: bool) -> admin.RequestDetail:
    check_id("request", request_id)
    found = await ledger_views.request_row(conn, admin.RequestDetail, admin.request_params(
        request_id, prompt_chars=None if full_prompt else PROMPT_CHARS * 2,
    ))
    if found is None:
        raise admin.RequestNotFound(
            request_id, listed_by="the requests list shows the recent ones"
        )
    return found


async def get_request(
    pool: Pool, request_id: str, *, full_prompt: bool = False
) -> admin.RequestDetail:
    """A request, its attempts and its journal, each entry with the attempt
    that executed it and those that replayed it: the queries ``loomflow-worker
    show`` reads (``admin.get_request``), on the console's pool, the journal cut
    at ``MAX_JOURNAL`` entries."""
    async with pool.connection() as conn:
        try:
            run = await _request_row(conn, request_id, full_prompt=full_prompt)
        except admin.RequestNotFound:
            direct = await _direct_run(conn, request_id)
            if direct is None:
                raise
            return direct
        run.attempts = await ledger_views.request_attempts(conn, admin.AttemptInfo, request_id)
        run.upgrades = await ledger_views.request_upgrades(conn, admin.UpgradeInfo, request_id)
        if run.epoch is None:
            return run
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(
                query("get_run_journal"), admin.journal_params(run, limit=MAX_JOURNAL)
            )
            admin.add_journal(run, await cur.fetchall(), limit=MAX_JOURNAL)
    return run


async def _direct_run(conn: Conn, run_id: str) -> admin.RequestDetail | None:
    """A run made outside Celery read as a request of kind ``direct``, with
    its journal (as ``show`` reads it), or ``None``."""
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(query("get_direct_run"), {"request_id": run_id})
        row = await cur.fetchone()
        if row is None:
            return None
        run = admin.direct_detail(row)
        await cur.execute(query("get_run_journal"), admin.journal_params(run, limit=MAX_JOURNAL))
        admin.add_journal(run, await cur.fetchall(), limit=MAX_JOURNAL)
    return run


# ---- the fleet --------------------------------------------------------------------------------


@dataclass(frozen=True)
class InFlight:
    worker: str | None
    running: int
    oldest_start: datetime | None
    last_heartbeat: datetime | None
    stalest_heartbeat: datetime | None


@dataclass(frozen=True)
class WorkerSeen:
    worker: str
    hostname: str
    pid: int
    slots: int
    runs: int
    heartbeat_interval: float
    started_at: datetime
    seen_at: datetime
    stopped_at: datetime | None
    loop_lag: float
    lock_queue: int
    admitting: bool
    state: str


@dataclass(frozen=True)
class RecentWorker:
    worker: str
    attempts: int
    last_start: datetime
    died: int
    interrupted: int


@dataclass(frozen=True)
class Connections:
    application_name: str
    client_addr: str | None
    connections: int
    oldest: datetime | None


@dataclass(frozen=True)
class Leader:
    worker: str
    backend_pid: int
    heartbeat_at: datetime
    age: timedelta
    connected: bool


@dataclass(frozen=True)
class Swept:
    request_id: str
    session_id: str
    user_id: str | None
    status: str
    attempts: int
    swept_at: datetime


@dataclass(frozen=True)
class SweeperAction:
    id: int
    at: datetime
    worker: str
    action: str
    request_id: str | None
    detail: str


@dataclass(frozen=True)
class QueueDepth:
    ready: int
    backing_off: int
    running: int
    oldest_queued: datetime | None


@dataclass(frozen=True)
class KeyBacklog:
    fairness_key: str
    queued: int
    on_limit: int
    running: int


@dataclass(frozen=True)
class LimitUse:
    name: str
    max_runs: int
    updated_at: datetime
    source: str
    set_by: str | None
    waiting: int


@dataclass(frozen=True)
class Budget:
    key: str
    rpm: int | None
    tpm: int | None
    burst: float
    paused_for: float
    updated_at: datetime


@dataclass
class FleetView:
    workers: list[WorkerSeen]
    in_flight: list[InFlight]
    recent: list[RecentWorker]
    connections: list[Connections]
    leader: Leader | None
    swept: list[Swept]
    actions: list[SweeperAction]
    queue: QueueDepth
    limits: list[LimitUse] = field(default_factory=list)
    keys: list[KeyBacklog] = field(default_factory=list)
    budgets: list[Budget] = field(default_factory=list)
    cost_budgets: list[BudgetRow] = field(default_factory=list)
    versions: list[VersionInfo] = field(default_factory=list)
    now: datetime = field(default_factory=lambda: datetime.now(UTC))


#: The fairness keys the fleet page lists, the most waiting first.
MAX_KEYS = 20


async def fleet(pool: Pool) -> FleetView:
    """The fleet page's reads, one after another on one connection."""
    async with pool.connection() as conn:
        return FleetView(
            workers=await _rows(conn, "console_workers",
                                {"window": WORKERS_WINDOW, "limit": MAX_WORKERS}, WorkerSeen),
            in_flight=await ledger_views.in_flight(conn, InFlight),
            recent=await ledger_views.recent_attempts(conn, RecentWorker, window=RECENT_WINDOW),
            connections=await _rows(conn, "console_connections", {}, Connections),
            leader=next(iter(await _rows(conn, "console_leader", {}, Leader)), None),
            swept=await ledger_views.swept(conn, Swept, limit=20),
            actions=await _rows(conn, "console_sweeper_actions", {"limit": MAX_ACTIONS},
                                SweeperAction),
            queue=await ledger_views.queue_depth(conn, QueueDepth),
            limits=await ledger_views.concurrency_limits(conn, LimitUse),
            keys=await ledger_views.key_backlog(conn, KeyBacklog, limit=MAX_KEYS),
            budgets=await _rows(conn, "model_budgets", {}, Budget),
            cost_budgets=await budgets.read_async(conn),
            versions=await ledger_views.agent_versions(conn, VersionInfo),
        )


# ---- the usage page ---------------------------------------------------------------------------


@dataclass(frozen=True)
class UsageView:
    """The usage page: its groups, their total, and the window it read."""

    by: str
    since: datetime
    rows: list[UsageRow]
    total: UsageRow


async def usage(pool: Pool, by: str, since: datetime) -> UsageView:
    """Tokens, cost, requests and replay savings per group of the requests
    enqueued since ``since`` (as ``loomflow-worker usage``)."""
    params = usage_params(by, since)
    async with pool.connection() as conn:
        rows = ordered(by, await ledger_views.usage_report(conn, UsageRow, params))
    return UsageView(by, since, rows, totals(rows))
