"""A worker process's runtime: one component that connects it, migrates the
schema, declares the process's model limits and concurrency limits, and
closes it."""

from __future__ import annotations

import anyio

from .. import metrics
from ..execution.budgets import CostBudgets
from ..execution.limits import Limits, set_limits
from ..execution.pacing import Budgets, set_model_limits
from ..runtime import PostgresRuntime
from ..settings import Settings


class Database:
    """The runtime of process ``worker`` carrying ``slots`` runs, made on
    first use (once, however many ask at once), with the fleet's model-call
    ``budgets``, concurrency ``limits`` and ``cost_budgets`` on it."""

    def __init__(self, settings: Settings, worker: str, slots: int) -> None:
        self.settings, self.worker, self.slots = settings, worker, slots
        self.runtime: PostgresRuntime | None = None
        self.budgets: Budgets | None = None
        self.limits: Limits | None = None
        self.cost_budgets: CostBudgets | None = None
        self._lock = anyio.Lock()

    async def start(self) -> bool:
        """Connect, unless connected; whether this call connected."""
        async with self._lock:
            if self.runtime is not None:
                return False
            settings = self.settings
            runtime = await PostgresRuntime.connect(
                settings.database_url.get_secret_value(),
                min_size=settings.pool_min_size,
                max_size=settings.pool_max_size,
                lock_wait_timeout=0,
                lock_io_timeout=settings.lock_io_timeout,
                lock_connections=min(settings.lock_connections, self.slots),
                connect_timeout=settings.connect_timeout,
                signals_per_scope=settings.signals_per_scope,
                on_signals_dropped=metrics.count_signals_dropped,
            )
            try:
                await runtime.init_schema()
                await set_model_limits(runtime.pool, settings)
                await set_limits(runtime.pool, settings, self.worker)
            except BaseException:
                await runtime.aclose()
                raise
            self.runtime = runtime
            self.budgets = Budgets(runtime.pool)
            self.limits = Limits(runtime.pool)
            self.cost_budgets = CostBudgets(runtime.pool)
            return True

    def queue_depth(self) -> int:
        """Statements waiting for the process's lock connections."""
        return self.runtime.journal.queue_depth() if self.runtime is not None else 0

    async def stop(self) -> None:
        if self.runtime is not None:
            await self.runtime.aclose()
            self.runtime = None
