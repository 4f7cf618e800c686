"""What one worker process owns to run requests: its parts, each with a
start and a stop, as Celery's bootsteps are.

- :class:`.Database`: the runtime, connected once, the schema migrated,
  the fleet's model budgets and concurrency limits;
- :class:`.Heart`: the runs' heartbeat and the process's presence;
- :class:`.Watch`: how late the process's loop runs, and what held it;
- :class:`Stream`: the runs' live events, to Redis;
- :class:`.Agents`: the agents it builds, once each.

A prefork worker's parent only builds the agents (``serving`` false)."""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread

from .. import metrics
from ..events import EventPublisher, events_url
from ..execution import ledger
from ..execution.budgets import CostBudgets
from ..execution.host import Halt
from ..execution.limits import Limits
from ..execution.pacing import Budgets
from ..execution.pending import Pending
from ..execution.statuses import QuarantineLevel
from ..pricing import Prices
from ..runtime import PostgresRuntime
from ..runtime.loopwatch import LoopWatch
from ..settings import Settings
from .agents import Agents
from .database import Database
from .fair_turns import FairTurns
from .heart import Heart
from .watch import Watch


class Stream:
    """The runs' live events: a publisher to Redis while the process serves
    (none when events are off), its batches gathering longer as the process
    carries more runs (``load()``)."""

    def __init__(self, settings: Settings, load: Callable[[], int]) -> None:
        self.settings, self.load = settings, load
        self.publisher: EventPublisher | None = None

    def start(self) -> None:
        url = events_url(self.settings)
        if url is not None:
            self.publisher = EventPublisher(
                url, prefix=self.settings.redis_key_prefix, maxlen=self.settings.events_maxlen,
                retention=self.settings.events_retention, load=self.load)

    async def stop(self) -> None:
        if self.publisher is not None:
            await self.publisher.aclose()
            self.publisher = None


class WorkerContext:
    """What one pool child owns: its runtime and the agents built with it
    (an :class:`~loomflow_worker.execution.host.Host` to the attempts it runs)."""

    def __init__(
        self, settings: Settings, slots: int = 1, node: str | None = None, *,
        quarantine: int = 0, serving: bool = True,
        publish_turns: Callable[[list[Pending]], None] | None = None,
    ) -> None:
        """``slots``: how many runs this process carries at once; ``node``:
        the Celery node it serves (the host name when none); ``quarantine``:
        it runs suspected requests, each of which it hands back once it
        completes a step, a few together (``QuarantineLevel.GROUP``) or one alone
        (``QuarantineLevel.ALONE``); ``serving`` false: it only builds the agents
        (a prefork worker's parent, before it forks its children), with no
        heartbeat, no row in ``workers`` or ``worker_agents``, no loop watch
        and no events; ``publish_turns``: how it publishes the requests whose
        fair turn came (a Celery worker's, given as it boots; without it a
        run's end hands them to its caller)."""
        self.settings = settings
        self.serving = serving
        self.slots = slots
        self.in_quarantine = quarantine > 0
        # The quarantine its runs get (see ledger.precheck): a process of one
        # slot runs each request alone.
        self.quarantine = QuarantineLevel.given(quarantine, slots)
        self.node = node or socket.gethostname()
        # The process as the ledger names the worker running a request (its `holder`
        # column), and its ``workers`` row.
        self.worker = ledger.worker_name(self.node, os.getpid())
        # What model calls cost (settings' prices over genai-prices' table).
        self.prices = Prices(settings.prices)
        # Whether a run that would wait long for its model key gives its slot
        # back (a Celery worker, which publishes it again; not an in-process
        # caller, nor a request running in quarantine).
        self.parks = not self.in_quarantine
        # Whether the process takes new requests (admission may pause it).
        self.admitting: Callable[[], bool] = lambda: True
        # Running requests of this process, by id: how to halt each.
        self._halts: dict[str, Halt] = {}
        self.database = Database(settings, self.worker, slots)
        self.agents = Agents(self.worker, self.runtime, lambda: self.database.budgets,
                             record=serving)
        self.watch = Watch(settings, lambda: len(self._halts),
                           build_codes=(Agents.agent.__code__,))
        self.heart = Heart(settings, self.worker, slots, runs=lambda: len(self._halts),
                           lag=self.watch.lag, lock_queue=self.database.queue_depth,
                           admitting=lambda: self.admitting(), room=self._room)
        self.stream = Stream(settings, load=lambda: len(self._halts))
        self.publish_turns = publish_turns
        self._fair_turns: FairTurns | None = None

    # What an attempt takes from its process (execution.host.Host).

    @property
    def events(self) -> EventPublisher | None:
        return self.stream.publisher

    @events.setter
    def events(self, publisher: EventPublisher | None) -> None:
        self.stream.publisher = publisher

    @property
    def limits(self) -> Limits | None:
        return self.database.limits

    @property
    def cost_budgets(self) -> CostBudgets | None:
        return self.database.cost_budgets

    @property
    def budgets(self) -> Budgets | None:
        return self.database.budgets

    @property
    def versions(self) -> dict[str, str]:
        return self.agents.versions

    async def runtime(self) -> PostgresRuntime:
        """The process's runtime, started with its parts the first time."""
        if self.database.runtime is None and await self.database.start() and self.serving:
            self._serve()
        assert self.database.runtime is not None
        return self.database.runtime

    async def agent(self, name: str) -> Any:
        return await self.agents.agent(name)

    async def version(self, name: str) -> str:
        """The version of agent ``name`` as this process builds it."""
        return await self.agents.version(name)

    def backoff(self, failures: int) -> float:
        """Full-jitter exponential backoff for the ``failures``-th retry."""
        cap = min(
            self.settings.retry_backoff_max, self.settings.retry_backoff * 2 ** (failures - 1)
        )
        return random.uniform(cap / 2, cap)

    def run_started(self, request_id: str, halt: Halt) -> None:
        self._halts[request_id] = halt

    def run_ended(self, request_id: str) -> None:
        self._halts.pop(request_id, None)

    def fair_turns(self) -> FairTurns | None:
        """The process's looks for requests whose fair turn came, once its
        runtime is up, when it publishes them itself."""
        runtime, limits = self.database.runtime, self.database.limits
        if (self._fair_turns is None and self.publish_turns is not None
                and runtime is not None and limits is not None):
            self._fair_turns = FairTurns(runtime.pool, limits.fair, self.publish_turns,
                                         looker=self._looker)
        return self._fair_turns

    def _looker(self) -> ledger.LookerState:
        """What the process's row says of it, written by each fair look first."""
        return ledger.LookerState(self.worker, len(self._halts), self.admitting())

    def _room(self) -> None:
        """The process's row says it has free slots (its start, each heartbeat
        interval): requests withheld for their fair turn may take them now, not
        only when one of its runs ends (a worker that starts on a withheld
        backlog would otherwise wait for its first run to end)."""
        turns = self.fair_turns()
        if turns is not None:
            turns.poke()

    # What the worker's hooks ask of it.

    @property
    def watch_observers(self) -> list[Callable[[LoopWatch], None]]:
        """What looks at the loop watch on each of its ticks (admission control)."""
        return self.watch.observers

    async def serve_agents(self) -> dict[str, str]:
        """Build every registered agent now, as a worker does at start: each
        one's version, by name."""
        return await self.agents.serve()

    def result_stored(self, request_id: str) -> None:
        """This process stored ``request_id``'s result (see :meth:`.Heart.result_stored`)."""
        self.heart.result_stored(request_id)

    def queue_depth(self) -> int:
        """Statements waiting for the process's lock connections."""
        return self.database.queue_depth()

    def halt(self, request_id: str, reason: str, *, timed_out: bool = False) -> bool:
        """Stop a running request of this process at once, mid-step: it ends
        ``cancelled`` with ``reason`` (a revoke with terminate), or, when
        ``timed_out`` (Celery's soft time limit), ``failed`` as past its time
        limit. ``False`` when it does not run here."""
        halt = self._halts.get(request_id)
        if halt is None:
            return False
        halt(reason, timed_out)
        return True

    def _serve(self) -> None:
        """Start the parts of a process that serves, once its runtime is up."""
        assert self.database.runtime is not None
        # loomflow runs a synchronous tool in a worker thread, so it never
        # blocks the other runs; anyio's default of 40 such threads at once
        # would make the runs of a busy process queue for them.
        limiter = anyio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = max(limiter.total_tokens, self.slots)
        self.heart.start(self.database.runtime)
        meter = metrics.get()
        if meter is not None:
            self.database.runtime.journal.time_writes(meter.journal_write.observe)
        self.watch.start()
        self.stream.start()

    async def aclose(self) -> None:
        """Stop each part, the last started first."""
        self.watch.stop()
        await self.heart.stop(self.database.runtime if self.serving else None)
        await self.agents.stop()
        await self.stream.stop()
        if self._fair_turns is not None:
            await self._fair_turns.aclose()
            self._fair_turns = None
        await self.database.stop()
