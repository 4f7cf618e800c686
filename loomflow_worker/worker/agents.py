"""The agents a worker process builds: one component that builds each agent
once, on first use, with its version, paced, recorded in the fleet's
registry, and closes them when the process stops."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from loomflow.memory.inmemory import InMemoryMemory

from ..execution import ledger
from ..execution.pacing import Budgets, pace
from ..execution.registry import (
    agent_declared_version,
    agent_factory,
    agent_fairness_key,
    agent_limits,
    agent_model_key,
    agent_time_limit,
    registered_agents,
)
from ..execution.runnables import agents_within
from ..execution.versions import agent_version
from ..runtime import PostgresRuntime

log = logging.getLogger(__name__)


class Agents:
    """The agents of process ``worker``, built on the runtime ``runtime()``
    gives, paced under ``budgets()``; ``record``: it serves them (its build
    recorded in ``worker_agents``)."""

    def __init__(self, worker: str, runtime: Callable[[], Awaitable[PostgresRuntime]],
                 budgets: Callable[[], Budgets | None], *, record: bool) -> None:
        self.worker, self.runtime, self.budgets, self.record = worker, runtime, budgets, record
        self._agents: dict[str, Any] = {}
        # Each agent's version, as built here (execution.versions).
        self.versions: dict[str, str] = {}

    async def agent(self, name: str) -> Any:
        """Agent ``name``, built the first time it is asked for."""
        if name not in self._agents:
            agent = agent_factory(name)(await self.runtime())
            declared = agent_declared_version(name)
            # Before pacing wraps its model: the version is of the agent as written.
            self.versions[name] = version = agent_version(agent, declared)
            log.info("agent %r version %s (%s)", name, version,
                     "declared" if declared else "a digest of its definition",
                     extra={"action": "agent_version", "agent": name, "version": version})
            if self.record:
                await self._record_built(name, version, declared is not None)
            budgets = self.budgets()
            assert budgets is not None
            for each in agents_within(agent):
                pace(each, agent_model_key(name), budgets)
            if any(type(getattr(each, "_memory", None)) is InMemoryMemory
                   for each in agents_within(agent)):
                log.warning(
                    "agent %r keeps its memory in this process (loomflow's default): each "
                    "worker recalls a different history, and a request resumed on another "
                    "worker sends its model calls again. Give it a memory every worker "
                    "shares (loomflow's PostgresMemory or RedisMemory), or "
                    "loomflow_worker.NoMemory if it needs none.", name,
                    extra={"action": "memory_per_process", "agent": name},
                )
            self._agents[name] = agent
        return self._agents[name]

    async def version(self, name: str) -> str:
        """The version of agent ``name`` as this process builds it."""
        await self.agent(name)
        return self.versions[name]

    async def serve(self) -> dict[str, str]:
        """Build every registered agent now, as a worker does at start: each
        one's version, by name (an agent whose factory fails is logged and left
        out; its requests fail as they come, as before)."""
        for name in registered_agents():
            try:
                await self.agent(name)
            except Exception:
                log.exception("agent %r could not be built; its requests fail until it can",
                              name, extra={"action": "agent_build_failed", "agent": name})
        return dict(self.versions)

    async def stop(self) -> None:
        """Close each agent that closes (its model clients)."""
        for agent in self._agents.values():
            closer = getattr(agent, "aclose", None)
            if closer is not None:
                await closer(timeout=5.0)
        self._agents.clear()

    async def _record_built(self, name: str, version: str, declared: bool) -> None:
        """The fleet's registry of agents learns that this process serves
        ``name`` at ``version`` (logged, not raised, when Postgres is away:
        its next build records it)."""
        built = ledger.BuiltAgent(
            worker=self.worker, agent=name, version=version, declared=declared,
            fairness_key=agent_fairness_key(name), limits=list(agent_limits(name)),
            time_limit=agent_time_limit(name), model_key=agent_model_key(name))
        try:
            async with (await self.runtime()).pool.connection() as conn:
                await ledger.agent_built(conn, built)
        except Exception as exc:
            log.warning("could not record agent %r version %s in worker_agents: %s", name,
                        version, exc, extra={"action": "agent_record", "agent": name})
