"""Agents by name: ``@register_agent("name")`` on a factory ``build(runtime) -> Agent``."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from ..runtime.errors import InvalidInput

AgentFactory = Callable[[Any], Any]
F = TypeVar("F", bound=AgentFactory)

DEFAULT_AGENT = "default"

_factories: dict[str, AgentFactory] = {}
_imported: set[str] = set()


def register_agent(name: str = DEFAULT_AGENT) -> Callable[[F], F]:
    """Register ``build(runtime) -> loomflow.Agent`` under ``name``.

    Workers call the factory inside their event loop with the runtime they
    own; build the agent there (no connections opened at import)."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidInput("register_agent needs a non-empty agent name")

    def decorate(factory: F) -> F:
        _factories[name] = factory
        return factory

    return decorate


def import_agent_modules(modules: Iterable[str]) -> None:
    """Import each module that registers agents (once per process)."""
    for module in modules:
        if module in _imported:
            continue
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise InvalidInput(
                f"can't import agents module {module!r} (LOOMFLOW_WORKER_AGENTS): {exc}"
            ) from exc
        _imported.add(module)


def agent_factory(name: str) -> AgentFactory:
    try:
        return _factories[name]
    except KeyError:
        known = ", ".join(sorted(_factories)) or "none"
        raise InvalidInput(
            f"unknown agent {name!r} (registered: {known}); register it with "
            "@loomflow_worker.register_agent and list its module in LOOMFLOW_WORKER_AGENTS"
        ) from None


def registered_agents() -> list[str]:
    return sorted(_factories)
