"""Agents by name: ``@register_agent("name")`` on a factory ``build(runtime) -> Agent``."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..runtime.errors import InvalidInput
from ..settings import check_key
from .versions import check_version

AgentFactory = Callable[[Any], Any]
F = TypeVar("F", bound=AgentFactory)

DEFAULT_AGENT = "default"
#: What becomes of a request whose version no live worker serves (see register_agent).
ON_VERSION_GONE = ("wait", "upgrade", "cancel")
#: Seconds with no live worker of its version before the policy acts.
DEFAULT_GRACE = 600.0

_factories: dict[str, AgentFactory] = {}
_time_limits: dict[str, float] = {}
_model_keys: dict[str, str] = {}
_limits: dict[str, tuple[str, ...]] = {}
_fairness_keys: dict[str, str] = {}
_versions: dict[str, str] = {}
_on_version_gone: dict[str, tuple[str, float]] = {}
# Agents this process knows only from the fleet's registry (worker_agents, as
# the workers that build them recorded them): what enqueuing needs of each.
_fleet: dict[str, FleetAgent] = {}
_imported: set[str] = set()


@dataclass(frozen=True)
class FleetAgent:
    """An agent as the fleet's workers recorded it (``worker_agents``): what a
    process that enqueues without the agents' code needs of it."""

    fairness_key: str | None
    limits: tuple[str, ...]
    time_limit: float | None
    model_key: str | None


def learn_fleet_agent(name: str, agent: FleetAgent | None) -> None:
    """Know ``name`` from the fleet's registry (``None``: forget it); an agent
    registered in this process is never shadowed."""
    _set(_fleet, name, agent)


def agent_registered(name: str) -> bool:
    """Whether this process can build agent ``name`` (it imported its module)."""
    return name in _factories


def check_agent_known(name: str, fleet_names: list[str] | None = None) -> None:
    """Refuse an agent neither this process nor the fleet's registry knows
    (``fleet_names``: every agent the registry has, for the message)."""
    if name in _factories or name in _fleet:
        return
    here = ", ".join(sorted(_factories)) or "none"
    if fleet_names is None:
        agent_factory(name)
    fleet = ", ".join(sorted(fleet_names or [])) or "none yet"
    raise InvalidInput(
        f"unknown agent {name!r} (registered in this process: {here}; by the fleet's "
        f"workers: {fleet}); a worker records the agents it serves when it starts, so start "
        "one, or import the agents module here (LOOMFLOW_WORKER_AGENTS)")


def register_agent(
    name: str = DEFAULT_AGENT,
    *,
    time_limit: float | None = None,
    model_key: str | None = None,
    limits: Iterable[str] = (),
    fairness_key: str | None = None,
    version: str | None = None,
    on_version_gone: str = "wait",
    grace: float = DEFAULT_GRACE,
) -> Callable[[F], F]:
    """Register ``build(runtime) -> loomflow.Agent`` under ``name``.

    Workers call the factory inside their event loop with the runtime they
    own; build the agent there (no connections opened at import).
    ``time_limit`` (seconds) overrides ``LOOMFLOW_WORKER_RUN_TIME_LIMIT``
    for this agent's runs. ``model_key`` names the budget its model calls
    share with every agent of the same key (``LOOMFLOW_WORKER_MODEL_LIMITS``;
    e.g. the provider key they use); by default, its model's name.
    ``limits`` names the concurrency limits its runs count toward with every
    agent that names them (``LOOMFLOW_WORKER_LIMITS``), besides ``per_key``
    and its own ``agent:NAME``. ``fairness_key`` is the key its requests
    count under for per_key limits and fair shares when the call names none
    (by default, each request's user, else its session). ``version`` declares
    the agent's version (1 to 64 letters, digits or ``._+-``), changed only
    when its team changes it; by default the version is a digest of the agent
    as the worker builds it (:func:`.versions.agent_version`). A request is
    pinned to the version its first attempt ran; ``on_version_gone`` says what
    becomes of one whose version no live worker has served for ``grace``
    seconds: ``"wait"`` (the default: it waits, visibly, for a worker of its
    version), ``"upgrade"`` (it moves to the newest version a live worker
    serves, as ``loomflow-worker upgrade`` moves it) or ``"cancel"``."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidInput("register_agent needs a non-empty agent name")
    if time_limit is not None and time_limit <= 0:
        raise InvalidInput(f"time_limit must be positive seconds, not {time_limit}")
    if model_key is not None:
        try:
            check_key(model_key)
        except ValueError as exc:
            raise InvalidInput(f"model_key {model_key!r}: {exc}") from None

    if fairness_key is not None:
        try:
            check_key(fairness_key, "fairness key")
        except ValueError as exc:
            raise InvalidInput(f"fairness_key {fairness_key!r}: {exc}") from None
    if version is not None:
        check_version(version)
    if on_version_gone not in ON_VERSION_GONE:
        choices = ", ".join(map(repr, ON_VERSION_GONE))
        raise InvalidInput(f"on_version_gone must be one of {choices}, not {on_version_gone!r}")
    if not isinstance(grace, int | float) or grace <= 0:
        raise InvalidInput(f"grace must be positive seconds, not {grace!r}")
    if isinstance(limits, str):
        raise InvalidInput(f"limits is a list of limit names, not the string {limits!r}")
    shared = tuple(limits)
    for limit in shared:
        try:
            check_key(limit, "limit name")
        except ValueError as exc:
            raise InvalidInput(f"limits: {limit!r}: {exc}") from None
        if limit in ("per_key", "fair_queue") or limit.startswith("agent:"):
            raise InvalidInput(f"limits: {limit!r} applies by itself; name shared limits only")

    def decorate(factory: F) -> F:
        _factories[name] = factory
        _set(_time_limits, name, time_limit)
        _set(_model_keys, name, model_key)
        _set(_limits, name, shared or None)
        _set(_fairness_keys, name, fairness_key)
        _set(_versions, name, version)
        _set(_on_version_gone, name,
             None if on_version_gone == "wait" else (on_version_gone, float(grace)))
        return factory

    return decorate


def import_agent_modules(modules: Iterable[str]) -> None:
    """Import each module that registers agents (once per process)."""
    for module in modules:
        if module in _imported:
            continue
        try:
            _import(module)
        except ImportError as exc:
            raise InvalidInput(
                f"can't import agents module {module!r} (LOOMFLOW_WORKER_AGENTS): {exc}"
            ) from exc
        _imported.add(module)


def _import(module: str) -> None:
    """Import ``module``; not found, from the folder this process runs in, as
    ``celery worker`` finds it (Celery puts that folder on ``sys.path``): a
    command run from the folder the worker starts in imports what it imports."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        here = os.getcwd()
        if exc.name != module.partition(".")[0] or here in sys.path or "" in sys.path:
            raise
        sys.path.insert(0, here)
        importlib.import_module(module)


def agent_factory(name: str) -> AgentFactory:
    try:
        return _factories[name]
    except KeyError:
        known = ", ".join(sorted(_factories)) or "none"
        raise InvalidInput(
            f"unknown agent {name!r} (registered: {known}); register it with "
            "@loomflow_worker.register_agent and list its module in LOOMFLOW_WORKER_AGENTS"
        ) from None


def agent_time_limit(name: str) -> float | None:
    if name in _factories or name not in _fleet:
        return _time_limits.get(name)
    return _fleet[name].time_limit


def agent_limits(name: str) -> tuple[str, ...]:
    """The shared concurrency limits ``register_agent`` gave the agent."""
    if name in _factories or name not in _fleet:
        return _limits.get(name, ())
    return _fleet[name].limits


def agent_fairness_key(name: str) -> str | None:
    """The fairness key ``register_agent`` gave the agent's requests, if any."""
    if name in _factories or name not in _fleet:
        return _fairness_keys.get(name)
    return _fleet[name].fairness_key


def agent_declared_version(name: str) -> str | None:
    """The version ``register_agent`` declared for the agent, if any."""
    return _versions.get(name)


def agent_on_version_gone(name: str) -> tuple[str, float]:
    """What becomes of the agent's requests whose version is gone, and after
    how many seconds (``register_agent``'s ``on_version_gone`` and ``grace``)."""
    return _on_version_gone.get(name, ("wait", DEFAULT_GRACE))


def agent_model_key(name: str) -> str | None:
    """The model key ``register_agent`` gave the agent, if any."""
    if name in _factories or name not in _fleet:
        return _model_keys.get(name)
    return _fleet[name].model_key


def _set(table: dict[str, Any], name: str, value: Any) -> None:
    if value is None:
        table.pop(name, None)
    else:
        table[name] = value


def registered_agents() -> list[str]:
    return sorted(_factories)


def agent_modules() -> list[str]:
    """The modules whose import registered the agents (a process of its own
    imports them to build the same agents)."""
    return sorted({factory.__module__ for factory in _factories.values()})
