"""Running a suspected request alone: the worker's side of quarantine.

A shared worker process (many runs on one loop) does not run a request that
must run alone (:mod:`loomflow_worker.execution.quarantine` says which and
why): its task hands the attempt to a process of its own and waits for it,
a few at a time per worker process, then carries on with the outcome as if
it had run here (result, handoffs, retry). A revoke with terminate ends
that process, as it stops a run on the process's loop.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from contextlib import suppress
from typing import Any

from ..execution import ledger
from ..execution.errors import AttemptLost, DiedAlone
from ..execution.execute import Outcome
from ..execution.quarantine import decode_outcome
from ..execution.registry import agent_modules
from ..runtime.errors import DatabaseUnavailable, LockLost
from .state import PROCESS

log = logging.getLogger("loomflow_worker.tasks")


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
    """One attempt of ``request_id`` in a process of its own; its outcome.
    Raises :class:`AttemptLost` or :class:`DatabaseUnavailable` as an
    attempt here would, and :class:`DiedAlone` when the process died."""
    job = {"request_id": request_id, "args": args, "kind": kind, "node": node,
           "time_limit": time_limit, "options": options, "modules": agent_modules()}
    alone = PROCESS.alone
    with alone.slots:
        log.info("request %s: running alone in a process of its own", request_id,
                 extra={"action": "quarantine_start", "request": request_id})
        returncode, stdout, stderr = _run_process(request_id, job, timeout)
    for line in stderr.splitlines():
        log.info("request %s (alone): %s", request_id, line,
                 extra={"action": "quarantine_log", "request": request_id})
    reply = _reply(stdout)
    with alone.guard:
        revoked = request_id in alone.revoked
        alone.revoked.discard(request_id)
    if reply is None and revoked:
        # Revoked before its process could halt its run (the run had not
        # begun): the process stopped, recording the attempt interrupted if it
        # had started one, and released the session; the revoke ends the
        # request cancelled in the ledger and hands the session on (see
        # tasks/revoke.py), as for a run of this process.
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


def _run_process(request_id: str, job: dict[str, Any], timeout: float) -> tuple[int, str, str]:
    """Run the attempt's process to its end (stopped past ``timeout``); its
    exit code, standard output and standard error."""
    process = subprocess.Popen(
        [sys.executable, "-m", "loomflow_worker.execution.quarantine"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=os.environ.copy(),
    )
    alone = PROCESS.alone
    with alone.guard:
        alone.running[request_id] = process
    try:
        stdout, stderr = process.communicate(json.dumps(job), timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        process.kill()
        process.communicate()
        raise DiedAlone(f"its process ran past {timeout:g}s and was stopped") from exc
    finally:
        with alone.guard:
            alone.running.pop(request_id, None)
    return process.returncode, stdout, stderr


def stop_alone(request_id: str) -> bool:
    """Stop ``request_id``'s run in its own process at once, mid-step (a
    revoke with terminate): the process stops its run and ends it
    ``cancelled`` as revoked under its lock, then releases the session.
    ``False`` when the request does not run alone here."""
    alone = PROCESS.alone
    with alone.guard:
        process = alone.running.get(request_id)
        if process is None:
            return False
        alone.revoked.add(request_id)
    log.info("request %s: revoked; stopping its process", request_id,
             extra={"action": "revoke", "request": request_id})
    with suppress(ProcessLookupError):
        process.send_signal(signal.SIGUSR1)
    return True


def _reply(stdout: str) -> dict[str, Any] | None:
    lines = stdout.strip().splitlines()
    if not lines:
        return None
    try:
        reply = json.loads(lines[-1])
    except ValueError:
        return None
    return reply if isinstance(reply, dict) else None
