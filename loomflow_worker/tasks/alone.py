"""Running a suspected request alone: the worker's side of quarantine.

A shared worker process (many runs on one loop) does not run a request that
must run alone (:mod:`loomflow_worker.execution.quarantine` says which and
why): its task hands the attempt to a process of its own and waits for it,
a few at a time per worker process, then carries on with the outcome as if
it had run here (result, handoffs, retry).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from typing import Any

from ..execution.errors import AttemptLost, DiedAlone
from ..execution.execute import Outcome
from ..execution.quarantine import decode_outcome
from ..execution.registry import agent_modules
from ..runtime.errors import DatabaseUnavailable, LockLost

log = logging.getLogger("loomflow_worker.tasks")

#: Requests of one worker process that run alone at once (each in a process).
AT_ONCE = 4

_slots = threading.BoundedSemaphore(AT_ONCE)


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
    with _slots:
        log.info("request %s: running alone in a process of its own", request_id,
                 extra={"action": "quarantine_start", "request": request_id})
        try:
            done = subprocess.run(
                [sys.executable, "-m", "loomflow_worker.execution.quarantine"],
                input=json.dumps(job), capture_output=True, text=True, timeout=timeout,
                env=os.environ.copy(), check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise DiedAlone(f"its process ran past {timeout:g}s and was stopped") from exc
    for line in done.stderr.splitlines():
        log.info("request %s (alone): %s", request_id, line,
                 extra={"action": "quarantine_log", "request": request_id})
    reply = _reply(done.stdout)
    if reply is None:
        raise DiedAlone(
            f"its process exited with {done.returncode}"
            + (f" (signal {-done.returncode})" if done.returncode < 0 else "")
        )
    if "lost" in reply:
        lost = reply["lost"]
        raise AttemptLost(request_id, lost["attempt"], LockLost(lost["scope"], lost["cause"]),
                          lost["worker"])
    if "unavailable" in reply:
        raise DatabaseUnavailable(reply["unavailable"])
    return decode_outcome(reply)


def _reply(stdout: str) -> dict[str, Any] | None:
    lines = stdout.strip().splitlines()
    if not lines:
        return None
    try:
        reply = json.loads(lines[-1])
    except ValueError:
        return None
    return reply if isinstance(reply, dict) else None
