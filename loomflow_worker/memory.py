"""A memory for agents on a fleet that need none.

loomflow's default memory lives in one process: on a fleet each worker
recalls a different history, so the same request has different model inputs
on different workers, and a run resumed on another worker sends its model
calls again instead of replaying them. An agent whose requests carry what
it needs takes :class:`NoMemory`; one that needs history across requests
takes a memory every worker shares (loomflow's ``PostgresMemory`` or
``RedisMemory``)."""

from __future__ import annotations

from loomflow.core.types import Episode
from loomflow.memory.inmemory import InMemoryMemory


class NoMemory(InMemoryMemory):
    """Keeps no episodes, so recalls nothing and no session history: a run's
    inputs are the same on every worker. (Working blocks an agent sets
    itself still live in the process.)"""

    async def remember(self, episode: Episode) -> str:
        return episode.id
