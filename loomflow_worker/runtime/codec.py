"""Journal values on the wire: loomflow's tagged-JSON codec, pickle only on opt-in."""

from __future__ import annotations

import json
import logging
import pickle
from dataclasses import dataclass
from typing import Any, Literal

from loomflow.runtime import _codec

from .errors import InvalidInput

Serializer = Literal["json", "pickle"]

log = logging.getLogger("loomflow_worker.runtime")


@dataclass
class CodecStats:
    """Values the journal refused: counted, logged, and their steps re-executed."""

    unencodable: int = 0
    undecodable: int = 0


def check_serializer(serializer: str) -> Serializer:
    if serializer == "json":
        return "json"
    if serializer == "pickle":
        return "pickle"
    raise InvalidInput(
        f'serializer must be "json" or "pickle", not {serializer!r}; "pickle" runs code '
        "from the journal on replay, so use it only for a store no untrusted party can write"
    )


def encode(value: Any, serializer: Serializer, stats: CodecStats, *, key: str) -> bytes | None:
    """``value`` as stored bytes, or ``None`` (counted, logged) when it can't be stored."""
    if serializer == "pickle":
        return pickle.dumps(value)
    try:
        return _codec.dumps(value)
    except TypeError as exc:
        stats.unencodable += 1
        log.warning(
            "journal: step %s returned a value the JSON codec can't store (%s); it is not "
            "journaled and re-executes on resume. Return JSON-able values, pydantic models "
            "or dataclasses.",
            key,
            exc,
            extra={"action": "journal_unencodable", "step": key},
        )
        return None


def decode(blob: bytes, serializer: Serializer, stats: CodecStats, *, key: str) -> tuple[bool, Any]:
    """``(True, value)``, or ``(False, None)`` (counted, logged) for a value that won't load.

    Under the JSON serializer nothing is ever unpickled."""
    if blob[:3] == _codec.MAGIC:
        try:
            # loomflow's _codec.loads, minus its checks and bytes sniffing.
            return True, _codec._decode(json.loads(blob[3:].decode("utf-8")))
        except (ValueError, TypeError, KeyError, AttributeError, _codec.UndecodableValue) as exc:
            reason = str(exc)
    elif serializer == "pickle":
        return True, pickle.loads(blob)
    else:
        reason = "not a JSON journal value (pickles are never loaded unless opted in)"
    stats.undecodable += 1
    log.warning(
        "journal: can't decode the stored value of step %s (%s); the step runs again",
        key,
        reason,
        extra={"action": "journal_undecodable", "step": key},
    )
    return False, None
