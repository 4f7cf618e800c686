"""Signals sent by an operator: the same row and NOTIFY as ``PostgresRuntime.signal``."""

from __future__ import annotations

import json
from typing import Any

from psycopg.rows import dict_row

from ..runtime.conns import SyncConn
from ..runtime.errors import InvalidInput, translated
from ..runtime.signals import DEFAULT_SIGNALS_PER_SCOPE, report_dropped, send_params
from ..runtime.sql import query
from ..runtime.validate import check_id, check_signal_name


def send_signal(
    conn: SyncConn, session_id: str, name: str, payload: Any = None, user_id: str | None = None,
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
    try:
        blob = payload_blob(payload)
    except TypeError as exc:
        raise InvalidInput(f"signal {name!r}: the payload can't be stored as JSON: {exc}") from exc
    with translated("query"):
        row = conn.cursor(row_factory=dict_row).execute(
            query("send_signal"), send_params(session_id, user_id, name, blob, keep)
        ).fetchone()
    assert row is not None
    report_dropped(int(row["dropped"]), session_id, user_id, keep)
    return int(row["id"])


#: loomflow's codec's prefix of a JSON value (``loomflow.runtime._codec.MAGIC``).
_CODEC_MAGIC = b"LJ1"
_CODEC_TAG = "$t"


def _plain(value: Any) -> bool:
    """Whether ``value`` is JSON that loomflow's codec stores as itself: the
    JSON types exactly, and no object with the codec's tag key."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return True
    if kind is list:
        return all(_plain(item) for item in value)
    if kind is dict:
        return all(type(key) is str and key != _CODEC_TAG and _plain(item)
                   for key, item in value.items())
    return False


def payload_blob(payload: Any) -> bytes:
    """A signal's payload as the runtime stores it: loomflow's codec's bytes.
    Plain JSON (all a command line can send) is written here, byte for byte
    the codec's, so an operator's command does not load the agent framework;
    anything else goes through the codec (``TypeError`` if it can't be stored)."""
    if _plain(payload):
        return _CODEC_MAGIC + json.dumps(payload, separators=(",", ":")).encode("utf-8")
    from loomflow.runtime import _codec

    return _codec.dumps(payload)
