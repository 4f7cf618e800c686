"""Admission: a worker process takes requests only while it can carry them.

``--concurrency`` is a ceiling, not a promise. Each tick of the loop watch
(:mod:`loomflow_worker.runtime.loopwatch`) looks at how late the process's
event loop runs and how many statements wait for its lock connections.
Past either limit the process stops taking messages from the broker: it
lowers Celery's prefetch count (the consumer's QoS) to one, so the backlog
waits in the broker and the ledger, where autoscalers and the console see
it, and the runs already admitted finish at full speed. Once both are back
under half their limits it gives the prefetch slots back a tenth of the
ceiling per tick, so a burst of new runs cannot swamp the loop at once.

Celery keeps changing the prefetch count for messages it holds (an eta):
admission only ever takes slots away and gives back those it took.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from .. import metrics
from ..runtime.loopwatch import LoopWatch

log = logging.getLogger(__name__)

#: How far back each look at the loop's lateness reaches (seconds).
LAG_WINDOW = 1.0


class Admission:
    """Pauses and resumes one Celery consumer by its process's load."""

    def __init__(
        self,
        qos: Any,
        *,
        ceiling: int,
        lag_limit: float,
        queue_limit: int,
        queue_depth: Callable[[], int],
        in_flight: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._qos = qos
        self._ceiling = ceiling
        self.lag_limit = lag_limit
        self.queue_limit = queue_limit
        self._queue_depth = queue_depth
        self._in_flight = in_flight
        self.admitting = True
        # How late the loop ran before admission started (the worker building
        # its agents at start, with no run to hold up) is no reason to pause.
        self._clock = clock
        self._since = clock()
        # Prefetch slots taken from the consumer, to give back.
        self.withheld = 0
        self.pauses = 0
        self._step = max(1, ceiling // 10)
        self._show()

    def observe(self, watch: LoopWatch) -> None:
        """One look at the load (from the loop watch's thread)."""
        within = min(LAG_WINDOW, self._clock() - self._since)
        lag, depth = watch.lag(within), self._queue_depth()
        meter = metrics.get()
        if meter is not None:
            meter.lock_queue.set(depth)
        if lag > self.lag_limit or depth > self.queue_limit:
            if self.admitting:
                self._pause(lag, depth)
            else:
                self._withhold()
        elif (lag < self.lag_limit / 2 and depth < self.queue_limit / 2
              and (self.withheld or not self.admitting)):
            self._give_back(lag, depth)

    def _pause(self, lag: float, depth: int) -> None:
        self.admitting = False
        self.pauses += 1
        self._withhold()
        log.warning(
            "taking no new requests: the event loop runs %.2fs late (limit %gs) and %d "
            "statements wait for the lock connections (limit %d), with %d requests in "
            "flight; the backlog waits in the broker until this process catches up",
            lag, self.lag_limit, depth, self.queue_limit, self._in_flight(),
            extra={"action": "admission_paused", "lag": round(lag, 3), "queue": depth},
        )
        self._show()

    def _withhold(self) -> None:
        with self._qos._mutex:
            value = int(self._qos.value or 0)
            if value > 1:
                self._qos.value = 1
                self.withheld += value - 1

    def _give_back(self, lag: float, depth: int) -> None:
        # A pause that found nothing to withhold (a prefetch of 1, or none:
        # unlimited) ends here too, with nothing to give back.
        with self._qos._mutex:
            if not self._qos.value:
                self.withheld = 0
            else:
                given = min(self.withheld, self._step)
                self._qos.value += given
                self.withheld -= given
        if not self.admitting:
            self.admitting = True
            log.info(
                "taking requests again: the event loop runs %.2fs late, %d statements wait "
                "for the lock connections, %d requests in flight",
                lag, depth, self._in_flight(),
                extra={"action": "admission_resumed", "lag": round(lag, 3), "queue": depth},
            )
            self._show()

    def _show(self) -> None:
        meter = metrics.get()
        if meter is not None:
            meter.admitting.set(1 if self.admitting else 0)
