"""How late an event loop runs, and what held it.

Hundreds of runs share one loop: a tool that blocks it (``time.sleep`` in an
``async def``), a burst of CPU-bound work or a long GC pause makes every
other run wait. :class:`LoopWatch` measures that and says so:

- a timer on the loop ticks every :data:`TICK` seconds and records how late
  it ran (the *lag*: how long a ready callback waits for the loop);
- a thread of its own notices when the loop has not ticked for
  ``stall`` seconds, looks at the loop thread's stack at that moment, and
  once the loop runs again logs one warning naming the request and the step
  that held it, where in the code, and for how long.

The watch never stops a run: lateness is measured, logged and left to
admission (which stops taking new runs), never taken for a dead connection.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType, FrameType

log = logging.getLogger(__name__)

#: How often the loop's timer ticks (seconds).
TICK = 0.1
#: How many ticks the watch remembers (for the recent lag).
KEPT = 600

#: Stack frames in these folders are the loop's machinery, not the culprit.
_MACHINERY = tuple(
    os.path.dirname(module.__file__ or "") + os.sep
    for module in (asyncio, threading)
)


@dataclass(frozen=True)
class Culprit:
    """What the loop thread was running when the loop stalled."""

    request_id: str | None
    scope: str | None
    step: str | None
    where: str
    #: The agent being built (its factory runs on the loop), if that was it.
    agent: str | None = None

    def describe(self) -> str:
        parts = []
        if self.request_id is not None:
            parts.append(f"request {self.request_id}")
        elif self.scope is not None:
            parts.append(f"a run on scope {self.scope!r}")
        if self.step is not None:
            parts.append(f"step {self.step!r}")
        parts.append(f"at {self.where}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Stall:
    """The loop held for ``held`` seconds by ``culprit``; or, ``frozen``, the
    whole process stopped that long (no code of it ran, the watch's own
    thread neither: SIGSTOP, a paused VM, a throttled or starved container)."""

    held: float
    culprit: Culprit | None
    frozen: bool = False


class LoopWatch:
    """Measures one event loop's lag and names what stalls it.

    ``step_codes``: the code objects of the functions that run a journaled
    step (their frames hold the step's ``name`` and the run's ``lease``);
    ``build_codes``: those of the function that builds an agent (its frame
    holds the agent's ``name``);
    ``on_stall(stall)`` is called from the watch's thread after each stall,
    ``observers`` on every one of its ticks (admission control)."""

    def __init__(
        self,
        *,
        stall: float = 1.0,
        step_codes: tuple[CodeType, ...] = (),
        build_codes: tuple[CodeType, ...] = (),
        on_stall: Callable[[Stall], None] | None = None,
        on_lag: Callable[[float], None] | None = None,
    ) -> None:
        self.stall = stall
        self.observers: list[Callable[[LoopWatch], None]] = []
        self._step_codes = step_codes
        self._build_codes = build_codes
        self._on_stall = on_stall
        self._on_lag = on_lag
        self._lags: deque[tuple[float, float]] = deque(maxlen=KEPT)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._handle: asyncio.Handle | None = None
        self._expected = 0.0
        self.last_tick = time.monotonic()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        # The stall in progress: when it was noticed, and its culprit.
        self._stalled: Culprit | None = None
        self.stalls = 0

    # ---- on the loop -----------------------------------------------------------------

    def start(self) -> None:
        """Start watching the running loop (called on it)."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.last_tick = self._expected = time.monotonic()
        self._handle = self._loop.call_soon(self._tick)
        self._thread = threading.Thread(
            target=self._watch, name="loomflow-worker loop watch", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1)
        self._thread = None

    def _tick(self) -> None:
        now = time.monotonic()
        lag = max(0.0, now - self._expected)
        self._lags.append((now, lag))
        self.last_tick = now
        self._expected = now + TICK
        if self._on_lag is not None:
            self._on_lag(lag)
        assert self._loop is not None
        self._handle = self._loop.call_later(TICK, self._tick)

    # ---- what it measured ------------------------------------------------------------

    def lag(self, within: float = 1.0) -> float:
        """The largest lag of the last ``within`` seconds; a loop that has not
        ticked since counts as late as it has been silent."""
        now = time.monotonic()
        silent = max(0.0, now - self.last_tick - TICK)
        recent = [lag for at, lag in list(self._lags) if at >= now - within]
        return max([silent, *recent])

    def lag_quantiles(self, within: float = 60.0) -> tuple[float, float]:
        """The median and 99th percentile lag of the last ``within`` seconds."""
        now = time.monotonic()
        lags = sorted(lag for at, lag in list(self._lags) if at >= now - within)
        if not lags:
            return 0.0, 0.0
        return lags[len(lags) // 2], lags[min(len(lags) - 1, int(len(lags) * 0.99))]

    # ---- the watch's thread ----------------------------------------------------------

    def _watch(self) -> None:
        woke, cpu = time.monotonic(), time.process_time()
        # The loop's last tick when the process was found stopped: no stall of
        # the loop is looked for until it ticks again (it was never held).
        frozen_at: float | None = None
        while not self._stopping.wait(TICK):
            now, spent = time.monotonic(), time.process_time() - cpu
            late = now - woke - TICK
            woke, cpu = now, time.process_time()
            if late >= self.stall and spent < late / 2:
                # This thread woke as late as the loop, and the process used
                # little CPU meanwhile: it was stopped as a whole, not held by
                # one of its runs (whose code holding the GIL burns CPU).
                self._stalled, frozen_at = None, self.last_tick
                self.stalls += 1
                if self._on_stall is not None:
                    self._on_stall(Stall(late, None, frozen=True))
            elif frozen_at is None or self.last_tick != frozen_at:
                frozen_at = None
                self._look(now)
            for observer in list(self.observers):
                try:
                    observer(self)
                except Exception:
                    log.exception("a loop watch observer failed")

    def _look(self, now: float) -> None:
        """Notice a stall of the loop as it starts, and report it once it ends."""
        silent = now - self.last_tick
        if self._stalled is None and silent >= self.stall:
            self._stalled = self._culprit() or Culprit(None, None, None, "unknown")
        elif self._stalled is not None and silent < self.stall:
            culprit, self._stalled = self._stalled, None
            held = max((lag for _, lag in list(self._lags)[-3:]), default=0.0)
            self.stalls += 1
            if self._on_stall is not None:
                self._on_stall(Stall(max(held, self.stall), culprit))

    def _culprit(self) -> Culprit | None:
        """What the loop thread runs now: the innermost frame outside the
        loop's machinery, and the journaled step around it, if any."""
        if self._loop_thread is None:
            return None
        frame: FrameType | None = sys._current_frames().get(self._loop_thread)
        where: str | None = None
        while frame is not None:
            code = frame.f_code
            if where is None and not code.co_filename.startswith(_MACHINERY):
                where = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
            if code in self._step_codes:
                local = frame.f_locals
                lease = local.get("lease")
                return Culprit(
                    request_id=getattr(lease, "request_id", None),
                    scope=getattr(lease, "scope", None),
                    step=str(local.get("name")) if local.get("name") is not None else None,
                    where=where or "?",
                )
            if code in self._build_codes:
                name = frame.f_locals.get("name")
                return Culprit(None, None, None, where or "?",
                               agent=str(name) if name is not None else "?")
            frame = frame.f_back
        return Culprit(None, None, None, where) if where is not None else None


def claim_thread_for_asyncio() -> None:
    """Tell sniffio that this thread runs asyncio and nothing else.

    anyio asks sniffio which library runs at each of its calls (loomflow's
    streams make dozens per run), and sniffio otherwise finds out through
    ``asyncio.current_task()``, a ``getpid()`` system call each time. A
    thread that only runs an event loop can say so once, as trio does."""
    try:
        import sniffio
    except ImportError:  # anyio then asks asyncio directly
        return
    sniffio.thread_local.name = "asyncio"
