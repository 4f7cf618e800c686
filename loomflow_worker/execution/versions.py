"""An agent's version: what decides how its runs replay, as one short digest.

A resumed run finds its completed steps by a fingerprint of their inputs, so a
deploy that changes an agent (its instructions, its model or the model's
settings, a tool or a tool's arguments, its architecture, its output schema,
a sub-agent) changes what a replay does. :func:`agent_version` digests the
agent's definition as the worker builds it: the same code gives the same
version in every process and on every host (nothing of a process, a clock,
a counter, a secret or a connection goes in), and any change that could
change a replay gives another. ``register_agent(..., version="...")``
declares one instead, for a team that versions by hand.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..runtime.errors import InvalidInput

#: A declared version: a letter or digit, then letters, digits and ``._+-``, 64 at most.
_DECLARED = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
MAX_VERSION = 64

#: Attributes of a model or an architecture that say nothing of what a replay
#: does: secrets, clients and connections, clocks and waits, counters, caches.
_NOT_DEFINITION = re.compile(
    r"(api_?key|secret|password|credential|client|session|lock|timeout|latency|sleep|delay"
    r"|calls|count|cost|cache|stats|http|url|headers|telemetry|logger|hooks|retry|retries)",
    re.IGNORECASE,
)
#: How deep an object's attributes are followed.
_DEPTH = 4


def check_version(version: object) -> str:
    """A declared version, checked: a non-empty string of letters, digits and
    ``._+-`` of at most 64 characters (it names queues and metric labels)."""
    if not isinstance(version, str) or not _DECLARED.fullmatch(version):
        shown = repr(version) if len(repr(version)) <= 80 else repr(version)[:77] + "..."
        raise InvalidInput(
            f"version {shown} is not a version: give 1 to {MAX_VERSION} letters, digits or "
            "'._+-', starting with a letter or digit (e.g. '2026-12-06' or 'v3')"
        )
    return version


def queue_suffix(agent: str, version: str) -> str:
    """What follows a queue's name in the name of the queue its requests
    pinned to ``version`` of ``agent`` go to: ``loomflow`` becomes
    ``loomflow@deploy@v1``. Workers of that version take messages from it
    beside their own queues."""
    return f"@{agent}@{version}"


def agent_version(agent: Any, declared: str | None = None) -> str:
    """``declared`` if given, else a digest of the agent's definition (12 hex digits)."""
    if declared is not None:
        return check_version(declared)
    text = json.dumps(describe_agent(agent), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def describe_agent(agent: Any, seen: frozenset[int] = frozenset()) -> dict[str, Any]:
    """What of ``agent`` decides how its runs replay, as JSON values (its
    sub-agents' definitions within it; an agent met again inside itself is
    named, not followed)."""
    if id(agent) in seen:
        return {"agent": _qualname(agent), "cycle": True}
    seen = seen | {id(agent)}
    nodes = getattr(agent, "_raw_nodes", None)
    if isinstance(nodes, dict):  # a loomflow Workflow: its nodes and how they connect
        return {
            "workflow": getattr(agent, "name", None),
            "nodes": {name: describe_agent(node, seen) if _is_agent(node) or isinstance(
                getattr(node, "_raw_nodes", None), dict) else _describe(node)
                for name, node in nodes.items()},
            "edges": _describe(getattr(agent, "_edges", None)),
            "start": getattr(agent, "_start", None),
        }
    tools = getattr(getattr(agent, "_tool_host", None), "_tools", {}) or {}
    return {
        "agent": _qualname(agent),
        "instructions": getattr(agent, "_instructions", None),
        "model": _describe(getattr(agent, "_model", None)),
        "tools": [_describe_tool(tool, seen) for _, tool in sorted(tools.items())],
        "architecture": _describe(getattr(agent, "_architecture", None)),
        "output_schema": _schema(getattr(agent, "_default_output_schema", None)),
        "effort": _describe(getattr(agent, "_default_effort", None)),
        "strict_effort": _describe(getattr(agent, "_strict_effort", None)),
        "max_turns": _describe(getattr(agent, "_max_turns", None)),
    }


def _describe_tool(tool: Any, seen: frozenset[int]) -> dict[str, Any]:
    to_def = getattr(tool, "to_def", None)
    definition = to_def().model_dump(mode="json") if callable(to_def) else _qualname(tool)
    return {"tool": definition,
            "agents": [describe_agent(a, seen) for a in _agents_in(getattr(tool, "fn", None))]}


def _agents_in(fn: Any) -> list[Any]:
    """The agents a tool's callable runs (a sub-agent): its bound object, the
    arguments of a ``functools.partial``, the cells of its closure."""
    found: list[Any] = []
    candidates = [getattr(fn, "__self__", None), *getattr(fn, "args", ()),
                  *getattr(fn, "keywords", {}).values()]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            candidates.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    for value in candidates:
        if _is_agent(value) and all(value is not f for f in found):
            found.append(value)
    return found


def _is_agent(value: Any) -> bool:
    return hasattr(value, "_instructions") and hasattr(value, "_tool_host")


def _schema(value: Any) -> Any:
    json_schema = getattr(value, "model_json_schema", None)
    if isinstance(value, type) and callable(json_schema):
        return json_schema()
    return _describe(value)


def _describe(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON values: scalars as they are, collections item by item,
    a pydantic model by its JSON, another object by its class and the
    attributes of it that define behaviour (see ``_NOT_DEFINITION``)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if _is_agent(value):
        return {"agent": _qualname(value)}
    if depth >= _DEPTH:
        return _qualname(value)
    if isinstance(value, list | tuple | set | frozenset):
        items = [_describe(item, depth + 1) for item in value]
        return sorted(items, key=json.dumps) if isinstance(value, set | frozenset) else items
    if isinstance(value, Mapping):
        return {str(k): _describe(v, depth + 1) for k, v in value.items()
                if not _NOT_DEFINITION.search(str(k))}
    if isinstance(value, type):
        return _qualname(value, of_class=True)
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        try:
            return _describe(dump(mode="json"), depth + 1)
        except Exception:  # a model that can't be dumped is described by its attributes
            pass
    if callable(value):
        return _qualname(value)
    attributes = getattr(value, "__dict__", None)
    if not isinstance(attributes, dict):
        return _qualname(value)
    return {
        "class": _qualname(value),
        **{name: _describe(attr, depth + 1) for name, attr in sorted(attributes.items())
           if not _NOT_DEFINITION.search(name) and not callable(attr)},
    }


def _qualname(value: Any, *, of_class: bool = False) -> str:
    kind = value if of_class else type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


@dataclass(frozen=True)
class VersionInfo:
    """One version of one agent, as ``versions`` lists it: the live workers
    serving it, when a worker of it was last seen and built it, whether its
    team declared it, and the unfinished requests pinned to it: running,
    waiting for a worker of it (since ``waiting_since``), queued otherwise."""

    agent: str
    version: str
    declared: bool
    workers: list[str]
    seen_at: datetime | None
    built_at: datetime | None
    running: int
    waiting: int
    queued: int
    waiting_since: datetime | None
    now: datetime

    @property
    def live(self) -> bool:
        return bool(self.workers)
