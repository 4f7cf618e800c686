"""Running suspected requests in quarantine: the worker's side.

A shared worker process (many runs on one loop) does not run a request that
must run in quarantine (:mod:`loomflow_worker.worker.quarantine.child` says
which and why): its task hands the attempt to a process of quarantine and
waits for its reply, then carries on with the outcome as if it had run here
(result, handoffs, retry). A request that must run alone gets a process of
its own; suspects that may run together join a process of their worker
process with room, ``QUARANTINE_GROUP`` at most at once (another takes the
place of each that leaves), so a poison among them takes only those few
with it. A worker process runs ``ALONE_AT_ONCE`` such processes at a time
(a request that finds no room in them within half a second goes back to
the queue, for any worker with room). A revoke with terminate stops the
request's attempt there at once.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.context
import time
from typing import Any

import psycopg
from psycopg_pool import PoolTimeout

from ...execution import ledger
from ...execution.outcome import Outcome, OutcomeKind
from ...execution.registry import agent_modules
from ...execution.request_errors import AttemptLost, DiedAlone
from ...execution.statuses import QuarantineLevel
from ...runtime.errors import DatabaseUnavailable, LockLost
from ..state import PROCESS
from .child import decode_outcome
from .processes import Member, QuarantineProcess

log = logging.getLogger(__name__)

#: How long a request that must run in quarantine waits for one of its
#: worker process's ``ALONE_AT_ONCE`` to end before it goes back to the queue.
SLOT_WAIT = 0.5


def run_in_quarantine(
    request_id: str,
    args: dict[str, Any],
    kind: str,
    node: str,
    *,
    level: QuarantineLevel,
    time_limit: float | None,
    options: dict[str, Any] | None,
    timeout: float,
) -> Outcome:
    """One attempt of ``request_id`` in a process of quarantine: alone
    (``level`` ALONE), or among a few suspects (GROUP). Its outcome
    (``quarantine`` when this process runs ``ALONE_AT_ONCE`` processes of
    quarantine already, none with room, and none ended within
    :data:`SLOT_WAIT`). Raises :class:`AttemptLost` or
    :class:`DatabaseUnavailable` as an attempt here would, and
    :class:`DiedAlone` when its process died."""
    job = {"request_id": request_id, "args": args, "kind": kind, "node": node,
           "time_limit": time_limit, "options": options, "modules": agent_modules()}
    alone = PROCESS.quarantine
    settings = PROCESS.current_settings()
    capacity = settings.quarantine_group if level != QuarantineLevel.ALONE else 1
    with alone.guard:
        if request_id in alone.running:
            # A duplicate of a request in quarantine here: again later.
            return Outcome(OutcomeKind.QUARANTINE)
        # A revoke from now on stops it, while it waits for room as well as
        # however soon its process starts.
        alone.running[request_id] = None
    place: tuple[QuarantineProcess, Member] | None = None
    try:
        place = _place(request_id, level, capacity, settings.alone_at_once)
        if place is None:
            if not _revoked(request_id):
                # Not held here behind the others: any worker with room may take it.
                log.info("request %s must run in quarantine, and this worker process runs %d "
                         "processes of quarantine already (ALONE_AT_ONCE); it goes back to "
                         "the queue", request_id, settings.alone_at_once,
                         extra={"action": "quarantine_full", "request": request_id})
                return Outcome(OutcomeKind.QUARANTINE)
        else:
            group, member = place
            _run(request_id, job, group, member, timeout)
    finally:
        with alone.guard:
            alone.running.pop(request_id, None)
            revoked = request_id in alone.revoked
            alone.revoked.discard(request_id)
            if place is not None:
                place[0].members.pop(request_id, None)
        if place is not None:
            place[0].close_if_idle()
            alone.room()
    reply = None if place is None else place[1].reply
    if reply is None and revoked:
        # Revoked before its attempt could halt its run (the run had not
        # begun), or before it had one: the attempt stopped, recorded
        # interrupted if it had started, and released the session; the
        # revoke ends the request cancelled in the ledger and hands the
        # session on (tasks/hooks.py), as for a run of this process.
        return Outcome(OutcomeKind.CANCELLED, error=ledger.REVOKED.error)
    if reply is None:
        assert place is not None
        raise DiedAlone(_death(place[0]), alone=place[0].level == QuarantineLevel.ALONE)
    if "failed" in reply:
        assert place is not None
        raise DiedAlone(f"its attempt failed in quarantine: {reply['failed']}",
                        alone=place[0].level == QuarantineLevel.ALONE)
    if "lost" in reply:
        lost = reply["lost"]
        raise AttemptLost(request_id, lost["attempt"], LockLost(lost["scope"], lost["cause"]),
                          lost["worker"])
    if "unavailable" in reply:
        raise DatabaseUnavailable(reply["unavailable"])
    return decode_outcome(reply)


def _place(
    request_id: str, level: QuarantineLevel, capacity: int, at_once: int
) -> tuple[QuarantineProcess, Member] | None:
    """A place in a process of quarantine for ``request_id``: in a group of
    this worker process with room, else in a new process when fewer than
    ``at_once`` run, waiting up to :data:`SLOT_WAIT` for either; ``None``
    when none came."""
    alone = PROCESS.quarantine
    deadline = time.monotonic() + SLOT_WAIT
    with alone.freed:
        while True:
            if capacity > 1:
                with alone.guard:
                    for group in alone.groups:
                        member = group.join(request_id)
                        if member is not None:
                            alone.running[request_id] = group
                            return group, member
            if alone.taken < at_once:
                alone.taken += 1
                # Listed before the condition is let go: a suspect placed
                # meanwhile joins this group rather than start another.
                group = QuarantineProcess(alone, level, capacity, on_death=_stopped)
                with alone.guard:
                    member = group.join(request_id)
                    assert member is not None
                    alone.running[request_id] = group
                    if capacity > 1:
                        alone.groups = [g for g in alone.groups if not g.closed] + [group]
                return group, member
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            alone.freed.wait(left)


def _run(request_id: str, job: dict[str, Any], group: QuarantineProcess, member: Member,
         timeout: float) -> None:
    """Run ``job`` in ``group`` and wait for its reply (its process stopped past ``timeout``)."""
    if group.first == request_id:
        # Its first request starts it, even when revoked meanwhile (then the
        # revoke follows its job): the others wait for that.
        if group.level == QuarantineLevel.ALONE:
            log.info("request %s: running alone in a process of its own", request_id,
                     extra={"action": "quarantine_start", "request": request_id})
        try:
            group.start(job, _processes())
        except BaseException:
            group.release()  # no reader thread runs to release it
            raise
        finally:
            group.started.set()
    else:
        group.started.wait()
        if _revoked(request_id):
            return
        group.send({"job": job})
    if _revoked(request_id):
        # Revoked while its attempt started: the revoke went nowhere, or
        # went before its job; it goes now (twice is harmless).
        group.send({"revoke": request_id})
    if group.level == QuarantineLevel.GROUP:
        assert group.process is not None
        log.info("request %s: running in quarantine with other suspects, in process %s",
                 request_id, group.process.pid,
                 extra={"action": "quarantine_start", "request": request_id})
    if not member.ended.wait(timeout):
        log.warning("request %s ran past %gs in quarantine; its process is stopped",
                    request_id, timeout, extra={"action": "quarantine_timeout",
                                                "request": request_id})
        group.stop()
        member.ended.wait()


def _stopped(worker: str) -> None:
    """Mark the row of a process of quarantine that died stopped, as a
    worker that closes marks its own: the next attempts of its requests do
    not wait two heartbeat intervals for it. Its requests' retries carry
    on if the database is out of reach (then they wait)."""
    try:
        with PROCESS.ledger_connection() as conn:
            ledger.mark_worker_stopped(conn, worker)
    except (psycopg.Error, PoolTimeout) as exc:
        log.warning("could not mark process of quarantine %s stopped (%s)", worker, exc,
                    extra={"action": "retry"})


def _death(group: QuarantineProcess) -> str:
    process = group.process
    code = None if process is None else process.exitcode
    alone = group.level == QuarantineLevel.ALONE
    where = "its process" if alone else "its process of quarantine"
    return (f"{where} exited with {code}"
            + (f" (signal {-code})" if code is not None and code < 0 else ""))


def _revoked(request_id: str) -> bool:
    with PROCESS.quarantine.guard:
        return request_id in PROCESS.quarantine.revoked


def _processes() -> multiprocessing.context.ForkServerContext:
    """Where a process of quarantine comes from: a fork server that imported
    the attempt's code and the agents once (started on first use; it stops
    with this process)."""
    context = multiprocessing.get_context("forkserver")
    with PROCESS.quarantine.guard:
        if not PROCESS.quarantine.preloaded:
            context.set_forkserver_preload(
                ["loomflow_worker.worker.quarantine.child", *agent_modules()])
            PROCESS.quarantine.preloaded = True
    return context


def stop_in_quarantine(request_id: str) -> bool:
    """Stop ``request_id``'s attempt in quarantine at once, mid-step (a
    revoke with terminate): its process stops the run and ends it
    ``cancelled`` as revoked under its lock, then releases the session.
    ``False`` when the request does not run in quarantine here."""
    alone = PROCESS.quarantine
    with alone.guard:
        if request_id not in alone.running:
            return False
        group = alone.running[request_id]
        alone.revoked.add(request_id)
    log.info("request %s: revoked; stopping its attempt in quarantine", request_id,
             extra={"action": "revoke", "request": request_id})
    if group is not None:
        # Sent after its job, if its job went: else it never goes.
        group.send({"revoke": request_id})
    return True
