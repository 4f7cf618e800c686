"""Running a suspected request alone: the worker's side of quarantine.

A shared worker process (many runs on one loop) does not run a request that
must run alone (:mod:`loomflow_worker.execution.quarantine` says which and
why): its task hands the attempt to a process of its own and waits for it,
``ALONE_AT_ONCE`` at a time per worker process (a request that finds them all
taken goes back to the queue, for any worker with room), then carries on with the outcome as if
it had run here (result, handoffs, retry). A revoke with terminate ends
that process, as it stops a run on the process's loop.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.context
import os
import signal
import time
from contextlib import suppress
from multiprocessing.process import BaseProcess
from typing import Any

from ..execution import ledger, quarantine
from ..execution.errors import AttemptLost, DiedAlone
from ..execution.execute import Outcome
from ..execution.quarantine import decode_outcome
from ..execution.registry import agent_modules
from ..runtime.errors import DatabaseUnavailable, LockLost
from .state import PROCESS

log = logging.getLogger("loomflow_worker.tasks")

#: How long a process that sent its reply may take to end before it is stopped.
EXIT_GRACE = 10.0

#: How long a request that must run alone waits for one of its worker
#: process's ``ALONE_AT_ONCE`` to end before it goes back to the queue.
SLOT_WAIT = 0.5


def run_alone(
    request_id: str,
    args: dict[str, Any],
    kind: str,
    node: str,
    *,
    time_limit: float | None,
    options: dict[str, Any] | None,
    timeout: float,
) -> Outcome:
    """One attempt of ``request_id`` in a process of its own; its outcome
    (``quarantine`` when this process runs ``ALONE_AT_ONCE`` requests alone
    already and none ended within :data:`SLOT_WAIT`). Raises
    :class:`AttemptLost` or :class:`DatabaseUnavailable` as an attempt here
    would, and :class:`DiedAlone` when the process died."""
    job = {"request_id": request_id, "args": args, "kind": kind, "node": node,
           "time_limit": time_limit, "options": options, "modules": agent_modules()}
    alone = PROCESS.alone
    at_once = PROCESS.current_settings().alone_at_once
    with alone.guard:
        # A revoke from now on stops it, while it waits for room as well as
        # however soon its process starts.
        alone.running[request_id] = None
    returncode, reply = 0, None
    try:
        if alone.take(at_once, SLOT_WAIT):
            try:
                if not _revoked(request_id):
                    log.info("request %s: running alone in a process of its own", request_id,
                             extra={"action": "quarantine_start", "request": request_id})
                    returncode, reply = _run_process(request_id, job, timeout)
            finally:
                alone.give_back()
        elif not _revoked(request_id):
            # Not held here behind the others: any worker with room may take it.
            log.info("request %s must run alone, and this worker process runs %d requests "
                     "alone already (ALONE_AT_ONCE); it goes back to the queue", request_id,
                     at_once, extra={"action": "quarantine_full", "request": request_id})
            return Outcome("quarantine")
    finally:
        with alone.guard:
            alone.running.pop(request_id, None)
            revoked = request_id in alone.revoked
            alone.revoked.discard(request_id)
    if reply is None and revoked:
        # Revoked before its process could halt its run (the run had not
        # begun), or before it had one: the process stopped, recording the
        # attempt interrupted if it had started one, and released the session;
        # the revoke ends the request cancelled in the ledger and hands the
        # session on (tasks/hooks.py), as for a run of this process.
        return Outcome("cancelled", error=ledger.REVOKED.error)
    if reply is None:
        raise DiedAlone(
            f"its process exited with {returncode}"
            + (f" (signal {-returncode})" if returncode < 0 else "")
        )
    if "lost" in reply:
        lost = reply["lost"]
        raise AttemptLost(request_id, lost["attempt"], LockLost(lost["scope"], lost["cause"]),
                          lost["worker"])
    if "unavailable" in reply:
        raise DatabaseUnavailable(reply["unavailable"])
    return decode_outcome(reply)


def _revoked(request_id: str) -> bool:
    with PROCESS.alone.guard:
        return request_id in PROCESS.alone.revoked


def _run_process(
    request_id: str, job: dict[str, Any], timeout: float
) -> tuple[int, dict[str, Any] | None]:
    """Run the attempt's process to its end (stopped past ``timeout``), logging
    its lines as they come; its exit code and its reply, if it sent one."""
    processes = _processes()
    reader, writer = processes.Pipe(duplex=False)
    process = processes.Process(
        target=quarantine.child, args=({**job, "worker_pid": os.getpid()}, writer),
        name=f"{quarantine.PROCESS_NAME} {request_id}",
    )
    alone = PROCESS.alone
    reply: dict[str, Any] | None = None
    try:
        process.start()
        writer.close()
        with alone.guard:
            alone.running[request_id] = process
            revoked = request_id in alone.revoked
        if revoked:
            # Revoked while it started: stopped now (before its handler is
            # set, the signal ends it, as a revoke before its run began).
            _signal_revoked(process)
        deadline = time.monotonic() + timeout
        while True:
            if not reader.poll(max(0.0, deadline - time.monotonic())):
                process.kill()
                process.join()
                raise DiedAlone(f"its process ran past {timeout:g}s and was stopped")
            try:
                message = reader.recv_bytes()
            except (EOFError, OSError):
                break  # it closed its end, or died within a message
            reply = _line(request_id, message) or reply
        # A process that replied but does not end (a tool's thread that
        # lingers) is stopped: its reply stands.
        process.join(EXIT_GRACE if reply is not None else None)
        if process.is_alive():
            process.kill()
            process.join()
    except BaseException:
        # Never left running unwatched: it stops its run (recorded interrupted).
        if process.is_alive():
            process.terminate()
        raise
    finally:
        reader.close()
        writer.close()
    assert process.exitcode is not None
    return process.exitcode, reply


def _line(request_id: str, message: bytes) -> dict[str, Any] | None:
    """Log a log line of the process as the request's; a reply, returned."""
    try:
        item = json.loads(message)
    except ValueError:
        item = None
    if isinstance(item, dict) and isinstance(item.get("reply"), dict):
        reply: dict[str, Any] = item["reply"]
        return reply
    line = item["log"] if isinstance(item, dict) and "log" in item else repr(message)
    log.info("request %s (alone): %s", request_id, line,
             extra={"action": "quarantine_log", "request": request_id})
    return None


def _processes() -> multiprocessing.context.ForkServerContext:
    """Where a request's own process comes from: a fork server that imported
    the attempt's code and the agents once (started on first use; it stops
    with this process)."""
    context = multiprocessing.get_context("forkserver")
    with PROCESS.alone.guard:
        if not PROCESS.alone.preloaded:
            context.set_forkserver_preload(
                ["loomflow_worker.execution.quarantine", *agent_modules()])
            PROCESS.alone.preloaded = True
    return context


def stop_alone(request_id: str) -> bool:
    """Stop ``request_id``'s run in its own process at once, mid-step (a
    revoke with terminate): the process stops its run and ends it
    ``cancelled`` as revoked under its lock, then releases the session.
    ``False`` when the request does not run alone here."""
    alone = PROCESS.alone
    with alone.guard:
        if request_id not in alone.running:
            return False
        process = alone.running[request_id]
        alone.revoked.add(request_id)
    log.info("request %s: revoked; stopping its process", request_id,
             extra={"action": "revoke", "request": request_id})
    if process is not None:
        _signal_revoked(process)
    # Else its process is starting: it is stopped once started.
    return True


def _signal_revoked(process: BaseProcess) -> None:
    """Tell a request's own process its request was revoked (SIGUSR1)."""
    # Not once it has ended: its pid may be another process's by now.
    if process.pid is not None and process.exitcode is None:
        with suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGUSR1)
