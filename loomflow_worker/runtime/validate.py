"""Checks on identifiers before anything is read or written."""

from __future__ import annotations

import unicodedata

from .errors import InvalidInput

MAX_ID_LENGTH = 512
MAX_SIGNAL_NAME_LENGTH = 200


def check_id(what: str, value: object, *, max_length: int = MAX_ID_LENGTH) -> str:
    """``value`` if it is a usable session or user id, else :class:`InvalidInput`."""
    if not isinstance(value, str):
        raise InvalidInput(f"{what} must be a string, not {type(value).__name__}")
    if not value or not value.strip():
        raise InvalidInput(f"{what} is empty; pass a non-blank identifier")
    if len(value) > max_length:
        raise InvalidInput(
            f"{what} is {len(value)} characters long; the limit is {max_length}"
        )
    for position, char in enumerate(value):
        if unicodedata.category(char) in ("Cc", "Cs"):
            raise InvalidInput(
                f"{what} has a control character ({char!r}) at position {position}; "
                "use printable characters only"
            )
    return value


def check_signal_name(name: object) -> str:
    return check_id("signal name", name, max_length=MAX_SIGNAL_NAME_LENGTH)
