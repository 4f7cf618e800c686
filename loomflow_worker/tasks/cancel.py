"""Cancelling requests from any process: the ledger records the cancel, and
a worker ends each request ``cancelled`` and hands its session on."""

from __future__ import annotations

from ..runtime.validate import check_id
from ..worker.state import PROCESS
from .application import settings
from .dispatch import dispatch_recorded


def cancel_request(request_id: str) -> str:
    """Cancel a request: a queued one never starts, a running one stops at its
    next step boundary; it ends ``cancelled`` and its session moves on.

    Returns the request's status now: ``"cancelled"``, or ``"running"`` /
    ``"queued"`` while the cancel takes effect, or the terminal status it
    had already reached."""
    check_id("request_id", request_id)
    settings()  # configured, or raising on settings the environment gets wrong
    status, pending = PROCESS.enqueue.cancel(*PROCESS.database(), request_id)
    if status in ("cancelled", "queued"):
        # A worker picks it up now, stores its result and hands the session on.
        dispatch_recorded(pending, f"{status} (cancel requested)")
    return str(status)


#: The first name of :func:`cancel_request`, kept: applications call it.
cancel_run = cancel_request


def cancel_queued(session_id: str | None = None, user_id: str | None = None) -> list[str]:
    """Drop waiting work: cancel every queued request (of ``session_id``, of
    ``user_id``, or of the whole fleet); returns their ids.

    Each ends ``cancelled`` in the ledger and never starts (one queued for a
    retry ends so when a worker next picks it up), and its session moves on.
    Their messages may stay on the broker: a worker that receives one finds
    it finished. This, not ``celery purge``, is how to drop work: the ledger
    is the queue of record, and the sweeper publishes again a queued request
    whose message was purged."""
    for what, value in (("session_id", session_id), ("user_id", user_id)):
        if value is not None:
            check_id(what, value)
    settings()
    found = PROCESS.enqueue.cancel_queued(*PROCESS.database(), session_id, user_id)
    for status, pending in found:
        if status == "queued":
            # Started before: a worker ends it cancelled and hands its session on.
            dispatch_recorded(pending, "queued (cancel requested)")
    return [pending.request_id for _, pending in found]
