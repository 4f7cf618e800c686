"""Attempts of suspected requests, apart from the shared process (quarantine).

A worker process carries many runs, so when it dies nobody knows whose fault
it was: each of its requests is suspected, and none is charged a crash. A
request whose attempts died that way twice in a row without completing a step
runs its next attempt here, in a process with a few other such suspects
(``QUARANTINE_GROUP``): if that process dies too, nobody is charged still,
but each of them runs its next attempt alone (as does a request that lost
its lock twice in a row, stalling its process). A process that runs a
request alone dies of that request only: that counts toward
``MAX_CRASHES``. Its shared neighbours are never charged, and a poison
request that kills every process it runs in takes a few suspects with it
once, not hundreds.

The worker's tasks start the process from a fork server that has imported
this module and the agents once (:func:`child` is what it runs), so a
suspect's attempt starts in milliseconds rather than after a second of
imports. Its worker sends it attempts as JSON through one pipe (a revoke
with terminate too); it sends back its log lines, each naming its request,
and each attempt's outcome (:func:`encode_outcome`) through another. It
stops its runs (recorded ``interrupted``) on SIGTERM or when the worker that
started it is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from contextvars import ContextVar
from dataclasses import asdict
from datetime import datetime
from multiprocessing.connection import Connection
from typing import Any

import psycopg
from psycopg_pool import PoolTimeout

from ... import tracing
from ...execution import ledger
from ...execution.execute import execute
from ...execution.outcome import Outcome, OutcomeKind
from ...execution.pending import Pending
from ...execution.registry import import_agent_modules
from ...execution.request_errors import AttemptLost
from ...execution.statuses import QuarantineLevel
from ...runtime.errors import DatabaseUnavailable, LockLost
from ...runtime.loopwatch import claim_thread_for_asyncio
from ...settings import Settings
from ..context import WorkerContext

log = logging.getLogger(__name__)

#: How often the process checks that the worker that started it still lives.
ORPHAN_CHECK = 1.0

#: The request whose attempt runs the code that logs (its log lines are its own).
REQUEST: ContextVar[str | None] = ContextVar("quarantine_request", default=None)


def encode_outcome(outcome: Outcome) -> dict[str, Any]:
    """An outcome as JSON (its handoffs' eta as ISO 8601)."""
    fields = asdict(outcome)
    for pending in fields["dispatch"]:
        if pending["not_before"] is not None:
            pending["not_before"] = pending["not_before"].isoformat()
    return {"outcome": fields}


def decode_outcome(data: dict[str, Any]) -> Outcome:
    fields = dict(data["outcome"])
    kind = OutcomeKind(fields.pop("kind"))
    fields["quarantine"] = QuarantineLevel(fields["quarantine"])
    dispatch = []
    for pending in fields.pop("dispatch"):
        if pending["not_before"] is not None:
            pending["not_before"] = datetime.fromisoformat(pending["not_before"])
        dispatch.append(Pending(**pending))
    return Outcome(kind, **fields, dispatch=dispatch)


async def attempt(ctx: WorkerContext, job: dict[str, Any]) -> dict[str, Any]:
    """Run the attempt described by ``job``; what became of it, as JSON."""
    options = job.get("options")
    headers = (options or {}).get("headers")
    args = job["args"]
    try:
        with tracing.attempt_span(headers if isinstance(headers, dict) else None,
                                  job["request_id"], args.get("agent"), args.get("session_id"),
                                  job["node"], ctx.quarantine):
            outcome = await execute(
                ctx, job["request_id"], args, job["kind"], job["node"],
                time_limit=job.get("time_limit"), options=lambda: options,
            )
            tracing.attempt_ended(outcome.kind, outcome.error)
        return encode_outcome(outcome)
    except AttemptLost as exc:
        await _mark_lost(ctx, exc)
        cause = exc.__cause__
        scope, why = ((cause.scope, cause.cause) if isinstance(cause, LockLost)
                      else ("", str(exc)))
        return {"lost": {"attempt": exc.attempt, "worker": exc.worker, "scope": scope,
                         "cause": why}}
    except (LockLost, DatabaseUnavailable, psycopg.OperationalError, PoolTimeout) as exc:
        # Postgres out of reach (a restart ends every connection, the pooled
        # ones too): retried as its worker retries such an attempt, never a
        # death of this process, which would charge the request a crash.
        return {"unavailable": f"{type(exc).__name__}: {exc}"}


class _Members:
    """The attempts a process of quarantine runs, as its worker sends them
    through ``jobs``: ``{"job": ...}`` starts one, ``{"revoke": id}`` stops
    one at once (a revoke with terminate), ``{"close": true}`` says no more
    will come, after which the process ends with its last attempt. Each
    attempt's reply goes back through ``out`` (``{"request": id, "reply":
    ...}``; ``"reply": null`` when it was stopped before its run began)."""

    def __init__(self, ctx: WorkerContext, jobs: Connection, out: _PipeHandler) -> None:
        self.ctx = ctx
        self.jobs = jobs
        self.out = out
        self.runs: dict[str, asyncio.Task[None]] = {}
        self.closed = False
        self.done = asyncio.Event()

    def start(self, job: dict[str, Any]) -> None:
        request_id = job["request_id"]
        try:
            import_agent_modules(job.get("modules", []))
        except Exception as exc:
            self.out.send({"request": request_id, "reply": _failure(request_id, exc)})
            self._end_if_idle()
            return
        self.runs[request_id] = asyncio.get_running_loop().create_task(self._run(job))

    async def _run(self, job: dict[str, Any]) -> None:
        request_id = job["request_id"]
        REQUEST.set(request_id)
        reply: dict[str, Any] | None = None
        try:
            reply = await attempt(self.ctx, job)
        except asyncio.CancelledError:
            if self.done.is_set():
                raise  # the process stops (SIGTERM, or its worker is gone)
            # Revoked before its run began (else the run ends it cancelled).
        except Exception as exc:
            reply = _failure(request_id, exc)
        finally:
            self.runs.pop(request_id, None)
        self.out.send({"request": request_id, "reply": reply})
        self._end_if_idle()

    def receive(self) -> None:
        """Read the worker's next message (its end of ``jobs`` is readable)."""
        try:
            message = json.loads(self.jobs.recv_bytes())
        except (EOFError, OSError):
            # Its worker is gone or closed its end: nothing more comes.
            asyncio.get_running_loop().remove_reader(self.jobs.fileno())
            message = {"close": True}
        if "job" in message:
            self.start(message["job"])
        elif "revoke" in message:
            request_id = message["revoke"]
            run = self.runs.get(request_id)
            if run is not None and not self.ctx.halt(request_id, ledger.REVOKED.error):
                run.cancel()
        elif message.get("close"):
            self.closed = True
            self._end_if_idle()

    def _end_if_idle(self) -> None:
        if self.closed and not self.runs:
            self.done.set()

    async def serve(self, first: dict[str, Any], worker: int) -> None:
        """Run ``first`` and the attempts sent after it until closed; stopped
        (each attempt recorded ``interrupted``) on SIGTERM or when ``worker``,
        the process that started this one, is gone."""
        loop = asyncio.get_running_loop()
        main = asyncio.current_task()
        assert main is not None
        loop.add_signal_handler(signal.SIGTERM, main.cancel)
        _stop_when_orphaned(loop, worker, main)
        loop.add_reader(self.jobs.fileno(), self.receive)
        # Connected before any attempt, so that the process's own tasks
        # (heartbeats) log as its, not as the first request's; an attempt
        # says so should the database be out of reach.
        with contextlib.suppress(Exception):
            await self.ctx.runtime()
        self.start(first)
        try:
            await self.done.wait()
        except asyncio.CancelledError:
            self.done.set()
            runs = list(self.runs.values())
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            raise
        finally:
            await self.ctx.aclose()


def _failure(request_id: str, exc: Exception) -> dict[str, Any]:
    """The reply of an attempt that failed here, not as an attempt fails (a
    bug, an agent module that does not import): its worker takes it for a
    death of this process, the others' attempts going on."""
    log.error("request %s: its attempt failed in quarantine", request_id, exc_info=exc,
              extra={"request": request_id})
    return {"failed": f"{type(exc).__name__}: {exc}"}


def _stop_when_orphaned(
    loop: asyncio.AbstractEventLoop, worker: int, main: asyncio.Task[Any]
) -> None:
    """Stop once the worker that started this process is gone (checked each
    second; a pid taken by another user's process since counts as gone)."""
    try:
        os.kill(worker, 0)
    except (ProcessLookupError, PermissionError):
        main.cancel()
        return
    if not main.done():
        loop.call_later(ORPHAN_CHECK, _stop_when_orphaned, loop, worker, main)


async def _mark_lost(ctx: WorkerContext, lost: AttemptLost) -> None:
    """Record the lost attempt before its reply goes, so the next attempt
    may start at once. A connection lost with the lock (a Postgres restart
    ends them all) fails it: the worker that started this process records
    it then, retrying, from the reply; this process must not die of it,
    which would charge the request a crash."""
    try:
        runtime = await ctx.runtime()
        async with runtime.pool.connection() as conn:
            await ledger.mark_lost_async(conn, lost.request_id, lost.attempt, lost.worker)
    except (psycopg.Error, PoolTimeout, DatabaseUnavailable) as exc:
        log.warning("request %s: could not record its lost attempt yet (%s); its worker "
                    "records it", lost.request_id, exc,
                    extra={"action": "retry", "request": lost.request_id})


class _PipeHandler(logging.Handler):
    """Sends each log line to the worker, which logs it as the request's, at its level."""

    def __init__(self, out: Connection) -> None:
        super().__init__()
        self._out = out

    def send(self, item: dict[str, Any]) -> None:
        """Send ``item``, a JSON object, whole: under the handler's lock, so a
        line another thread logs cannot cut into it."""
        self.acquire()
        try:
            self._out.send_bytes(json.dumps(item).encode())
        finally:
            self.release()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.send({"log": self.format(record), "level": record.levelno,
                       "request": REQUEST.get()})
        except (OSError, ValueError):
            self.handleError(record)


#: The name of each such process (``multiprocessing.current_process().name``
#: starts with it).
PROCESS_NAME = "loomflow-worker alone"

#: Exit code of a process whose runs were stopped (SIGTERM, or its worker is gone).
STOPPED = 3


def child(first: dict[str, Any], jobs: Connection, out: Connection) -> None:
    """The process's work: ``first``'s attempt, and those its worker sends
    through ``jobs`` after it (``first["quarantine"]``: GROUP, a few suspects
    together; ALONE, ``first`` alone). Sends through ``out`` its log lines
    (``{"log": line, "level": level, "request": id}``), then each attempt's reply, each a
    JSON object; exits :data:`STOPPED` when stopped."""
    handler = _PipeHandler(out)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logging.basicConfig(handlers=[handler], level=logging.INFO, force=True)
    try:
        settings = Settings()
        import_agent_modules(settings.agents)
        ctx = WorkerContext(settings, slots=int(first["capacity"]), node=first["node"],
                            quarantine=int(first["quarantine"]))
        claim_thread_for_asyncio()
        tracing.export_from_environment()
        try:
            asyncio.run(_Members(ctx, jobs, handler).serve(first, int(first["worker_pid"])))
        finally:
            tracing.flush()
    except asyncio.CancelledError:
        # Stopped (SIGTERM, or its worker is gone): recorded "interrupted".
        raise SystemExit(STOPPED) from None
    except BaseException:
        # Its traceback reaches the worker's log.
        log.exception("its process of quarantine failed")
        raise
