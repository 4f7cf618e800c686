"""A request to run an agent, checked the same way at enqueue and on a worker."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

from loomflow.runtime import journal_scope

from .. import metrics
from ..runtime.errors import InvalidInput
from ..runtime.validate import check_id, check_json_text, check_text
from ..settings import Settings
from .pending import task_args
from .registry import agent_factory, agent_fairness_key, check_agent_known

Kind = Literal["run", "resume"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunRequest:
    prompt: str
    session_id: str
    user_id: str | None
    agent: str
    metadata: dict[str, Any]
    kind: Kind = "run"

    @property
    def scope(self) -> str:
        return journal_scope(self.session_id, self.user_id)

    @property
    def fairness_key(self) -> str:
        """Whose request it is, for concurrency limits per key and fair shares
        (when the call names no key): its agent's (``register_agent``), else
        its user, else its session."""
        return (agent_fairness_key(self.agent)
                or (self.user_id if self.user_id is not None else self.session_id))

    def metadata_json(self) -> str:
        return json.dumps(self.metadata, separators=(",", ":"))

    def task_args(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return task_args(self.kind, self.prompt, self.session_id, self.user_id, self.agent,
                         self.metadata)


def check_request(
    settings: Settings,
    prompt: object,
    session_id: object,
    user_id: object = None,
    agent: object = "default",
    metadata: object = None,
    *,
    kind: Kind = "run",
    fleet_agents: list[str] | None = None,
) -> RunRequest:
    """A :class:`RunRequest`, or :class:`InvalidInput` saying what is wrong.
    The agent must be registered in this process, or (``fleet_agents``: the
    agents the fleet's registry has, for an enqueue) known from the fleet's."""
    if not isinstance(prompt, str):
        raise InvalidInput(f"prompt must be a string, not {type(prompt).__name__}")
    if not prompt.strip():
        raise InvalidInput("prompt is empty; pass the text the agent should act on")
    if len(prompt) > settings.max_prompt_chars:
        raise InvalidInput(
            f"prompt is {len(prompt)} characters long; the limit is {settings.max_prompt_chars} "
            "(LOOMFLOW_WORKER_MAX_PROMPT_CHARS)"
        )
    check_text("prompt", prompt)
    check_id("session_id", session_id)
    assert isinstance(session_id, str)
    if user_id is not None:
        check_id("user_id", user_id)
        assert isinstance(user_id, str)
    if not isinstance(agent, str):
        raise InvalidInput(f"agent must be a string, not {type(agent).__name__}")
    if fleet_agents is None:
        agent_factory(agent)
    else:
        check_agent_known(agent, fleet_agents)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise InvalidInput(
            f"metadata must be a JSON object (a dict), not {type(metadata).__name__}"
        )
    check_json_text("metadata", metadata)
    try:
        encoded = json.dumps(metadata, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"metadata isn't JSON: {exc}") from exc
    if len(encoded.encode()) > settings.max_metadata_bytes:
        raise InvalidInput(
            f"metadata is {len(encoded.encode())} bytes as JSON; the limit is "
            f"{settings.max_metadata_bytes} (LOOMFLOW_WORKER_MAX_METADATA_BYTES)"
        )
    if "request_id" in metadata:
        raise InvalidInput("metadata key 'request_id' is reserved: the worker sets it")
    return RunRequest(prompt, session_id, user_id, agent, json.loads(encoded), kind)


def refuse_message(request_id: str, problem: str, reason: str) -> None:
    """Log and count a task message dropped unrun: ``problem`` says why,
    ``reason`` is the counter's label (malformed, mismatch)."""
    log.error(
        "message %s refused and dropped: %s; nothing ran and the ledger is unchanged",
        request_id, problem,
        extra={"action": "message_refused", "request": request_id, "reason": reason},
    )
    metrics.count_refused(reason)
