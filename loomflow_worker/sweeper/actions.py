"""What the sweeper did, as ``sweeper_actions`` records it for the console:
each of its jobs notes its actions as it goes, and the sweep records them at
its end (:meth:`.sweeper.Sweeper.record_actions`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    """One thing the sweeper did."""

    action: str
    request_id: str | None = None
    detail: str = ""


#: How a job of the sweeper notes an action.
Note = Callable[[Action], None]
