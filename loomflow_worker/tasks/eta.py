"""When a request may start and where its message came, read as Celery reads
them: ``apply_async``'s ``countdown`` and ``eta``, a message's eta and the
queue it came by."""

from __future__ import annotations

import math
from datetime import datetime, tzinfo
from typing import Any

from celery import Celery
from celery.utils.time import maybe_make_aware

from ..execution import ledger
from ..execution.ledger import StartAt
from ..runtime.errors import InvalidInput

#: The longest countdown (or the farthest eta) the ledger accepts: ten years.
MAX_DELAY = 10 * 365 * 86400.0


def start_at(countdown: Any, eta: Any, timezone: tzinfo | str | None = None) -> StartAt | None:
    """When a request may start, from ``apply_async``'s ``countdown`` or
    ``eta`` as Celery reads them: a countdown wins, zero or none means at once,
    a naive eta is in ``timezone`` (the app's; ``None``: UTC)."""
    if countdown is not None:
        if (isinstance(countdown, bool) or not isinstance(countdown, int | float)
                or not math.isfinite(countdown) or abs(countdown) > MAX_DELAY):
            raise InvalidInput(
                f"countdown must be a number of seconds (up to {MAX_DELAY:.0f}), "
                f"not {countdown!r}"
            )
        if countdown > 0:
            return StartAt(countdown=float(countdown))
        if countdown < 0:
            return None  # in the past: at once, as Celery runs it
    if eta is None or eta == "":
        return None
    if isinstance(eta, str):
        try:
            eta = datetime.fromisoformat(eta)
        except ValueError:
            raise InvalidInput(
                f"eta {eta!r} is not an ISO 8601 date and time; pass a datetime"
            ) from None
    if not isinstance(eta, datetime):
        raise InvalidInput(f"eta must be a datetime, not {type(eta).__name__}")
    aware: datetime = maybe_make_aware(eta, timezone)
    if abs((aware - datetime.now(aware.tzinfo)).total_seconds()) > MAX_DELAY:
        raise InvalidInput(f"eta {eta.isoformat()} is more than ten years away")
    return StartAt(eta=aware)


def arrival(request: Any, app: Celery) -> ledger.Arrival:
    """The eta and the queue of the message ``request`` came in (for a request
    the ledger first sees in a worker of ``app``): its queue is the one this
    worker consumes whose exchange and routing key it came by."""
    info = request.delivery_info or {}
    exchange, key = info.get("exchange"), info.get("routing_key")
    queue = next((q.name for q in app.amqp.queues.values() if q.routing_key == key
                  and (not exchange or getattr(q.exchange, "name", None) == exchange)), key)
    try:
        start = start_at(None, request.eta, app.conf.timezone)
    except InvalidInput:
        start = None  # Celery itself refuses such an eta
    return ledger.Arrival(start, {"queue": queue} if queue else None)
