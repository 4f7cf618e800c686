"""One attempt of a request alone, in a process of its own (quarantine).

A worker process carries many runs, so when it dies nobody knows whose fault
it was: each of its requests is suspected, and none is charged a crash. A
request whose attempts died that way twice in a row without completing a step
(or lost their lock twice in a row, stalling their process) runs its next
attempt here, alone: if this process dies, the death is that request's own
and counts toward ``MAX_CRASHES``; its shared neighbours are never charged.

The worker's task starts the process from a fork server that has imported
this module and the agents once (:func:`child` is what it runs), so a
suspect's attempt starts in milliseconds rather than after a second of
imports; the process sends its log lines and then its outcome as JSON
(:func:`encode_outcome`) through a pipe. It stops its run (recorded
``interrupted``) on SIGTERM or when the worker that started it is gone, and
ends it revoked on SIGUSR1 (a revoke with terminate).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from dataclasses import asdict
from datetime import datetime
from multiprocessing.connection import Connection
from typing import Any

import psycopg
from psycopg_pool import PoolTimeout

from ..runtime.errors import DatabaseUnavailable, LockLost
from ..settings import Settings
from . import ledger
from .errors import AttemptLost
from .execute import Outcome, WorkerContext, execute
from .pending import Pending
from .registry import import_agent_modules

log = logging.getLogger("loomflow_worker.tasks")

#: How often the process checks that the worker that started it still lives.
ORPHAN_CHECK = 1.0


def encode_outcome(outcome: Outcome) -> dict[str, Any]:
    """An outcome as JSON (its handoffs' eta as ISO 8601)."""
    fields = asdict(outcome)
    for pending in fields["dispatch"]:
        if pending["not_before"] is not None:
            pending["not_before"] = pending["not_before"].isoformat()
    return {"outcome": fields}


def decode_outcome(data: dict[str, Any]) -> Outcome:
    fields = dict(data["outcome"])
    dispatch = []
    for pending in fields.pop("dispatch"):
        if pending["not_before"] is not None:
            pending["not_before"] = datetime.fromisoformat(pending["not_before"])
        dispatch.append(Pending(**pending))
    return Outcome(**fields, dispatch=dispatch)


async def attempt(settings: Settings, job: dict[str, Any]) -> dict[str, Any]:
    """Run the attempt described by ``job``; what became of it, as JSON."""
    ctx = WorkerContext(settings, slots=1, node=job["node"], alone=True)
    run = asyncio.current_task()
    assert run is not None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, run.cancel)
    loop.add_signal_handler(signal.SIGUSR1, _revoke, ctx, job["request_id"], run)
    _stop_when_orphaned(loop, job["worker_pid"], run)
    options = job.get("options")
    try:
        outcome = await execute(
            ctx, job["request_id"], job["args"], job["kind"], job["node"],
            time_limit=job.get("time_limit"), options=lambda: options,
        )
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
    finally:
        await ctx.aclose()


def _revoke(ctx: WorkerContext, request_id: str, run: asyncio.Task[Any]) -> None:
    """SIGUSR1, its worker's revoke with terminate: the run stops at once and
    ends ``cancelled`` as revoked, recorded under its lock, as a revoked run
    of a shared process does; stopped as by SIGTERM before it has begun."""
    if not ctx.halt(request_id, ledger.REVOKED.error):
        run.cancel()


async def _mark_lost(ctx: WorkerContext, lost: AttemptLost) -> None:
    """Record the lost attempt before this process ends, so the next attempt
    may start at once. A connection lost with the lock (a Postgres restart
    ends them all) fails it: the worker that started this process records
    it then, retrying, from the reply; this process must not die of it,
    which would charge the request a crash."""
    try:
        runtime = await ctx.runtime()
        async with runtime.pool.connection() as conn:
            await ledger.mark_lost_now(conn, lost.request_id, lost.attempt, lost.worker)
    except (psycopg.Error, PoolTimeout, DatabaseUnavailable) as exc:
        log.warning("request %s: could not record its lost attempt yet (%s); its worker "
                    "records it", lost.request_id, exc,
                    extra={"action": "retry", "request": lost.request_id})


def _stop_when_orphaned(
    loop: asyncio.AbstractEventLoop, worker: int, run: asyncio.Task[Any]
) -> None:
    """Stop the run once the worker that started it is gone (checked each second;
    a pid taken by another user's process since counts as gone)."""
    try:
        os.kill(worker, 0)
    except (ProcessLookupError, PermissionError):
        run.cancel()
        return
    if not run.done():
        loop.call_later(ORPHAN_CHECK, _stop_when_orphaned, loop, worker, run)


class _PipeHandler(logging.Handler):
    """Sends each log line to the worker, which logs it as the request's."""

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
            self.send({"log": self.format(record)})
        except (OSError, ValueError):
            self.handleError(record)


#: The name of each such process (``multiprocessing.current_process().name``
#: starts with it, the request id follows).
PROCESS_NAME = "loomflow-worker alone"

#: Exit code of a process whose run was stopped (SIGTERM, or its worker is gone).
STOPPED = 3


def child(job: dict[str, Any], out: Connection) -> None:
    """The process's work: ``job``'s attempt. Sends through ``out`` its log
    lines (``{"log": line}``), then its reply (``{"reply": ...}``), each a JSON
    object; exits :data:`STOPPED` when stopped."""
    handler = _PipeHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(handlers=[handler], level=logging.INFO, force=True)
    try:
        settings = Settings()
        import_agent_modules([*settings.agents, *job.get("modules", [])])
        reply = asyncio.run(attempt(settings, job))
    except asyncio.CancelledError:
        # Stopped (SIGTERM, or its worker is gone): recorded "interrupted".
        raise SystemExit(STOPPED) from None
    except BaseException:
        # Its traceback reaches the worker's log under the request.
        log.exception("request %s: its process failed", job["request_id"])
        raise
    handler.send({"reply": reply})
