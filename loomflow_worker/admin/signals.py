"""Signals sent by an operator: the same row and NOTIFY as ``PostgresRuntime.signal``."""

from __future__ import annotations

from typing import Any

from psycopg.rows import dict_row

from ..runtime.errors import InvalidInput, translated
from ..runtime.signals import DEFAULT_SIGNALS_PER_SCOPE, report_dropped, send_params
from ..runtime.sql import query
from ..runtime.validate import check_id, check_signal_name
from .connect import Conn


def send_signal(
    conn: Conn, session_id: str, name: str, payload: Any = None, user_id: str | None = None,
    *, keep: int = DEFAULT_SIGNALS_PER_SCOPE,
) -> int:
    """Deliver a durable signal to ``session_id`` (to ``user_id``'s waiters only,
    when given; what ``PostgresRuntime.signal`` does: the same row and
    NOTIFY, the oldest undelivered signals of its scope past ``keep``
    dropped); returns the signal's id."""
    check_id("session_id", session_id)
    if user_id is not None:
        check_id("user_id", user_id)
    check_signal_name(name)
    # loomflow's codec, as the runtime writes payloads; loaded by a send only.
    from loomflow.runtime import _codec

    try:
        blob = _codec.dumps(payload)
    except TypeError as exc:
        raise InvalidInput(f"signal {name!r}: the payload can't be stored as JSON: {exc}") from exc
    with translated("query"):
        row = conn.cursor(row_factory=dict_row).execute(
            query("send_signal"), send_params(session_id, user_id, name, blob, keep)
        ).fetchone()
    assert row is not None
    report_dropped(int(row["dropped"]), session_id, user_id, keep)
    return int(row["id"])
