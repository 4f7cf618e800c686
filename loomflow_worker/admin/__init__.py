"""Operating a fleet, one module per job: :mod:`.attempts` (the ledger and journal
read for people), :mod:`.operator_signals` (signals sent by an operator),
:mod:`.usage_report` (tokens and cost for people), :mod:`.doctor` (health
checks), on :mod:`.connect` (the database connection; driver errors become the
runtime's by ``runtime.errors.translated``; a request the ledger lacks is
``execution.request_errors.RequestNotFound``). Pruning is the
runtime's (:mod:`loomflow_worker.runtime.prune`).

Sync functions on psycopg 3 connections, called by the ``loomflow-worker``
command. Their queries live in ``admin/sql/admin.sql`` (their reads of the
ledger in ``execution/sql/ledger_reads.sql``, run by its gateway, and
``signals.sql``, ``migrate.sql``, which they share with the runtime); every
error names what to do and never a password (connection strings are shown
through ``describe_dsn``).
"""

from __future__ import annotations

from ..durations import MAX_DURATION, format_duration, parse_duration
from ..execution.request_errors import RequestNotFound
from ..runtime.conns import SyncConn
from ..settings import validation_message
from .connect import connect, redact, sanitize_url, secrets_of
from .doctor import Check, check_settings, doctor
from .operator_signals import send_signal
from .runs import (
    MAX_LIST,
    STATUSES,
    TERMINAL,
    AttemptInfo,
    DirectRun,
    RequestDetail,
    RequestStatus,
    RequestSummary,
    RunDetail,
    RunRow,
    RunStatus,
    StepInfo,
    UpgradeInfo,
    VersionInfo,
    add_journal,
    agent_versions,
    attempts_that_ran_nothing,
    attribute_steps,
    direct_detail,
    get_direct_run,
    get_request,
    get_run,
    journal_params,
    list_direct_runs,
    list_requests,
    list_runs,
    request_params,
    request_status,
    run_status,
    shorten,
    step_name,
    summarize_value,
    wait_for,
)

__all__ = [
    "MAX_DURATION",
    "MAX_LIST",
    "STATUSES",
    "TERMINAL",
    "AttemptInfo",
    "Check",
    "DirectRun",
    "RequestDetail",
    "RequestNotFound",
    "RequestStatus",
    "RequestSummary",
    "RunDetail",
    "RunRow",
    "RunStatus",
    "StepInfo",
    "SyncConn",
    "UpgradeInfo",
    "VersionInfo",
    "add_journal",
    "agent_versions",
    "attempts_that_ran_nothing",
    "attribute_steps",
    "check_settings",
    "connect",
    "direct_detail",
    "doctor",
    "format_duration",
    "get_direct_run",
    "get_request",
    "get_run",
    "journal_params",
    "list_direct_runs",
    "list_requests",
    "list_runs",
    "parse_duration",
    "redact",
    "request_params",
    "request_status",
    "run_status",
    "sanitize_url",
    "secrets_of",
    "send_signal",
    "shorten",
    "step_name",
    "summarize_value",
    "validation_message",
    "wait_for",
]
