"""One settings object, read from ``LOOMFLOW_WORKER_*`` environment variables."""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, Literal

import psycopg
from psycopg.conninfo import conninfo_to_dict
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict, SettingsError

#: The shortest console token accepted.
MIN_TOKEN_LENGTH = 16
#: A host as the Host header names it, without its port: a DNS name or an IPv4
#: address, or an IPv6 address in brackets.
HOST_NAME = re.compile(r"[a-z0-9_](?:[a-z0-9_.-]*[a-z0-9_])?\.?|\[[0-9a-f:.]+\]", re.I)


#: The largest fairness weight: a key's share of the fleet is its weight over
#: the weights of the keys with work waiting.
MAX_WEIGHT = 1e6
#: The longest model key, fairness key or limit name, in bytes.
MAX_KEY_BYTES = 64


class ModelLimit(BaseModel):
    """A model key's budget for the whole fleet: requests and tokens (input
    and output) per minute, either may be left out, not both; and how much of
    it may go at once."""

    model_config = ConfigDict(extra="forbid")

    rpm: int | None = Field(default=None, gt=0)
    tpm: int | None = Field(default=None, gt=0)
    # Seconds' worth of the limits that may go at once after a quiet spell: a
    # minute, as providers meter a key (a token bucket of a minute's capacity).
    burst: float = Field(default=60.0, ge=0, le=3600)

    @model_validator(mode="after")
    def _some_limit(self) -> ModelLimit:
        if self.rpm is None and self.tpm is None:
            raise ValueError("give rpm (requests per minute), tpm (tokens per minute) or both")
        return self


class ModelPrice(BaseModel):
    """A model key's price in US dollars per million tokens, as negotiated:
    input (not served from the prompt cache), output, and the prompt cache's
    reads and writes (each the input price when left out)."""

    model_config = ConfigDict(extra="forbid")

    input: float = Field(ge=0, strict=True)
    output: float = Field(ge=0, strict=True)
    cache_read: float | None = Field(default=None, ge=0, strict=True)
    cache_write: float | None = Field(default=None, ge=0, strict=True)


#: A budget's units, periods (UTC calendar ones) and what an enqueue does while
#: it is spent.
BUDGET_UNITS = ("tokens", "usd")
BUDGET_PERIODS = ("day", "month")
BUDGET_OVER = ("wait", "refuse")
#: The largest budget amount (tokens or dollars) the ledger stores.
MAX_BUDGET = Decimal(10) ** 18


class Budget(BaseModel):
    """A fairness key's or an agent's budget for the whole fleet: ``amount``
    tokens (input, output and cache) or US dollars per UTC calendar ``period``;
    ``over`` says what an enqueue does while it is spent: ``wait`` (accepted,
    the request waits in the ledger) or ``refuse`` (the enqueue raises). In
    settings, JSON such as ``{"tokens": 1000000, "per": "day"}`` or
    ``{"usd": 50, "per": "month", "over": "refuse"}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    amount: Decimal
    unit: Literal["tokens", "usd"]
    period: Literal["day", "month"] = "day"
    over: Literal["wait", "refuse"] = "wait"

    @model_validator(mode="before")
    @classmethod
    def _from_json(cls, value: Any) -> Any:
        if not isinstance(value, dict) or "amount" in value:
            return value
        units = [unit for unit in BUDGET_UNITS if unit in value]
        unknown = sorted(set(value) - {*BUDGET_UNITS, "per", "over"})
        if unknown:
            raise ValueError(f"unknown unit or field {unknown[0]!r}: a budget is "
                             '{"tokens": N} or {"usd": N}, with "per" (day or month) and '
                             '"over" (wait or refuse)')
        if len(units) != 1:
            raise ValueError("give the budget in tokens or in usd (one of them), e.g. "
                             '{"tokens": 1000000, "per": "day"}')
        budget = budget_of(value[units[0]], units[0], value.get("per", "day"),
                           value.get("over", "wait"))
        return budget.model_dump()


def budget_of(amount: Any, unit: Any, period: Any = "day", over: Any = "wait") -> Budget:
    """A budget from its parts, as settings and ``loomflow-worker limits budget``
    give them; a ``ValueError`` saying what is wrong with the first bad one."""
    if unit not in BUDGET_UNITS:
        raise ValueError(f"unknown budget unit {unit!r}: tokens or usd")
    if period not in BUDGET_PERIODS:
        raise ValueError(f"unknown budget period {period!r}: day or month (UTC calendar "
                         "days and months)")
    if over not in BUDGET_OVER:
        raise ValueError(f"unknown budget action {over!r}: wait (the request waits in the "
                         "ledger) or refuse (the enqueue raises)")
    try:
        if isinstance(amount, bool) or (isinstance(amount, float) and not math.isfinite(amount)):
            raise InvalidOperation
        value = Decimal(str(amount).replace(",", "").replace("_", "").strip())
    except (InvalidOperation, ValueError):
        raise ValueError(f"a budget is a positive number of {unit}, not {amount!r}") from None
    if not value.is_finite() or value <= 0 or value > MAX_BUDGET:
        raise ValueError(f"a budget is a positive number of {unit}, not {amount!r}")
    if unit == "tokens" and value != value.to_integral_value():
        raise ValueError(f"a budget in tokens is a whole number, not {amount!r}")
    return Budget.model_construct(amount=value, unit=unit, period=period, over=over)


def check_budget_name(name: str) -> str:
    """A budget's name: a fairness key (a tenant), or ``agent:NAME``."""
    return _agent_or(name, "fairness key")


def _agent_or(name: str, what: str) -> str:
    """``name`` checked as ``agent:NAME`` (an agent's), else as a ``what``."""
    if name.startswith("agent:"):
        check_key(name.removeprefix("agent:"), "agent name")
    else:
        check_key(name, what)
    return name


def check_key(key: str, what: str = "model key") -> str:
    """A model key, fairness key or limit name: 1 to 64 bytes, printable."""
    article = "an" if what[:1] in "aeiou" else "a"
    if not isinstance(key, str) or not key.strip() or not key.isprintable():
        raise ValueError(f"{article} {what} is a non-empty printable name")
    if len(key.encode()) > MAX_KEY_BYTES:
        raise ValueError(f"{article} {what} is at most {MAX_KEY_BYTES} bytes")
    return key


def check_weight(weight: Any) -> float:
    """A fairness weight: a positive finite number (1 is the default)."""
    if (isinstance(weight, bool) or not isinstance(weight, (int, float))
            or not math.isfinite(weight) or weight <= 0 or weight > MAX_WEIGHT):
        shown = weight if isinstance(weight, (int, float)) else type(weight).__name__
        raise ValueError(f"a fairness weight is a positive number up to {MAX_WEIGHT:g}, "
                         f"not {shown!r}")
    return float(weight)


def check_limit_name(name: str) -> str:
    """A concurrency limit's name: ``per_key``, ``agent:NAME`` or a shared name."""
    return _agent_or(name, "limit name")


#: The fewest heartbeat intervals a lease may last: a process fences runs no
#: heartbeat stamped for an interval and a half (see ``fence_after``), checked
#: each interval, before the sweeper may act.
LEASE_HEARTBEATS = 3


def lease_covers_heartbeats(lease_timeout: float, heartbeat_interval: float) -> bool:
    """Whether a lease of ``lease_timeout`` lasts :data:`LEASE_HEARTBEATS`
    heartbeat intervals (a hair less is taken as the same: 0.3 against 3 x 0.1)."""
    return lease_timeout >= LEASE_HEARTBEATS * heartbeat_interval * (1 - 1e-9)


class Settings(BaseSettings):
    """Where the fleet's services are and how runs behave.

    Every field reads ``LOOMFLOW_WORKER_<NAME>``; e.g.
    ``LOOMFLOW_WORKER_DATABASE_URL``. ``AGENTS`` is a comma-separated list
    of modules that register agents, imported by every worker at start and
    by an application before it enqueues."""

    # Errors name the setting and the problem, never the value (it may hold a
    # password).
    model_config = SettingsConfigDict(
        env_prefix="LOOMFLOW_WORKER_", extra="ignore", hide_input_in_errors=True
    )

    database_url: SecretStr = SecretStr("postgresql://postgres@127.0.0.1:5432/postgres")
    """The Postgres that holds the journal and the ledger (a direct connection or a
    session-mode pool)."""
    broker_url: SecretStr = SecretStr("redis://127.0.0.1:6379/0")
    """The Celery broker: Redis or RabbitMQ."""
    result_backend: SecretStr = SecretStr("redis://127.0.0.1:6379/1")
    """The Celery result backend."""
    agents: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Comma-separated modules that register agents, imported by every worker at start."""
    queue: str = "loomflow"
    """The queue requests go to; a request pinned to a version of its agent waits in
    ``<queue>@<agent>@<version>`` for a worker of it."""
    redis_key_prefix: str = ""
    """A prefix for every broker and result key in Redis."""
    # Whether the worker takes new requests from its queues. False: it takes
    # only the requests pinned to its agents' versions (their versions'
    # queues), as the old release of a rolling deploy that changed an agent
    # does while it drains (deploy/OPERATIONS.md).
    take_new: bool = True

    # Retries of errors that are not crashes, with jittered exponential backoff.
    max_retries: int = Field(default=3, ge=0)
    retry_backoff: float = Field(default=1.0, gt=0)
    retry_backoff_max: float = Field(default=60.0, gt=0)
    # A request whose worker died this many times while running it ends `dead`.
    max_crashes: int = Field(default=3, ge=1)
    # A request whose attempts lost their lock connection this many times in a
    # row without completing a step (its process stalled past LEASE each time)
    # ends `dead`. A death shared with other runs of a process counts toward
    # max_crashes only once the request ran alone (see the README).
    max_lost: int = Field(default=5, ge=2)
    # Processes of quarantine one worker process runs at once, each with
    # connections of its own: one runs a request alone, or up to
    # quarantine_group suspects at once; a request that finds no room in
    # them goes back to the queue, for any worker with room.
    alone_at_once: int = Field(default=4, ge=1)
    # Requests that died with other runs of their process twice in a row
    # without completing a step run together, at most this many at once in a
    # process of quarantine; each that dies there again runs alone (1: alone
    # at once).
    quarantine_group: int = Field(default=8, ge=1)

    # Bad input refused at enqueue.
    max_prompt_chars: int = Field(default=200_000, ge=1)
    max_metadata_bytes: int = Field(default=65_536, ge=2)

    # A running request whose worker died is dispatched again at once, then
    # again only after this long (or handoff_grace, below, once its queue has
    # lost that copy); a queued request whose message may be lost while the
    # broker can't say how many messages it holds, after this long.
    redispatch_after: float = Field(default=60.0, gt=0)
    # A queued request nobody received for this long, beyond the messages the
    # broker still holds (a backlog waits its turn), has lost its message; so
    # has the copy of a running request whose worker died, sent again.
    handoff_grace: float = Field(default=5.0, gt=0)
    # The broker's visibility timeout: longer than the longest run, so the
    # broker itself never starts a second copy of a running request.
    visibility_timeout: int = Field(default=6 * 3600, gt=0)
    # Extra kombu transport options, as JSON (e.g. Redis sentinel settings).
    broker_transport_options: dict[str, Any] = Field(default_factory=dict)

    # Recovery. A running request stamps a heartbeat every heartbeat_interval
    # seconds; one silent for longer than lease_timeout (a frozen worker) has
    # its lock connection ended by the sweeper, which also re-dispatches
    # requests whose worker died. One sweeper leads the fleet at a time.
    heartbeat_interval: float = Field(default=2.0, gt=0)
    # The lease's timeout, read from LOOMFLOW_WORKER_LEASE, the variable's first
    # name, which deployments set; at least three heartbeat intervals.
    lease_timeout: float = Field(default=30.0, gt=0, validation_alias="LOOMFLOW_WORKER_LEASE")
    sweep_interval: float = Field(default=1.0, gt=0)
    """How often (seconds) the fleet's sweeper looks for orphaned requests."""
    sweeper: bool = True
    """Whether this worker runs a sweeper (off: it also stamps no held messages)."""
    # A run longer than this (seconds) ends `failed` with a timeout; an agent
    # can set its own with register_agent(name, time_limit=...).
    run_time_limit: float = Field(default=3600.0, gt=0)
    # Rolling deploys: SIGTERM starts Celery's soft shutdown, which lets runs
    # go on this long before they are stopped and requeued. Keep it below
    # the orchestrator's grace period.
    soft_shutdown_timeout: float = Field(default=20.0, ge=0)

    # Live events: a bounded Redis stream per request (default: the result
    # backend's or the broker's Redis), kept this long after its last event.
    events: bool = True
    events_url: SecretStr | None = None
    events_maxlen: int = Field(default=10_000, ge=10)
    events_retention: float = Field(default=86_400.0, gt=0)
    # Prometheus metrics, served by each worker's main process (0: off).
    metrics_port: int = Field(default=0, ge=0, le=65535)
    # Finished requests, their journals and checkpoints older than this many
    # seconds are pruned by the sweeper's leader (0: never).
    retention: float = Field(default=0.0, ge=0)
    # Undelivered signals kept per scope (session, user): a send drops the
    # oldest past this many, with a warning and a metric (0: no bound).
    signals_per_scope: int = Field(default=1000, ge=0)

    # Runs one worker process carries at once on its event loop
    # (`loomflow-worker worker`, Celery's threads pool), and the lock
    # connections they share: each holds the session locks of many runs and
    # carries their journal writes, so Postgres connections per process stay
    # LOCK_CONNECTIONS + POOL_MAX_SIZE + 1 (the sweeper), whatever the runs.
    concurrency: int = Field(default=100, ge=1, le=10_000)
    lock_connections: int = Field(default=2, ge=1, le=64)
    pool_min_size: int = Field(default=1, ge=0)
    """The per-process pool for work outside a run: its fewest connections."""
    pool_max_size: int = Field(default=2, ge=1)
    """The per-process pool for work outside a run: its most connections."""
    connect_timeout: int = Field(default=10, ge=1)
    """Seconds a new Postgres connection may take."""
    lock_io_timeout: float = Field(default=30.0, gt=0)
    """A lock connection silent this long (while the loop could read its answer) fences
    its runs."""

    # Admission: a worker process stops taking requests from the broker while
    # its event loop runs later than admission_lag seconds, or while more
    # than admission_queue statements wait for its lock connections, and
    # takes them again once it has caught up; --concurrency is the ceiling.
    # A loop held longer than loop_stall_warning seconds is logged, naming
    # the request and step that held it.
    admission_lag: float = Field(default=0.5, gt=0)
    admission_queue: int = Field(default=200, ge=1)
    loop_stall_warning: float = Field(default=1.0, gt=0)

    # Model-call budgets for the whole fleet, by model key (an agent's
    # register_agent(model_key=...), else its model's name), as JSON: e.g.
    # {"anthropic": {"rpm": 300, "tpm": 400000}}. Written to the database at
    # each worker's start; `loomflow-worker limits` changes them at run time.
    # A 429 or 529 from the provider pauses the key's calls in every case.
    model_limits: dict[str, ModelLimit] = Field(default_factory=dict)
    # Prices in US dollars per million tokens, by model key (or model name), as
    # JSON: e.g. {"anthropic": {"input": 3.0, "output": 15.0, "cache_read": 0.3,
    # "cache_write": 3.75}}. They override the maintained price table
    # (genai-prices) for negotiated prices; a model in neither has its tokens
    # counted and its price reported unknown.
    prices: dict[str, ModelPrice] = Field(default_factory=dict)
    # Label the token and cost counters with the fairness key (tenant) as well:
    # one series per tenant, so only for a bounded number of tenants.
    usage_metrics_by_key: bool = False
    # Concurrency limits for the whole fleet, as JSON: at most N requests in
    # flight per fairness key ("per_key"), per agent ("agent:NAME"), or per
    # name agents share (register_agent(limits=[...])): e.g. {"per_key": 20,
    # "anthropic": 200}. Written at each worker's start and at a process's
    # first enqueue; `loomflow-worker limits concurrency` changes them at run
    # time. Fair shares are on by default: what waits in the broker follows
    # the fleet's free slots, and the rest wait their fair turn in the ledger;
    # "fair_queue": N fixes that bound at N, "fair_queue": 0 turns them off.
    limits: dict[str, StrictInt] = Field(default_factory=dict)
    # The weights of fairness keys, as JSON (e.g. {"acme": 3}): requests
    # waiting their fair turn are published in
    # proportion to the weights of the keys they belong to (1 by default).
    # Written at each worker's start; `loomflow-worker limits weight` changes
    # them at run time.
    fairness_weights: dict[str, float] = Field(default_factory=dict)
    # Cost budgets for the whole fleet, by fairness key (a tenant) or
    # "agent:NAME", as JSON: tokens (input, output and cache) or US dollars per
    # UTC calendar day or month, e.g. {"acme": {"tokens": 1000000, "per":
    # "day"}, "agent:research": {"usd": 50, "per": "month", "over": "refuse"}}.
    # A request whose key or agent has spent its budget waits in the ledger
    # until the period rolls over or the budget is raised ("over": "wait", the
    # default), or is refused at enqueue ("over": "refuse"); a run under way
    # finishes, even past its budget. Written at each worker's start and at a
    # process's first enqueue; `loomflow-worker limits budget` changes them at
    # run time and holds over settings.
    budgets: dict[str, Budget] = Field(default_factory=dict)
    # A run whose model call must wait longer than this (seconds) for its
    # key's budget or its provider gives its slot back and is resumed then,
    # from its journal, on any worker (0: it always waits in its slot).
    park_after: float = Field(default=30.0, ge=0)

    # The run console (`loomflow-worker console`): the token a request from
    # anywhere but loopback must present, and any cancel from its pages.
    console_token: SecretStr | None = None
    # Host names (the Host header) the console answers besides loopback's and
    # its --host: a public name it is reached by. Any other gets 400, so a
    # page of another site rebound to the console's address reads nothing.
    console_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Want the token from loopback clients too: a TCP forwarder on this host
    # (socat, ssh -L, stunnel) makes every client it forwards look local.
    console_require_token: bool = False
    # How long a login (the console's cookie) lasts, in seconds.
    console_login_lifetime: float = Field(default=43_200.0, gt=0, le=366 * 86_400)
    # The console is behind a proxy that terminates TLS: believe its
    # X-Forwarded-Proto, to mark the login cookie Secure.
    console_trust_proxy: bool = False

    @field_validator("agents", mode="before")
    @classmethod
    def _split_agents(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("limits")
    @classmethod
    def _check_limits(cls, value: dict[str, int]) -> dict[str, int]:
        for name, max_runs in value.items():
            check_limit_name(name)
            if name == "fair_queue" and max_runs == 0:
                continue  # fair shares off
            if max_runs < 1:
                raise ValueError(f"limit {name!r}: at most how many runs, a positive integer"
                                 + (" (0 turns fair shares off)" if name == "fair_queue" else ""))
        return value

    @field_validator("fairness_weights", mode="before")
    @classmethod
    def _check_weights(cls, value: Any) -> Any:
        if isinstance(value, dict):
            for key, weight in value.items():
                check_key(key, "fairness key")
                check_weight(weight)
        return value

    @field_validator("budgets", mode="before")
    @classmethod
    def _check_budget_names(cls, value: Any) -> Any:
        if isinstance(value, dict):
            for name in value:
                check_budget_name(name)
        return value

    @field_validator("model_limits", "prices")
    @classmethod
    def _check_model_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in value:
            check_key(key)
        return value

    @field_validator("console_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, list):
            for host in value:
                if not isinstance(host, str) or HOST_NAME.fullmatch(host) is None:
                    raise ValueError(
                        "each entry is a host name or address as browsers send it in the "
                        "Host header, without scheme, port or path (console.example.com, "
                        "10.0.0.5, [2001:db8::5])"
                    )
            return [host.lower().rstrip(".") for host in value]
        return value

    @field_validator("console_token")
    @classmethod
    def _check_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None
        token = value.get_secret_value()
        if len(token) < MIN_TOKEN_LENGTH or not token.isprintable() or token != token.strip():
            raise ValueError(
                f"must be at least {MIN_TOKEN_LENGTH} printable characters with no leading "
                "or trailing space (e.g. from `python -c 'import secrets; "
                "print(secrets.token_urlsafe(32))'`)"
            )
        return value

    @field_validator("database_url", "broker_url", "result_backend")
    @classmethod
    def _check_url(cls, value: SecretStr, info: ValidationInfo) -> SecretStr:
        # The messages never quote the value: it may hold a password.
        if info.field_name == "database_url":
            problem = conninfo_problem(value.get_secret_value())
            if problem:
                problem = f"not a connection string libpq accepts: {problem}"
        elif info.field_name == "broker_url":
            problem = broker_problem(value.get_secret_value())
        else:
            problem = result_backend_problem(value.get_secret_value())
        if problem:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _check_consistency(self) -> Settings:
        if self.retry_backoff_max < self.retry_backoff:
            raise ValueError(
                f"retry_backoff_max ({self.retry_backoff_max}) is below retry_backoff "
                f"({self.retry_backoff})"
            )
        if self.console_require_token and self.console_token is None:
            raise ValueError(
                "console_require_token is on but console_token is not set: set "
                "LOOMFLOW_WORKER_CONSOLE_TOKEN, or nobody could open the console"
            )
        if not lease_covers_heartbeats(self.lease_timeout, self.heartbeat_interval):
            raise ValueError(
                f"lease_timeout (LOOMFLOW_WORKER_LEASE, {self.lease_timeout}s) must be at "
                f"least three heartbeat intervals (heartbeat_interval "
                f"{self.heartbeat_interval}s: {LEASE_HEARTBEATS * self.heartbeat_interval:g}s "
                "or more): a process fences runs not stamped for an interval and a half, "
                "and the sweeper must not act before it; raise LEASE or lower "
                "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _lease_timeout_given_in_code(cls, data: Any) -> Any:
        """``Settings(lease_timeout=...)``, or ``lease=``, the duration's first
        name, sets :attr:`lease_timeout`, which is read from the variable of
        another name (an unknown name would be ignored silently). Only
        LOOMFLOW_WORKER_LEASE is read from the environment."""
        if isinstance(data, dict) and ("lease_timeout" in data or "lease" in data):
            # Under the variable's name, overriding the environment's value.
            data = dict(data)
            given = data.pop("lease_timeout", None)
            first = data.pop("lease", None)
            data["LOOMFLOW_WORKER_LEASE"] = given if given is not None else first
        return data

    @property
    def lease(self) -> float:
        """:attr:`lease_timeout` by its first name, for code that reads it."""
        return self.lease_timeout

    @property
    def is_redis_broker(self) -> bool:
        return self.broker_url.get_secret_value().startswith(("redis://", "rediss://"))


# A quoted part of a libpq parse error: a piece of the connection string given,
# which may be its password.
_QUOTED = re.compile(r'"([^"]*)"')


def conninfo_problem(conninfo: str) -> str | None:
    """Why libpq can't parse ``conninfo`` (its quoted pieces masked), or ``None``."""
    try:
        conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return _QUOTED.sub(lambda m: m[0] if len(m[1]) <= 1 else '"***"', text)
    scheme, url, rest = conninfo.strip().partition("://")
    if url and scheme in ("postgres", "postgresql") and re.split(r"[/?#]", rest)[0].count("@") > 1:
        # libpq takes the last "@" for the end of the host's name, so the
        # password's tail would show wherever the host is named.
        return 'more than one "@" before the host: percent-encode an "@" in the password as %40'
    return None


# Schemes kombu and Celery have always known, accepted without importing them
# (reading their tables loads Celery, which a command like `requests` never needs);
# any other scheme is looked up in their tables.
COMMON_TRANSPORTS = frozenset({"redis", "rediss", "amqp", "amqps", "pyamqp"})
COMMON_BACKENDS = frozenset({"redis", "rediss", "rpc"})


def broker_problem(url: str) -> str | None:
    """Why kombu has no transport for ``url`` (or any of its ``;``-separated
    failover URLs), or ``None``. The URL itself is never quoted."""
    for one in url.split(";"):
        scheme, found, _ = one.strip().partition("://")
        transport = scheme.split("+", 1)[0]
        if found and transport in COMMON_TRANSPORTS:
            continue
        from kombu.transport import TRANSPORT_ALIASES

        if not found or transport not in TRANSPORT_ALIASES:
            return (
                f"unknown broker transport {transport!r}" if found and transport.isidentifier()
                else "not a broker URL (scheme://...)"
            ) + "; use redis://, rediss:// or amqp:// (or another kombu transport)"
    return None


def result_backend_problem(url: str) -> str | None:
    """Why Celery has no result backend for ``url``, or ``None``. A scheme
    that names a class by its dotted path is left to Celery."""
    scheme, found, _ = url.strip().partition("://")
    backend = scheme.split("+", 1)[0]
    if found and backend in COMMON_BACKENDS:
        return None
    from celery.app.backends import BACKEND_ALIASES

    if not found or backend in BACKEND_ALIASES or "." in backend or ":" in backend:
        return None
    shown = repr(backend) if backend.isidentifier() else "in the URL"
    return (
        f"unknown result backend {shown}; use redis:// or rediss:// (or another Celery "
        "result backend)"
    )


def validation_message(exc: ValidationError | SettingsError) -> str:
    """A settings error as ``field: message`` lines, without the values given
    (pydantic's own text repeats them, connection strings included). A value
    that is not even JSON (a dict or list setting) is named with the parser's
    complaint, which quotes no part of it."""
    if isinstance(exc, SettingsError):
        cause = exc.__cause__
        detail = f": {first_line(cause)}" if isinstance(cause, ValueError) else ""
        return f"{exc}{detail}; dict and list settings are read as JSON"
    lines = []
    for error in exc.errors(include_url=False, include_input=False):
        where = ".".join(str(part) for part in error["loc"]) or "settings"
        lines.append(f"{where}: {error['msg']}")
    return "; ".join(lines)


def first_line(exc: BaseException) -> str:
    """The first line of an error's text (its type when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
