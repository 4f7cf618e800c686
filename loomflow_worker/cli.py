"""The ``loomflow-worker`` command.

Each command imports what it uses when it runs: the driver, the settings,
Celery, the console and the demo cost a command that needs them only, so
the help and the operator commands start at once."""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any, ParamSpec

import click

from .defaults import CONSOLE_PORT, MAX_LIST
from .execution.statuses import STATUSES

if TYPE_CHECKING:
    from .settings import Settings

# Exit codes scripts can rely on (listed in the group's help).
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_NOT_FOUND = 4
EXIT_BUSY = 5
EXIT_TIMEOUT = 6

_STATUS_EXIT = {"succeeded": EXIT_OK}

P = ParamSpec("P")

# Passwords of the configured connection strings: scrubbed from every error shown.
_secrets: list[str] = []


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Durable loomflow agent runs on Postgres and Celery.

    Settings come from LOOMFLOW_WORKER_* environment variables (see the README).

    \b
    Exit codes:
      0  ok (the request succeeded; every doctor check passed)
      1  the request failed, ended dead or was cancelled; a doctor check failed;
         or the operator declined a prompt
      2  usage error: bad arguments, input or settings
      3  Postgres, the broker or Redis unavailable, or the schema missing
      4  no such request
      5  the session is busy (enqueue --on-busy reject)
      6  timed out (enqueue --wait --timeout, tail --idle-timeout)"""
    # The pool's own retries would repeat what the error message says.
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)


# ---- shared pieces --------------------------------------------------------------------------


def _fail(code: int, message: str) -> None:
    from . import admin

    click.echo(f"error: {admin.redact(message, _secrets)}", err=True)
    sys.exit(code)


def _settings() -> Settings:
    """The settings from the environment, or exit 2 naming what is wrong (never the
    values given: they may hold passwords)."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from . import admin
    from .settings import Settings

    try:
        settings = Settings()
    except (ValidationError, SettingsError) as exc:
        _fail(EXIT_USAGE, f"bad LOOMFLOW_WORKER_* settings: {admin.validation_message(exc)}")
        raise AssertionError("unreachable") from exc
    _secrets[:] = admin.secrets_of(settings)
    return settings


def _broker_errors() -> tuple[type[BaseException], ...]:
    import kombu.exceptions
    import redis

    return (kombu.exceptions.OperationalError, redis.ConnectionError, redis.TimeoutError,
            ConnectionError)


def handled(fn: Callable[P, None]) -> Callable[P, None]:
    """Errors as a one-line message and the exit code the group's help lists."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> None:
        import psycopg

        from .admin import RequestNotFound, redact
        from .runtime.errors import (
            DatabaseUnavailable,
            InvalidInput,
            LoomflowWorkerError,
            SchemaError,
            SessionBusy,
            translated,
        )
        from .runtime.validate import check_text

        try:
            for name, value in kwargs.items():
                # Bytes that are not UTF-8 reach Python as lone surrogates.
                if isinstance(value, str):
                    check_text(name, value)
            with translated("query"):
                fn(*args, **kwargs)
        except (click.ClickException, click.exceptions.Abort, click.exceptions.Exit):
            raise  # click's own: usage errors (exit 2), a declined prompt (exit 1)
        except RequestNotFound as exc:
            _fail(EXIT_NOT_FOUND, str(exc))
        except SessionBusy as exc:
            _fail(EXIT_BUSY, str(exc))
        except InvalidInput as exc:
            _fail(EXIT_USAGE, str(exc))
        except (DatabaseUnavailable, SchemaError) as exc:
            _fail(EXIT_UNAVAILABLE, str(exc))
        except psycopg.ProgrammingError as exc:
            _fail(EXIT_USAGE, f"Postgres refused the connection string or a query: {exc}")
        except psycopg.Error as exc:
            _fail(EXIT_UNAVAILABLE, f"Postgres: {type(exc).__name__}: {exc}")
        except TimeoutError as exc:
            _fail(EXIT_TIMEOUT, str(exc) or "timed out")
        except _broker_errors() as exc:
            _fail(EXIT_UNAVAILABLE, f"broker or Redis unavailable: {exc}")
        except LoomflowWorkerError as exc:
            _fail(EXIT_FAILED, str(exc))
        except Exception:
            # Unexpected: the traceback, with every configured password scrubbed.
            click.echo(redact(traceback.format_exc(), _secrets), err=True)
            sys.exit(EXIT_FAILED)

    return wrapper


if TYPE_CHECKING:
    _DurationParam = click.ParamType[timedelta, Any]
    _JsonParam = click.ParamType[Any, Any]
else:  # click before 8.2 has no generic ParamType
    _DurationParam = _JsonParam = click.ParamType


class Duration(_DurationParam):
    """``30d``, ``12h``, ``90m``, ``45s``, or combinations like ``1d12h``."""

    name = "duration"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> timedelta:
        from .durations import parse_duration
        from .runtime.errors import InvalidInput

        if isinstance(value, timedelta):
            return value
        try:
            return parse_duration(str(value))
        except InvalidInput as exc:
            self.fail(str(exc), param, ctx)


class JsonValue(_JsonParam):
    name = "json"

    def __init__(self, *, object_only: bool = False) -> None:
        self.object_only = object_only

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        try:
            parsed = json.loads(value)
        except ValueError as exc:
            self.fail(f"not JSON ({exc}): {value!r}", param, ctx)
        if self.object_only and not isinstance(parsed, dict):
            self.fail(f"must be a JSON object, like '{{\"k\": \"v\"}}', not {value!r}", param, ctx)
        return parsed


def _when(value: datetime | float | None, *, precise: bool = False) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        value = datetime.fromtimestamp(value, tz=UTC)
    value = value.astimezone(UTC)
    if precise:
        return value.strftime("%H:%M:%S.") + f"{value.microsecond // 1000:03d}"
    return value.strftime("%Y-%m-%d %H:%M:%S")


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> Iterator[str]:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    for line in (headers, *rows):
        yield "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(value, default=str, sort_keys=True))


# ---- worker, migrate ------------------------------------------------------------------------


@main.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@click.option("-c", "--concurrency", type=click.IntRange(min=1), default=None,
              help="Runs at once in this process (default: LOOMFLOW_WORKER_CONCURRENCY, 100).")
@click.option("-P", "--pool", "pool_kind", type=click.Choice(["threads", "prefork", "solo"]),
              default="threads", show_default=True,
              help="threads: one process carries --concurrency runs on its event loop; "
                   "prefork: one run per child process (CPU-heavy agents); solo: one run.")
@click.option("-n", "--hostname", default=None, help="Node name, e.g. worker1@%h.")
@click.option("-l", "--loglevel", default="INFO", show_default=True)
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
def worker(
    concurrency: int | None,
    pool_kind: str,
    hostname: str | None,
    loglevel: str,
    celery_args: tuple[str, ...],
) -> None:
    """Start a worker with the package's defaults.

    One process carries up to --concurrency runs at once on its event loop
    (agent runs wait on the model, not the CPU); to use more cores, run one
    worker per core (more pods or containers). SIGTERM starts Celery's soft
    shutdown (REMAP_SIGTERM=SIGQUIT): runs go on for
    LOOMFLOW_WORKER_SOFT_SHUTDOWN_TIMEOUT seconds, then are stopped and
    requeued at once, to resume on another worker; an idle worker stops at
    once. Keep that timeout below the orchestrator's grace period. Extra
    arguments go to `celery worker`."""
    settings = _settings()
    if concurrency is None:
        concurrency = settings.concurrency if pool_kind == "threads" else 2
    args = [sys.executable, "-m", "celery", "-A", "loomflow_worker.tasks", "worker",
            "-l", loglevel, "-Q", settings.queue, "-P", pool_kind, "-c", str(concurrency)]
    if hostname is not None:
        args += ["-n", hostname]
    args += list(celery_args)
    # Set before the worker process starts: billiard reads it at import.
    os.environ["REMAP_SIGTERM"] = "SIGQUIT"
    if settings.metrics_port:
        from . import metrics

        metrics.prepare_multiprocess_dir()
    os.execv(sys.executable, args)


@main.command(name="migrate")
def migrate_command() -> None:
    """Apply the schema migrations the database lacks (safe to run concurrently)."""
    import anyio
    import psycopg

    from .runtime.errors import CONNECT, LoomflowWorkerError, describe_dsn, translated
    from .runtime.migrate import latest_version, migrate
    from .runtime.sessions import probe

    settings = _settings()
    dsn = settings.database_url.get_secret_value()

    async def run() -> list[int]:
        await probe(dsn, settings.connect_timeout)
        with translated(CONNECT, dsn):
            conn = await psycopg.AsyncConnection.connect(
                dsn, connect_timeout=settings.connect_timeout
            )
        async with conn:
            return await migrate(conn)

    try:
        applied = anyio.run(run)
    except LoomflowWorkerError as exc:
        _fail(EXIT_UNAVAILABLE, str(exc))
        return
    where = describe_dsn(dsn)
    if applied:
        click.echo(f"{where}: applied {', '.join(f'{v:04d}' for v in applied)}; "
                   f"schema at version {latest_version()}")
    else:
        click.echo(f"{where}: schema already at version {latest_version()}")


# ---- enqueue --------------------------------------------------------------------------------


@main.command()
@click.argument("prompt")
@click.option("--session", "session_id", required=True, help="The session to run in.")
@click.option("--user", "user_id", default=None, help="The user the session belongs to.")
@click.option("--agent", default="default", show_default=True, help="A registered agent.")
@click.option("--metadata", type=JsonValue(object_only=True), default=None,
              help="A JSON object passed to the run.")
@click.option("--on-busy", type=click.Choice(["enqueue", "reject", "interrupt"]),
              default="enqueue", show_default=True,
              help="When the session has an unfinished request: wait for it, refuse "
                   "(exit 5), or cancel it.")
@click.option("--wait", is_flag=True, help="Wait for the request to end and print its result.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="With --wait: give up after this many seconds (exit 6).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@handled
def enqueue(
    prompt: str,
    session_id: str,
    user_id: str | None,
    agent: str,
    metadata: dict[str, Any] | None,
    on_busy: str,
    wait: bool,
    timeout: float | None,
    as_json: bool,
) -> None:
    """Submit PROMPT to run in a session (PROMPT "-" reads it from stdin).

    Prints the request id; with --wait, then the request's output (or, with
    --json, one JSON object), and exits 0 if the request succeeded, 1 if not."""
    import uuid

    if timeout is not None and not wait:
        raise click.UsageError("--timeout needs --wait")
    if prompt == "-":
        prompt = sys.stdin.read()
    _settings()
    from .tasks import run_agent

    request_id = str(uuid.uuid4())
    # Accepted once recorded: a broker that refuses the message is logged (on
    # stderr) and a worker's sweeper publishes the request when it is back.
    run_agent.apply_async(
        (prompt, session_id),
        {"user_id": user_id, "agent": agent, "metadata": metadata},
        task_id=request_id,
        on_busy=on_busy,
    )
    if not wait:
        if as_json:
            _echo_json({"request_id": request_id, "status": "queued"})
        else:
            click.echo(request_id)
        return
    if not as_json:
        click.echo(request_id)
    from . import admin

    with admin.connect(_settings()) as conn:
        outcome = admin.wait_for(conn, request_id, timeout=timeout)
    if as_json:
        _echo_json({"request_id": request_id, "status": outcome.status, "result": outcome.result,
                    "error": outcome.error, "error_type": outcome.error_type})
    elif outcome.status == "succeeded":
        output = (outcome.result or {}).get("output") if isinstance(outcome.result, dict) else None
        click.echo(output if isinstance(output, str) else json.dumps(outcome.result))
    else:
        click.echo(f"request {request_id} {outcome.status}: {outcome.error or '(no error text)'}",
                   err=True)
    sys.exit(_STATUS_EXIT.get(outcome.status, EXIT_FAILED))


# ---- requests, show -------------------------------------------------------------------------


@main.command("requests")
@click.option("--session", "session_id", default=None, help="Only this session.")
@click.option("--user", "user_id", default=None, help="Only this user.")
@click.option("--status", "statuses", multiple=True, type=click.Choice(STATUSES),
              help="Only these statuses (repeat the option for several).")
@click.option("--older-than", type=Duration(), default=None,
              help="Enqueued longer ago than this (e.g. 1d12h).")
@click.option("--newer-than", type=Duration(), default=None,
              help="Enqueued within this (e.g. 90m).")
@click.option("--min-cost", type=click.FloatRange(min=0), default=None,
              help="Only requests whose model calls cost at least this many dollars.")
@click.option("--sort", type=click.Choice(["newest", "cost"]), default="newest",
              show_default=True,
              help="Newest first, or the costliest first (only requests that cost something).")
@click.option("--limit", type=click.IntRange(min=1, max=MAX_LIST), default=50,
              show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON, one object a line.")
@click.option("--direct", is_flag=True,
              help="List the runs made through PostgresRuntime outside Celery (a web "
                   "process's own agent.run) instead: `show RUN` shows one with its journal.")
@handled
def list_requests(
    session_id: str | None,
    user_id: str | None,
    statuses: tuple[str, ...],
    older_than: timedelta | None,
    newer_than: timedelta | None,
    min_cost: float | None,
    sort: str,
    limit: int,
    as_json: bool,
    direct: bool,
) -> None:
    """List requests, newest first or the costliest first (times in UTC).
    Runs made through PostgresRuntime outside Celery are not requests:
    --direct lists them."""
    from . import admin
    from .admin.usage_report import format_cost, format_tokens

    with admin.connect(_settings()) as conn:
        if direct:
            _list_direct_runs(admin.list_direct_runs(
                conn, session_id=session_id, user_id=user_id, limit=limit), as_json)
            return
        found = admin.list_requests(
            conn, session_id=session_id, user_id=user_id, statuses=statuses,
            older_than=older_than, newer_than=newer_than,
            min_cost=None if min_cost is None else Decimal(str(min_cost)),
            by_cost=sort == "cost", limit=limit,
        )
    if as_json:
        for row in found:
            _echo_json(asdict(row))
        return
    if not found:
        click.echo("no requests match (runs made through PostgresRuntime outside Celery "
                   "are not requests: --direct lists them)", err=True)
        return
    headers = ("REQUEST", "SESSION", "USER", "AGENT", "VERSION", "STATUS", "ATTEMPTS",
               "ENQUEUED", "ETA", "FINISHED", "WORKER", "WAITS", "TOKENS", "COST")
    rows = [
        (r.request_id, r.session_id, r.user_id or "-", r.agent, r.agent_version or "-",
         r.status, str(r.attempts), _when(r.enqueued_at), _when(r.not_before),
         _when(r.finished_at), r.worker or "-", r.waits() or "-",
         format_tokens(r.tokens) if r.model_calls else "-",
         format_cost(r.cost, r.price_unknown) if r.model_calls else "-")
        for r in found
    ]
    for line in _table(headers, rows):
        click.echo(line)


def _list_direct_runs(found: list[Any], as_json: bool) -> None:
    if as_json:
        for run in found:
            _echo_json(asdict(run))
        return
    if not found:
        click.echo("no run made through PostgresRuntime outside Celery matches", err=True)
        return
    rows = [(r.run_id, r.session_id, r.user_id or "-", str(r.epoch), _when(r.started_at),
             _when(r.finished_at), r.outcome or "running (or its process died)", r.process)
            for r in found]
    for line in _table(("RUN", "SESSION", "USER", "EPOCH", "STARTED", "FINISHED", "OUTCOME",
                        "PROCESS"), rows):
        click.echo(line)


# `runs`, the command's first name, still lists requests (scripts call it); --help names
# only `requests`.
_runs = copy.copy(list_requests)
_runs.hidden = True
main.add_command(_runs, "runs")


@main.command()
@click.argument("request_id", metavar="REQUEST")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@handled
def show(request_id: str, as_json: bool) -> None:
    """A request: status, prompt, attempts, result or error, and its journal,
    each step with the attempt that executed it and those that replayed it."""
    from . import admin

    with admin.connect(_settings()) as conn:
        detail = admin.get_request(conn, request_id)
    if as_json:
        _echo_json(detail.as_json())
        return
    who = f"session {detail.session_id}" + (f", user {detail.user_id}" if detail.user_id else "")
    click.echo(f"request   {detail.request_id}")
    click.echo(f"status    {detail.status}" + (
        f" ({detail.error_type})" if detail.error_type and detail.status != "succeeded" else ""))
    click.echo(f"run       {detail.kind} of agent {detail.agent} in {who}")
    click.echo(f"epoch     {detail.epoch if detail.epoch is not None else '- (not started)'}")
    version = detail.version_said()
    click.echo("version   " + (version if version is not None
                               else "- (not started: it runs on any version)"))
    for move in detail.upgrades:
        click.echo(f"moved     {_when(move.at)} from version {move.from_version} to "
                   f"{move.to_version}, by {move.by}")
    if detail.waiting_for:
        why = (f"for a slot of {detail.waiting_for}" if detail.waiting_for.startswith("limit ")
               else detail.waiting_for)
        until = (f", until {_when(detail.not_before)}"
                 if detail.not_before is not None and detail.not_before > detail.now else "")
        click.echo(f"waits     {why}{until}")
    not_before = (f", not before {_when(detail.not_before)}"
                  if detail.not_before is not None else "")
    click.echo(f"times     enqueued {_when(detail.enqueued_at)}{not_before}, started "
               f"{_when(detail.started_at)}, finished {_when(detail.finished_at)} (UTC)")
    click.echo(f"counts    {detail.counts()}")
    for note in detail.counts_explained():
        click.echo(f"          {note}")
    click.echo("prompt    " + admin.shorten(detail.prompt, 200))
    if detail.metadata:
        click.echo("metadata  " + admin.shorten(json.dumps(detail.metadata), 200))
    if detail.status == "succeeded" and isinstance(detail.result, dict):
        click.echo("output    " + str(detail.result.get("output")))
    elif detail.error:
        label = "error" if detail.status != "queued" else "last error"
        click.echo(f"{label:<9} {detail.error}")
    for line in _usage_lines(detail):
        click.echo(line)
    click.echo("")
    click.echo("attempts")
    if detail.attempts:
        rows, meanings = [], []
        for i, a in enumerate(detail.attempts):
            ongoing = i == len(detail.attempts) - 1 and detail.status == "running"
            outcome = a.said(last=ongoing, running=ongoing)
            rows.append((str(a.attempt), a.worker, str(a.pid), a.agent_version or "-",
                         _when(a.started_at, precise=True), _when(a.ended_at, precise=True),
                         outcome, *_attempt_usage(a.usage)))
            meaning = a.explained(last=ongoing, running=ongoing)
            if meaning is not None:
                meanings.append(f"attempt {a.attempt}: {meaning}")
        for line in _table(("#", "WORKER", "PID", "VERSION", "STARTED", "ENDED", "OUTCOME",
                            "EXECUTED TOKENS", "COST", "REPLAYED TOKENS"), rows):
            click.echo("  " + line)
        for meaning in meanings:
            click.echo("  " + meaning)
    else:
        click.echo("  none yet")
    click.echo("")
    namespace = f"namespace {detail.epoch}/" if detail.epoch else "the root namespace"
    click.echo(f"journal   (scope {detail.scope!r}, {namespace})")
    if not detail.journal:
        click.echo("  no entries" + (" (pruned, or none written)" if detail.epoch is not None
                                     else ""))
    steps = []
    for step in detail.journal:
        took = "" if step.took is None else "+" + admin.format_duration(step.took)
        key = admin.shorten(step.key.removeprefix(f"{detail.epoch}/"), 44)
        steps.append((_when(step.written_at, precise=True), took,
                      "stream" if step.stream else "step", admin.shorten(step.label, 40), key,
                      step.history(), admin.shorten(step.summary, 60)))
    if steps:
        for line in _table(("WRITTEN", "AFTER", "KIND", "STEP", "KEY", "HISTORY", "VALUE"),
                           steps):
            click.echo("  " + line)


def _usage_lines(detail: Any) -> Iterator[str]:
    """``show``'s model-call lines: the request's executed (billed) tokens and
    cost, and what replays from the journal saved."""
    from .admin.usage_report import format_cost, format_tokens

    if not detail.model_calls and not detail.replayed_calls:
        yield "tokens    - (no model call recorded)"
        return
    yield (f"tokens    {format_tokens(detail.input_tokens)} in, "
           f"{format_tokens(detail.output_tokens)} out, "
           f"{format_tokens(detail.cache_read_tokens)} cache read, "
           f"{format_tokens(detail.cache_write_tokens)} cache write "
           f"({detail.model_calls} model calls executed)")
    cost = format_cost(detail.cost, detail.price_unknown)
    yield "cost      " + cost + (
        " (a model of no known price: set its price in LOOMFLOW_WORKER_PRICES)"
        if detail.price_unknown else "")
    if detail.replayed_calls:
        yield (f"replayed  {detail.replayed_calls} model calls from the journal, not billed "
               f"again: {format_tokens(detail.replayed_tokens)} tokens, "
               f"{format_cost(detail.replayed_cost)} saved")


def _attempt_usage(usage: dict[str, Any] | None) -> tuple[str, str, str]:
    """An attempt's executed tokens, their cost and its replayed tokens, as
    ``show`` lists them (``not recorded``: it ended without recording them,
    e.g. its process was killed; the calls it journaled count in the
    request's total through the next attempt's replay)."""
    from .admin.usage_report import format_cost, format_tokens

    if usage is None:
        return "not recorded", "-", "-"
    executed, replayed = usage["executed"], usage["replayed"]
    tokens = executed["input"] + executed["output"] + executed["cache_read"] + \
        executed["cache_write"]
    replayed_tokens = replayed["input"] + replayed["output"] + replayed["cache_read"] + \
        replayed["cache_write"]
    return (f"{format_tokens(tokens)} ({executed['calls']} calls)",
            format_cost(executed["cost"]) if executed["calls"] else "-",
            f"{format_tokens(replayed_tokens)} ({replayed['calls']} calls)")


# ---- usage ----------------------------------------------------------------------------------


@main.command()
@click.option("--by", type=click.Choice(["agent", "key", "user", "day"]), default="agent",
              show_default=True,
              help="Group by agent, fairness key (tenant), user, or day (UTC).")
@click.option("--since", default="30d", show_default=True,
              help="Requests enqueued since: a duration back (7d, 12h) or a date in UTC "
                   "(2026-12-01).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON, one object a line.")
@handled
def usage(by: str, since: str, as_json: bool) -> None:
    """Tokens, cost, requests and replay savings per agent, fairness key,
    user or day, from the ledger: executed model calls (billed) and those
    replayed from the journal after a crash or a retry (not billed again)."""
    from . import admin
    from .admin.usage_report import format_cost, format_tokens, parse_since, totals, usage_report

    start = parse_since(since)
    with admin.connect(_settings()) as conn:
        found = usage_report(conn, by, start)
    if as_json:
        for row in found:
            _echo_json({**asdict(row), "group": row.grp, "tokens": row.tokens})
        return
    if not found:
        click.echo(f"no model calls recorded since {_when(start)} (UTC)", err=True)
        return
    headers = (by.upper(), "REQUESTS", "CALLS", "INPUT", "OUTPUT", "CACHE READ",
               "CACHE WRITE", "COST", "REPLAYED CALLS", "REPLAYED TOKENS", "SAVED")

    def line(name: str, r: Any) -> tuple[str, ...]:
        return (name, str(r.requests), str(r.model_calls), format_tokens(r.input_tokens),
                format_tokens(r.output_tokens), format_tokens(r.cache_read_tokens),
                format_tokens(r.cache_write_tokens), format_cost(r.cost, r.price_unknown),
                str(r.replayed_calls), format_tokens(r.replayed_tokens),
                format_cost(r.replayed_cost))

    rows = [line(r.grp if r.grp is not None else "-", r) for r in found]
    rows.append(line("total", totals(found)))
    for text in _table(headers, rows):
        click.echo(text)
    click.echo(f"since {_when(start)} (UTC); cost in US dollars" + (
        "; some models have no known price: set theirs in LOOMFLOW_WORKER_PRICES"
        if any(r.price_unknown for r in found) else ""))


# ---- tail -----------------------------------------------------------------------------------


def _event_line(event: Any) -> str:
    from . import admin
    from .events import describe_event

    marker = "replay" if event.replayed else "      "
    summary = admin.shorten(describe_event(event.kind, event.data), 160)
    return f"{_when(event.at, precise=True)} a{event.attempt} {marker} {event.kind:<12} {summary}"


def _stream_pos(event_id: str) -> tuple[int, int]:
    ms, _, seq = event_id.partition("-")
    return int(ms), int(seq or 0)


#: How long ``tail`` follows a finished request's stream for its end event.
END_AFTER_FINISH = 3.0


@main.command()
@click.argument("request_id", metavar="REQUEST")
@click.option("--json", "as_json", is_flag=True, help="Print each event as JSON.")
@click.option("--idle-timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Give up (exit 6) after this many seconds without an event.")
@handled
def tail(request_id: str, as_json: bool, idle_timeout: float | None) -> None:
    """Follow a request's live events from its start until it ends, one line an
    event (time UTC, attempt, replay marker, kind, summary); exits 0 if the
    request succeeded, 1 if not."""
    from . import admin
    from .events import iter_events

    settings = _settings()
    check_every = 2.0
    with admin.connect(settings) as conn:
        status = admin.request_status(conn, request_id)
        last = (0, -1)
        final: str | None = None
        quiet_since = time.monotonic()
        # A request's last events reach its stream just after the ledger says
        # it finished (the worker sends them with those of other requests):
        # once it has, they are followed a little longer before the ledger
        # has the last word.
        waited_for_end = False
        while final is None:
            follow = not (status.finished and waited_for_end)
            for event in iter_events(
                request_id, settings=settings, follow=follow,
                idle_timeout=END_AFTER_FINISH if status.finished else check_every,
            ):
                position = _stream_pos(event.id)
                if position <= last:
                    continue
                last = position
                quiet_since = time.monotonic()
                click.echo(json.dumps(asdict(event), sort_keys=True) if as_json
                           else _event_line(event))
                if event.is_end:
                    final = str(event.data.get("status"))
            if final is not None:
                break
            if not follow:
                # Finished, and its stream holds no end event (expired, or events
                # were dropped while Redis was away): the ledger has the word.
                click.echo(f"(the live events hold no end; the ledger says {status.status})",
                           err=True)
                final = status.status
                break
            waited_for_end = status.finished
            status = admin.request_status(conn, request_id)
            if idle_timeout is not None and time.monotonic() - quiet_since > idle_timeout:
                raise TimeoutError(
                    f"no event of request {request_id} for {idle_timeout:g}s; it is "
                    f"{status.status}"
                )
    sys.exit(_STATUS_EXIT.get(final, EXIT_FAILED))


# ---- versions, upgrade ----------------------------------------------------------------------


@main.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object per version.")
@handled
def versions(as_json: bool) -> None:
    """Each agent's versions: the live workers serving each, and the unfinished
    requests pinned to it (running; waiting for a worker of it; queued). A
    request is pinned to the version its first attempt ran, and runs only on
    a worker of that version: a version with requests waiting and no live
    worker needs a worker of it, or `loomflow-worker upgrade`."""
    from . import admin

    with admin.connect(_settings()) as conn:
        found = admin.agent_versions(conn)
    if as_json:
        for info in found:
            _echo_json({**asdict(info), "live": info.live})
        return
    if not found:
        click.echo("no agent versions known: no worker has started yet", err=True)
        return
    rows = []
    for info in found:
        seen = ("now" if info.live else
                f"last seen {_when(info.seen_at)}" if info.seen_at is not None else "never seen")
        waits = (f"{info.waiting} since {_when(info.waiting_since)}" if info.waiting
                 else "0")
        rows.append((info.agent, info.version + (" (declared)" if info.declared else ""),
                     str(len(info.workers)), seen, str(info.running), waits, str(info.queued)))
    for line in _table(("AGENT", "VERSION", "WORKERS", "SEEN", "RUNNING", "WAITING", "QUEUED"),
                       rows):
        click.echo(line)
    stranded = [i for i in found if i.waiting and not i.live]
    for info in stranded:
        click.echo(f"agent {info.agent!r} version {info.version}: {info.waiting} requests wait "
                   "for a worker of it and none is alive; start one, or move them: "
                   f"loomflow-worker upgrade --agent {info.agent} --from {info.version}",
                   err=True)


@main.command()
@click.argument("request_id", metavar="[REQUEST]", required=False)
@click.option("--agent", default=None, help="Move every queued request of this agent ...")
@click.option("--from", "from_version", default=None, metavar="VERSION",
              help="... pinned to this version.")
@click.option("--to", "to", default=None, metavar="VERSION",
              help="The version to move to (default: the newest one a live worker serves).")
@handled
def upgrade(request_id: str | None, agent: str | None, from_version: str | None,
            to: str | None) -> None:
    """Move a queued request (or, with --agent and --from, every queued request
    of an agent pinned to a version) to another version of its agent. What it
    completed stays in its journal and is never executed again: its next
    attempt replays its journaled model calls by position, with their tool
    calls, and only what had not completed runs on the new version's code.
    Prints each request moved and the version it left."""
    if (request_id is None) == (agent is None):
        raise click.UsageError("give a REQUEST, or --agent NAME --from VERSION")
    if agent is not None and from_version is None:
        raise click.UsageError("--agent needs --from VERSION: the version to move requests off")
    if request_id is not None and from_version is not None:
        raise click.UsageError("--from goes with --agent")
    _settings()
    from .tasks.upgrade import upgrade_agent, upgrade_request

    done = (upgrade_request(request_id, to) if request_id is not None
            else upgrade_agent(str(agent), str(from_version), to))
    for moved, left in done.moved:
        click.echo(f"{moved}: moved from version {left} to {done.to}")
    click.echo(f"moved {len(done.moved)} request{'' if len(done.moved) == 1 else 's'} of "
               f"agent {done.agent!r} to version {done.to}", err=True)


# ---- cancel, signal -------------------------------------------------------------------------


@main.command()
@click.argument("request_id", metavar="[REQUEST]", required=False)
@click.option("--queued", is_flag=True,
              help="Cancel every queued request instead (with --session / --user: theirs).")
@click.option("--session", "session_id", default=None, help="With --queued: only this session.")
@click.option("--user", "user_id", default=None, help="With --queued: only this user.")
@click.option("--yes", is_flag=True, help="With --queued and no filter: don't ask.")
@handled
def cancel(
    request_id: str | None, queued: bool, session_id: str | None, user_id: str | None, yes: bool
) -> None:
    """Cancel a request: a queued one never starts, a running one stops at its
    next step. Prints its status now (running until the stop takes effect).

    With --queued, drop waiting work: every queued request (of --session, of
    --user) ends cancelled and its session moves on; prints their ids. Use
    this rather than `celery purge`, which the ledger does not see: the
    sweeper publishes purged requests again."""
    if queued == (request_id is not None):
        raise click.UsageError("give a REQUEST or --queued, not both" if queued
                               else "give a REQUEST to cancel, or --queued")
    if not queued and (session_id is not None or user_id is not None):
        raise click.UsageError("--session and --user go with --queued")
    if queued:
        if session_id is None and user_id is None and not yes:
            click.confirm("Cancel every queued request of the fleet?", abort=True)
        _settings()
        from . import cancel_queued

        cancelled = cancel_queued(session_id, user_id)
        for one in cancelled:
            click.echo(one)
        click.echo(f"cancelled {len(cancelled)} queued request"
                   f"{'' if len(cancelled) == 1 else 's'}", err=True)
        return
    assert request_id is not None
    from . import admin

    with admin.connect(_settings()) as conn:
        admin.request_status(conn, request_id)
    from . import cancel_request

    status = cancel_request(request_id)
    click.echo(f"{request_id}: {status}")


@main.command(name="signal")
@click.argument("session_id", metavar="SESSION")
@click.argument("name")
@click.argument("payload", metavar="[PAYLOAD_JSON]", type=JsonValue(), required=False)
@click.option("--user", "user_id", default=None,
              help="Only this user's runs on SESSION take it (default: a run of any user).")
@handled
def signal_command(session_id: str, name: str, payload: Any, user_id: str | None) -> None:
    """Send the durable signal NAME to SESSION, with an optional JSON payload; a
    run waiting for it (runtime.wait_for_signal) wakes, one not yet waiting
    finds it when it does, and a request that gave its slot back to wait for
    it is published at once. With --user only that user's run on SESSION takes
    it; without, a run of any user on SESSION."""
    from . import admin
    from .execution import signal_waits

    settings = _settings()
    with admin.connect(settings) as conn:
        signal_id = admin.send_signal(conn, session_id, name, payload, user_id,
                                      keep=settings.signals_per_scope)
        # The requests that gave their slot back to wait for it go at once.
        woken = signal_waits.claim(conn, session_id, name)
    to = f"session {session_id!r}" + (f", user {user_id!r}" if user_id is not None else "")
    click.echo(f"signal {name!r} sent to {to} (id {signal_id})")
    if woken:
        from .tasks.wake import publish

        publish(woken, name)
        for pending in woken:
            click.echo(f"request {pending.request_id}, which waited for it, published")


# ---- limits ---------------------------------------------------------------------------------


@main.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON, one object a line.")
@click.pass_context
def limits(ctx: click.Context, as_json: bool) -> None:
    """List the fleet's concurrency limits (runs in flight, and requests
    waiting on each), cost budgets (tokens or dollars per day or month by
    fairness key or agent, spent this period, and requests waiting on each)
    and model-call budgets (requests and tokens per minute by model key, and
    any pause a provider asked for); `limits concurrency`, `limits budget` and
    `limits set` change them at run time. Every process with
    LOOMFLOW_WORKER_LIMITS, FAIRNESS_WEIGHTS or BUDGETS declares them (a
    worker at its start, any process at its first enqueue): the newest
    settings win, and a limit, weight or budget set with this command holds
    over settings until the command changes it (SOURCE says which). Workers
    write LOOMFLOW_WORKER_MODEL_LIMITS at their start."""
    if ctx.invoked_subcommand is not None:
        return
    _list_limits(as_json)


@handled
def _list_limits(as_json: bool) -> None:
    from . import admin
    from .execution import budgets, pacing
    from .execution import limits as concurrency

    with admin.connect(_settings()) as conn:
        rows = pacing.read_limits(conn)
        sizes = concurrency.read(conn)
        weights = concurrency.read_weights(conn)
        depth = concurrency.fair_depth(conn)
        spends = budgets.read(conn)
    if as_json:
        for row in rows:
            _echo_json({"kind": "model", **asdict(row)})
        for spend in spends:
            _echo_json({"kind": "budget", **asdict(spend)})
        for size in sizes:
            _echo_json({"kind": "concurrency", **asdict(size)})
        for weight in weights:
            _echo_json({"kind": "fairness", **asdict(weight)})
        _echo_json({"kind": "fair_shares", "on": depth is not None, "broker_bound": depth})
        return
    if sizes:
        for line in _table(["LIMIT", "RUNS", "WAITING", "CHANGED", "SOURCE"],
                           [[size.name, str(size.max_runs), str(size.waiting),
                             _when(size.updated_at), _source(size.source, size.set_by)]
                            for size in sizes]):
            click.echo(line)
        click.echo("")
    if weights:
        for line in _table(["FAIRNESS KEY", "WEIGHT", "STATED", "WAITING", "SOURCE"],
                           [[w.fairness_key, "-" if w.weight is None else f"{w.weight:g}",
                             "-" if w.call_weight is None else f"{w.call_weight:g}",
                             str(w.waiting),
                             "-" if w.weight is None else _source(w.source, w.set_by)]
                            for w in weights]):
            click.echo(line)
        click.echo("")
    if spends:
        for line in _table(["BUDGET", "AMOUNT", "PER", "SPENT", "RESETS", "OVER", "WAITING",
                            "SOURCE"],
                           [[b.name, b.amount_text, b.period, b.spent_text, _when(b.resets_at),
                             b.over, str(b.waiting), _source(b.source, b.set_by)]
                            for b in spends]):
            click.echo(line)
        click.echo("")
    model_table = _table(
        ["MODEL KEY", "RPM", "TPM", "BURST", "PAUSED", "CHANGED"],
        [[row.key, "-" if row.rpm is None else str(row.rpm),
          "-" if row.tpm is None else str(row.tpm), f"{row.burst:g}s",
          f"{row.paused_for:.1f}s" if row.paused_for > 0 else "-", _when(row.updated_at)]
         for row in rows])
    for line in model_table if rows else [
            "no model limits: set LOOMFLOW_WORKER_MODEL_LIMITS or `limits set KEY`"]:
        click.echo(line)
    fixed = any(size.name == "fair_queue" for size in sizes)
    click.echo("\nfair shares: off (fair_queue 0)" if depth is None else
               f"\nfair shares: on; at most {depth} requests wait in the broker, the rest "
               "their fair turn in the ledger"
               + ("" if fixed else " (the fleet's free slots: set fair_queue to fix it)"))


def _source(source: str | None, set_by: str | None) -> str:
    """Where a limit or weight came from, as `limits` shows it."""
    said = "command" if source == "command" else "settings"
    return f"{said} ({set_by})" if set_by else said


@limits.command(name="set")
@click.argument("key")
@click.option("--rpm", type=click.IntRange(min=1), default=None,
              help="Model calls a minute for the whole fleet.")
@click.option("--tpm", type=click.IntRange(min=1), default=None,
              help="Tokens (input and output) a minute for the whole fleet.")
@click.option("--burst", type=click.FloatRange(min=0, max=3600), default=60.0,
              show_default=True,
              help="Seconds' worth of the limits that may go at once after a quiet spell.")
@click.option("--none", "unlimited", is_flag=True, help="Remove both limits.")
@handled
def limits_set(key: str, rpm: int | None, tpm: int | None, burst: float, unlimited: bool
               ) -> None:
    """Set the model key KEY's limits at run time: every worker books its calls
    by them within seconds, until a worker starts with other
    LOOMFLOW_WORKER_MODEL_LIMITS."""
    from .settings import check_key

    if unlimited == (rpm is not None or tpm is not None):
        raise click.UsageError("give --rpm, --tpm or both, or --none")
    try:
        check_key(key)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="KEY") from None
    from . import admin
    from .execution import pacing
    from .settings import ModelLimit

    limit = None if unlimited else ModelLimit(rpm=rpm, tpm=tpm, burst=burst)
    with admin.connect(_settings()) as conn:
        pacing.write_limits(conn, key, limit)
    click.echo(f"model key {key!r}: "
               + (", ".join(part for part in (f"{rpm} requests a minute" if rpm else "",
                                             f"{tpm} tokens a minute" if tpm else "") if part)
                  or "no limit"))


@limits.command(name="concurrency")
@click.argument("name")
@click.argument("max_runs", metavar="[RUNS]", type=click.IntRange(min=0), required=False)
@click.option("--none", "unlimited", is_flag=True, help="Remove the limit.")
@handled
def limits_concurrency(name: str, max_runs: int | None, unlimited: bool) -> None:
    """Set the concurrency limit NAME to at most RUNS requests in flight for
    the whole fleet: per_key (each fairness key apart), agent:AGENT, or a name
    agents share (register_agent(limits=[...])). Every worker applies it
    within seconds; it holds over LOOMFLOW_WORKER_LIMITS until this command
    changes it (--none removes it, and settings apply again).

    fair_queue bounds the requests waiting in the broker (by default the
    fleet's free slots); beyond it they wait their fair turn. fair_queue 0
    turns fair shares off."""
    from .settings import check_limit_name

    if unlimited == (max_runs is not None):
        raise click.UsageError("give RUNS (at least 1), or --none")
    if max_runs == 0 and name != "fair_queue":
        raise click.BadParameter("at least 1 (only fair_queue takes 0: fair shares off)",
                                 param_hint="RUNS")
    try:
        check_limit_name(name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="NAME") from None
    from . import admin
    from .execution import limits as concurrency

    with admin.connect(_settings()) as conn:
        concurrency.write(conn, name, max_runs)
    click.echo(f"limit {name!r}: " + (
        "fair shares off" if max_runs == 0
        else f"at most {max_runs} runs" if max_runs else "none"))


@limits.command(name="weight")
@click.argument("key")
@click.argument("weight", metavar="[WEIGHT]", type=float, required=False)
@click.option("--none", "unweighted", is_flag=True, help="Remove the weight (back to 1).")
@handled
def limits_weight(key: str, weight: float | None, unweighted: bool) -> None:
    """Set the weight of the fairness KEY: with the fair_queue limit set,
    requests waiting their turn start in proportion to the weights of the keys
    with work waiting (1 by default). Applies to the next requests published;
    it holds over LOOMFLOW_WORKER_FAIRNESS_WEIGHTS until this command changes
    it."""
    from .settings import check_key, check_weight

    if unweighted == (weight is not None):
        raise click.UsageError("give WEIGHT (a positive number), or --none")
    try:
        check_key(key, "fairness key")
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="KEY") from None
    if weight is not None:
        try:
            weight = check_weight(weight)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="WEIGHT") from None
    from . import admin
    from .execution import limits as concurrency

    with admin.connect(_settings()) as conn:
        concurrency.write_weight(conn, key, weight)
    click.echo(f"fairness key {key!r}: " + (f"weight {weight:g}" if weight else "weight 1"))


@limits.command(name="budget")
@click.argument("name")
@click.argument("amount", required=False)
@click.option("--unit", type=click.Choice(["tokens", "usd"]), default="tokens",
              show_default=True, help="What AMOUNT counts: tokens (input, output and cache), "
              "or US dollars.")
@click.option("--per", "period", type=click.Choice(["day", "month"]), default="day",
              show_default=True, help="The period, a UTC calendar day or month.")
@click.option("--over", type=click.Choice(["wait", "refuse"]), default="wait",
              show_default=True, help="While it is spent: requests wait in the ledger, or "
              "their enqueue is refused.")
@click.option("--none", "unbounded", is_flag=True, help="Remove the budget.")
@handled
def limits_budget(name: str, amount: str | None, unit: str, period: str, over: str,
                  unbounded: bool) -> None:
    """Set the budget of NAME, a fairness key (a tenant) or agent:AGENT, to
    AMOUNT tokens or dollars per UTC day or month, for the whole fleet. A
    request whose key or agent has spent its budget waits in the ledger (or,
    with --over refuse, its enqueue raises) until the period rolls over or the
    budget is raised; a run under way finishes. Every worker applies it within
    seconds; it holds over LOOMFLOW_WORKER_BUDGETS until this command changes
    it (--none removes it, and settings apply again). Requests that waited for
    it and may run now are published at once."""
    from .settings import budget_of, check_budget_name

    if unbounded == (amount is not None):
        raise click.UsageError("give AMOUNT (a positive number), or --none")
    try:
        check_budget_name(name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="NAME") from None
    try:
        budget = None if amount is None else budget_of(amount, unit, period, over)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="AMOUNT") from None
    from . import admin
    from .execution import budgets
    from .execution.limits import command_by

    with admin.connect(_settings()) as conn:
        change = budgets.write(conn, name, budget, command_by())
        woken = budgets.wake(conn, [name])
    click.echo(f"budget {name!r}: " + (
        "none" if budget is None else
        f"{budgets.amount_said(budget.amount, budget.unit)} a {budget.period} (UTC), "
        + ("requests wait" if budget.over == "wait" else "enqueues refused")
        + " while spent"))
    said = change.said() if change is not None else None
    if said is not None:
        click.echo(f"changed: {said}")
    if woken:
        from .tasks.wake import publish_budget_waiters

        publish_budget_waiters(woken, "was removed" if budget is None else "has room")
        for pending in woken:
            click.echo(f"request {pending.request_id}, which waited for it, published")


# ---- prune ----------------------------------------------------------------------------------

_PLURAL = {
    "journal_steps": ("journal step", "journal steps"),
    "journal_streams": ("journal stream", "journal streams"),
    "checkpoints": ("checkpoint", "checkpoints"),
    "signals": ("signal", "signals"),
    "direct_runs": ("run outside Celery", "runs outside Celery"),
    "runs": ("finished request", "finished requests"),
    "fairness_keys": ("fairness key at rest (of any age)", "fairness keys at rest (of any age)"),
}


def _describe_counts(counts: dict[str, int]) -> str:
    return ", ".join(
        f"{n} {_PLURAL[table][0] if n == 1 else _PLURAL[table][1]}" for table, n in counts.items()
        if n
    )


@main.command()
@click.option("--older-than", type=Duration(), required=True,
              help="Delete what is older than this, e.g. 30d or 1d12h.")
@click.option("--batch-size", type=click.IntRange(min=1), default=5000, show_default=True,
              help="Rows per delete; each batch is its own short transaction.")
@click.option("--yes", is_flag=True, help="Don't ask for confirmation.")
@handled
def prune(older_than: timedelta, batch_size: int, yes: bool) -> None:
    """Delete journal entries, streams and checkpoints written, undelivered
    signals sent, runs outside Celery ended, and requests finished, longer ago
    than --older-than (scopes
    with an unfinished request keep their journal and signals; the scopes'
    epoch marks are kept); and fairness keys at rest, whatever their age (no
    request withheld, no weight, not ahead of the fleet's clock: a key that
    comes back is weighed as if it had kept its row)."""
    from . import admin
    from .runtime.errors import translated
    from .runtime.prune import Pruner, cutoff

    with admin.connect(_settings()) as conn:
        # The database's clock, on which every age it holds was stamped.
        with translated("query"):
            pruner = Pruner(cutoff(conn, older_than), batch_size=batch_size)
            counts = pruner.counts(conn)
        total = sum(counts.values())
        age = admin.format_duration(older_than.total_seconds())
        if total == 0:
            click.echo(f"nothing older than {age} to prune")
            return
        if not yes:
            click.confirm(f"Delete {_describe_counts(counts)} (older than {age})?", abort=True)
        started = time.monotonic()
        with click.progressbar(length=total, label="pruning", file=sys.stderr) as bar:
            done = [0]

            def advance(_table: str, rows: int) -> None:
                step = max(0, min(rows, total - done[0]))
                done[0] += step
                bar.update(step)

            with translated("query"):
                totals = pruner.run(conn, on_batch=advance)
    click.echo(f"deleted {_describe_counts(totals)} in "
               f"{admin.format_duration(time.monotonic() - started)}")


# ---- doctor ---------------------------------------------------------------------------------


@main.command()
@click.option("--grace-period", type=click.FloatRange(min=0), envvar="LOOMFLOW_WORKER_GRACE_PERIOD",
              default=30.0, show_default=True,
              help="The orchestrator's shutdown grace period in seconds "
                   "(default: LOOMFLOW_WORKER_GRACE_PERIOD, else 30).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON, one check a line.")
def doctor(grace_period: float, as_json: bool) -> None:
    """Check the fleet's configuration and services, one line a check (OK or FAIL
    and what to do); exits 0 when all pass, 1 otherwise."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from . import admin
    from .settings import Settings

    checks: Iterable[admin.Check]
    try:
        settings = Settings()
    except (ValidationError, SettingsError) as exc:
        checks = [admin.Check("settings", False, admin.validation_message(exc),
                              "fix the LOOMFLOW_WORKER_* variables named")]
    else:
        _secrets[:] = admin.secrets_of(settings)
        checks = admin.doctor(settings, grace_period=grace_period)
    passed = True
    for check in checks:  # each shown as soon as it is made
        passed &= check.ok
        if as_json:
            _echo_json({"check": check.name, "ok": check.ok,
                        "detail": admin.redact(check.detail, _secrets),
                        "hint": check.hint if not check.ok else ""})
        else:
            click.echo(admin.redact(check.line(), _secrets))
    sys.exit(EXIT_OK if passed else EXIT_FAILED)


# ---- console --------------------------------------------------------------------------------

def _console_module() -> Any:
    from .runtime.errors import InvalidInput

    try:
        from . import console
    except ImportError as exc:
        raise InvalidInput(
            f"the console needs its extra ({exc.name} is missing): "
            "pip install 'loomflow-worker[console]'"
        ) from exc
    return console


@main.command(name="console")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; off loopback only with LOOMFLOW_WORKER_CONSOLE_TOKEN.")
@click.option("--port", type=click.IntRange(0, 65535), default=CONSOLE_PORT, show_default=True,
              help="Port to listen on.")
@handled
def console_command(host: str, port: int) -> None:
    """Serve the run console, a read-only web view of the fleet: requests, each
    run's attempts and steps (executed or replayed) on a timeline, its live
    events, and the workers. Clients other than loopback must present
    LOOMFLOW_WORKER_CONSOLE_TOKEN, and cancelling a request from its page
    always takes it."""
    settings = _settings()
    _console_module().serve(settings, host=host, port=port, announce=click.echo)


# ---- demo -----------------------------------------------------------------------------------


@main.command()
@click.option("--embedded", is_flag=True,
              help="Use a private Postgres and Redis even when services are configured.")
@click.option("--console", "with_console", is_flag=True,
              help="At the end, serve the run console until Ctrl-C.")
@click.option("--console-port", type=click.IntRange(0, 65535), default=CONSOLE_PORT,
              show_default=True, help="The console's port (on 127.0.0.1).")
@handled
def demo(embedded: bool, with_console: bool, console_port: int) -> None:
    """Two workers, runs on three sessions, a worker killed mid-run and its run
    resumed elsewhere; ends with the console's address of the run it killed."""
    if with_console:
        _console_module()
    from .demo import run_demo

    sys.exit(run_demo(embedded=embedded, console=with_console, console_port=console_port))


# ---- the console script ---------------------------------------------------------------


#: Modules whose loading means the command must leave through the interpreter's
#: own exit: a broker connection (kombu) or a server (uvicorn) may have work
#: left for their exit handlers.
_NEEDS_FULL_EXIT = frozenset({"kombu", "uvicorn"})


def run() -> None:
    """``loomflow-worker``: :func:`main`. A command that loaded neither a broker
    client nor a server (the operator commands) then leaves at once, its output
    flushed and its logging shut down, without the interpreter tearing down the
    driver's and the settings library's modules one by one (a twentieth of a
    second, a fifth of such a command's time)."""
    try:
        main()
    except SystemExit as exc:
        if _NEEDS_FULL_EXIT & sys.modules.keys():
            raise
        code = exc.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            # A reader that went away (``| head``), or a closed stream.
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code or 0)


if __name__ == "__main__":
    run()
