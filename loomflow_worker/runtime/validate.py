"""Checks on identifiers before anything is read or written."""

from __future__ import annotations

import re
import unicodedata

from .errors import InvalidInput

MAX_ID_LENGTH = 512
#: The most bytes an id takes as UTF-8: the ledger and the journal index a
#: scope (a session id and a user id together), and a B-tree entry holds
#: about 2.7 kB; 512 characters of emoji would not fit.
MAX_ID_BYTES = 1024
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
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_ID_BYTES:
        raise InvalidInput(
            f"{what} is {size} bytes as UTF-8; the limit is {MAX_ID_BYTES} "
            "(fewer characters outside ASCII)"
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


#: How deeply JSON input (a request's metadata) may nest.
MAX_JSON_DEPTH = 64

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def check_text(what: str, value: str) -> str:
    """``value`` if Postgres can store it as text: no NUL, no surrogate (a lone
    one is not Unicode, and a Python string never holds a valid pair)."""
    found = _UNSTORABLE.search(value)
    if found is not None:
        char = found.group()
        problem = "a NUL character" if char == "\x00" else f"an unpaired surrogate ({char!r})"
        raise InvalidInput(
            f"{what} contains {problem} at position {found.start()}, which Postgres can't "
            "store as text; remove it or encode the data (base64, say)"
        )
    return value


def check_json_text(what: str, value: object, *, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Every key and string of the JSON-like ``value`` passes :func:`check_text`,
    and it nests at most ``max_depth`` levels (checked without recursion)."""
    stack: list[tuple[object, int, str]] = [(value, 1, what)]
    while stack:
        item, depth, where = stack.pop()
        if isinstance(item, str):
            check_text(where, item)
        elif isinstance(item, dict | list | tuple):
            if depth > max_depth:
                raise InvalidInput(
                    f"{what} nests deeper than {max_depth} levels (at {where}); flatten it"
                )
            if isinstance(item, dict):
                for key, child in item.items():
                    if isinstance(key, str):
                        check_text(f"a key of {where}", key)
                    stack.append((child, depth + 1, f"{where}[{key!r}]"))
            else:
                stack.extend(
                    (child, depth + 1, f"{where}[{i}]") for i, child in enumerate(item)
                )
