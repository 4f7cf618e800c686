"""Publishing at once the requests parked waiting for a signal, as it is sent
(see :mod:`loomflow_worker.execution.signal_waits`): ``PostgresRuntime.signal``
in any process that imports this package does it after each send (the hook
set here, as the package is imported), and the CLI's ``signal`` with
:func:`publish`. A waiter no sender published, the sweeper publishes within a
sweep."""

from __future__ import annotations

import logging
from typing import Any

import anyio
from psycopg import AsyncConnection

from ..execution import signal_waits
from ..execution.pending import Pending
from ..runtime import signals
from .application import settings
from .dispatch import dispatch_recorded

log = logging.getLogger(__name__)


def publish(woken: list[Pending], name: str) -> None:
    """Publish the requests the signal ``name``'s sender claimed; a broker
    that refuses one is logged, not raised (the sweeper publishes it again)."""
    settings()  # configured, or raising on settings the environment gets wrong
    for pending in woken:
        log.info("request %s published: its signal %r came", pending.request_id, name,
                 extra={"action": "signal_wake", "request": pending.request_id, "signal": name})
        dispatch_recorded(pending, f"queued (its signal {name!r} came)")


def publish_budget_waiters(woken: list[Pending], why: str) -> None:
    """Publish the requests parked on a cost budget that has room again
    (``why``: raised, removed); a broker that refuses one is logged, not
    raised (they are marked published: the sweeper publishes one whose message
    is lost)."""
    settings()
    for pending in woken:
        log.info("request %s published: its budget %s", pending.request_id, why,
                 extra={"action": "budget_wake", "request": pending.request_id})
        dispatch_recorded(pending, f"queued (its budget {why})")


async def _publish_waiters(conn: AsyncConnection[Any], session_id: str, name: str) -> None:
    """After a runtime of this process sent the signal ``name`` to
    ``session_id``: publish the requests parked waiting for it (the broker's
    round trip in a thread, off the runtime's loop)."""
    woken = await signal_waits.claim_async(conn, session_id, name)
    if woken:
        await anyio.to_thread.run_sync(publish, woken, name)


signals.after_send(_publish_waiters)
