"""Durations as operators type them (``30d``, ``1d12h``) and as they are shown."""

from __future__ import annotations

import re
from datetime import timedelta

from .runtime.errors import InvalidInput

#: The longest duration accepted (Postgres timestamps end 4713 BC).
MAX_DURATION = timedelta(days=365_000)

# ASCII digits only (a bare \d takes other scripts' digits too).
_DURATION = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", re.ASCII)
#: More digits than this in one part is longer than MAX_DURATION whatever the unit
#: (and ``int`` refuses strings of over 4,300 digits).
_MAX_DIGITS = 15


def shown(text: str, width: int = 40) -> str:
    """``text`` quoted for an error message, cut to ``width`` characters."""
    if len(text) <= width:
        return repr(text)
    return f"{text[:width]!r}... ({len(text)} characters)"


def parse_duration(text: str) -> timedelta:
    """``"30d"``, ``"12h"``, ``"90m"``, ``"45s"`` or combinations in that order
    (``"1d12h"``); :class:`InvalidInput` otherwise."""
    compact = text.strip().lower().replace(" ", "")
    match = _DURATION.fullmatch(compact)
    if not compact or match is None or not any(match.groups()):
        raise InvalidInput(
            f"{shown(text)} is not a duration: use a number and a unit, d (days), h (hours), "
            "m (minutes) or s (seconds), largest first, e.g. 30d, 12h, 90m, 45s, 1d12h"
        )
    if any(len((part or "").lstrip("0")) > _MAX_DIGITS for part in match.groups()):
        duration = MAX_DURATION + timedelta(days=1)
    else:
        days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
        try:
            duration = timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
        except OverflowError:
            duration = MAX_DURATION + timedelta(days=1)
    if duration > MAX_DURATION:
        raise InvalidInput(
            f"{shown(text)} is longer than {MAX_DURATION.days}d (about a thousand years), the "
            "longest duration accepted; nothing in the ledger is that old"
        )
    return duration


def format_duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.2f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    parts = [(days, "d"), (hours, "h"), (minutes, "m"), (secs, "s")]
    return "".join(f"{n}{unit}" for n, unit in parts if n) or "0s"
