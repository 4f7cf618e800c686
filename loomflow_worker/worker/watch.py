"""How late the process's event loop runs: one component with a start and a
stop, around the runtime's :class:`.LoopWatch`, saying what held the loop."""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import CodeType

from .. import metrics
from ..runtime import PostgresRuntime
from ..runtime.loopwatch import LoopWatch, Stall
from ..settings import Settings

log = logging.getLogger(__name__)


class Watch:
    """The loop watch of a process carrying ``runs()`` runs: its lag, and a
    warning naming what held the loop (a run's step, an agent's factory, or
    nothing: the whole process was stopped). ``observers`` look at it on
    each of its ticks (admission control); ``build_codes`` are those of the
    function that builds an agent."""

    def __init__(self, settings: Settings, runs: Callable[[], int],
                 build_codes: tuple[CodeType, ...]) -> None:
        self.settings, self.runs, self.build_codes = settings, runs, build_codes
        self.observers: list[Callable[[LoopWatch], None]] = []
        self.watch: LoopWatch | None = None

    def lag(self) -> float:
        """How late the loop runs now (0 while unwatched)."""
        return self.watch.lag() if self.watch is not None else 0.0

    def start(self) -> None:
        meter = metrics.get()
        self.watch = LoopWatch(
            stall=self.settings.loop_stall_warning,
            step_codes=PostgresRuntime.step_codes(),
            build_codes=self.build_codes,
            on_stall=self._stalled,
            on_lag=meter.loop_lag.observe if meter is not None else None,
        )
        self.watch.observers = self.observers
        self.watch.start()

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.stop()
            self.watch = None

    def _stalled(self, stall: Stall) -> None:
        """The loop was held (from the loop watch's thread): say by what, or
        that the whole process was stopped."""
        runs = self.runs()
        if stall.frozen:
            log.warning(
                "the whole process was stopped for %.1fs (SIGSTOP, a paused VM or container, "
                "or a machine that gave it no CPU): no run held the event loop. Each of its "
                "%d runs confirms its lease before its next step, and a run whose lease may "
                "have lapsed meanwhile is fenced", stall.held, runs,
                extra={"action": "process_stopped", "held": round(stall.held, 3)},
            )
            _count_stall()
            return
        if stall.culprit is not None and stall.culprit.agent is not None:
            # Not a run's code: an agent's factory (and the modules it imports
            # the first time), once per process.
            log.log(
                logging.WARNING if runs else logging.INFO,
                "building agent %r took the event loop for %.1fs (its factory, at %s); "
                "%d runs of this process waited as long", stall.culprit.agent, stall.held,
                stall.culprit.where, runs,
                extra={"action": "agent_build_stall", "agent": stall.culprit.agent,
                       "held": round(stall.held, 3)},
            )
            return
        culprit = stall.culprit.describe() if stall.culprit is not None else "unknown code"
        log.warning(
            "the event loop was held for %.1fs by %s; the %d other runs of this process "
            "waited as long. A tool that blocks (time.sleep, a synchronous client) in an "
            "async def holds every run: make it a plain def (loomflow runs those in a "
            "thread) or await an async call", stall.held, culprit, max(0, runs - 1),
            extra={"action": "loop_stall", "held": round(stall.held, 3),
                   "request": stall.culprit.request_id if stall.culprit else None,
                   "step": stall.culprit.step if stall.culprit else None},
        )
        _count_stall()


def _count_stall() -> None:
    meter = metrics.get()
    if meter is not None:
        meter.loop_stalls.inc()
