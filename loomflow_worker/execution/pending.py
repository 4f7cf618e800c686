"""An unfinished request to dispatch, as the ledger describes it, and the
arguments of its task message. A leaf module (no agent framework): the
``signal`` command publishes the request its signal wakes without loading
what a run needs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any


def task_args(
    kind: str, prompt: str, session_id: str, user_id: str | None, agent: str,
    metadata: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of a request's task message (``resume_agent`` takes no metadata)."""
    kwargs: dict[str, Any] = {"user_id": user_id, "agent": agent}
    if kind == "run":
        kwargs["metadata"] = metadata
    return (prompt, session_id), kwargs


@dataclass(frozen=True)
class Pending:
    """An unfinished request to dispatch (a handoff or a redispatch)."""

    request_id: str
    kind: str
    session_id: str
    user_id: str | None
    agent: str
    prompt: str
    metadata: dict[str, Any]
    # When it may start: every message published for it carries this as its eta.
    not_before: datetime | None = None
    # What its message carried besides its arguments (canvas links, chord and
    # group membership, headers, priority, time limits), recorded when a worker
    # parked it; None for a running request, whose own message carries them.
    options: dict[str, Any] | None = None
    # Where its messages go (queue, exchange, routing_key, priority), recorded
    # at enqueue; None: the fleet's default queue. Every message published for
    # it, running or queued, goes there.
    routing: dict[str, Any] | None = None

    def task_args(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return task_args(self.kind, self.prompt, self.session_id, self.user_id, self.agent,
                         self.metadata)

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> Pending:
        """The request named by ``row``'s columns of the same names (a row may
        carry more)."""
        return cls(**{name: row[name] for name in _PENDING_COLUMNS})


_PENDING_COLUMNS = tuple(f.name for f in fields(Pending))
