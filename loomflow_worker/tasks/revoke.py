"""Requests Celery ended from outside their run (revoked, expired, killed at
their hard time limit): the ledger ends them as soon as their lock is free,
and their sessions move on, rather than waiting for a message every worker
now discards."""

from __future__ import annotations

import logging
import threading

from ..execution import ledger
from ..execution.pending import Pending
from ..worker.state import PROCESS
from .dispatch import dispatch_recorded
from .retry import retry_within

log = logging.getLogger(__name__)

#: How long a request Celery ended from outside (revoked, or killed at its hard
#: time limit) whose attempt still holds its scope is waited for (its worker
#: stops it at its next step, or dies of the terminate or the kill).
REVOKE_WAIT = 15.0
#: How often the ledger is asked again meanwhile.
REVOKE_POLL = 0.2


def end_revoked_soon(request_id: str, how: ledger.OutsideEnding) -> None:
    """:func:`end_revoked` in a thread of its own: it may wait for the lock."""
    threading.Thread(
        target=end_revoked, args=(request_id, how), daemon=True,
        name=f"loomflow-worker revoke {request_id}",
    ).start()


def end_revoked(request_id: str, how: ledger.OutsideEnding) -> None:
    """End the request in the ledger once its attempt lets go of its scope
    (for up to REVOKE_WAIT), and publish the request it hands its session to."""

    def attempt() -> list[Pending] | None:
        with PROCESS.ledger_connection() as conn:
            done, handoff = ledger.end_revoked(conn, request_id, how)
        if not done:
            return None
        return list(handoff.dispatch) if handoff is not None else []

    def failed(exc: BaseException) -> None:
        log.warning("could not end %s request %s in the ledger yet", how.name, request_id,
                    exc_info=exc, extra={"action": "revoke", "request": request_id})

    handed = retry_within(REVOKE_WAIT, attempt, pause=REVOKE_POLL, max_pause=REVOKE_POLL,
                          failed=failed)
    if handed is None:
        log.warning("%s request %s: its attempt still holds the session after %gs; "
                    "it stops at its next step", how.name, request_id, REVOKE_WAIT,
                    extra={"action": "revoke", "request": request_id})
        return
    log.info("request %s %s", request_id, how.name,
             extra={"action": how.name.replace(" ", "_"), "request": request_id})
    for pending in handed:
        dispatch_recorded(pending, "handed the session")


def revoked_ids() -> set[str]:
    """The request ids Celery revoked, as this worker knows them (it forgets
    old ones: a bounded set)."""
    from celery.worker import state

    return set(state.revoked)


def end_revoked_requests(request_ids: list[str]) -> None:
    """The sweeper's share: requests revoked while their message waits in the
    broker (a worker learns of a revoke at once, of the message only when it
    comes) end now."""
    for request_id in request_ids:
        end_revoked_soon(request_id, ledger.REVOKED)
