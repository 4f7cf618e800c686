"""What one attempt of a request takes from the worker process that runs it,
declared here so the execution core depends on no worker (the worker's
context, :class:`loomflow_worker.worker.context.WorkerContext`, is one)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ..pricing import Prices
from ..runtime import PostgresRuntime
from ..settings import Settings
from .budgets import CostBudgets
from .limits import Limits
from .statuses import QuarantineLevel

#: How to halt a running request: ``(reason, timed_out)``.
Halt = Callable[[str, bool], None]


class LiveEvents(Protocol):
    """Where a run's events go as they happen (a request's live stream)."""

    def publish(self, request_id: str, attempt: int, kind: str, data: str, *,
                replayed: bool) -> None: ...

    def end(self, request_id: str, attempt: int, status: str, error: str | None) -> None: ...

    async def sent(self, within: float) -> None: ...


class TurnLooks(Protocol):
    """The process's looks for requests withheld for their fair turn (the
    worker's :class:`loomflow_worker.worker.fair_turns.FairTurns`)."""

    def poke(self) -> None:
        """A run ended, its message left the broker: look soon."""


class Host(Protocol):
    """The worker process an attempt runs in: its settings and runtime, its
    agents, its limits and live events, and where its running requests are
    known (to halt them, and to count them)."""

    settings: Settings
    #: The Celery node it serves (the host name when none).
    node: str
    #: The quarantine it gives its runs (see ``ledger.precheck``).
    quarantine: QuarantineLevel
    #: Whether it is a process of quarantine (a suspect that completes a step
    #: is handed back from it).
    in_quarantine: bool
    #: Whether a run that would wait long for its model key gives its slot back.
    parks: bool
    prices: Prices

    @property
    def events(self) -> LiveEvents | None: ...

    @property
    def limits(self) -> Limits | None: ...

    @property
    def cost_budgets(self) -> CostBudgets | None: ...

    @property
    def versions(self) -> dict[str, str]:
        """Each agent's version, as built here."""

    async def runtime(self) -> PostgresRuntime: ...

    async def agent(self, name: str) -> Any: ...

    async def version(self, name: str) -> str: ...

    def backoff(self, failures: int) -> float: ...

    def run_started(self, request_id: str, halt: Halt) -> None: ...

    def run_ended(self, request_id: str) -> None: ...

    def fair_turns(self) -> TurnLooks | None:
        """The process's looks for requests whose fair turn came, when it
        publishes them itself (``None``: a run's end hands them to its caller)."""
