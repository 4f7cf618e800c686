"""The process's heartbeat and presence: one component with a start and a stop.

Its running requests are stamped alive on each heartbeat interval on their
lock connections (:meth:`.Journal.heartbeat`), and its own row in
``workers`` on a pooled connection, each on a loop task of its own so a slow
pool never delays the runs' heartbeats."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
from collections.abc import Callable

import anyio

from .. import metrics, sockets
from ..execution import ledger
from ..execution.execute import liveness
from ..runtime import PostgresRuntime
from ..settings import Settings

log = logging.getLogger(__name__)

#: How long a process that closes waits to mark its ``workers`` row stopped.
STOP_STAMP_WAIT = 2.0

#: How many results stored by this process wait for its next stamp at most
#: (more, while Postgres is away, are left to the sweeper's check).
MAX_STORED_WAITING = 10_000

#: How soon a failed stamp of the process's ``workers`` row is tried again.
RESTAMP_AFTER = 0.05


class Heart:
    """Stamps the process's runs and its ``workers`` row (``worker``), telling
    the row what the process carries: ``runs()``, ``lag()`` of its loop,
    ``lock_queue()`` and whether it is ``admitting()``; ``room()`` is called
    after each stamp that told the row of free slots the process admits to."""

    def __init__(
        self, settings: Settings, worker: str, slots: int, *, runs: Callable[[], int],
        lag: Callable[[], float], lock_queue: Callable[[], int],
        admitting: Callable[[], bool], room: Callable[[], None] = lambda: None,
    ) -> None:
        self.settings, self.worker, self.slots = settings, worker, slots
        self.runs, self.lag, self.lock_queue, self.admitting = runs, lag, lock_queue, admitting
        self.room = room
        self._beating: asyncio.Task[None] | None = None
        self._presence: asyncio.Task[None] | None = None
        # The last stamp of the process's row failed: said once per outage.
        self._unseen = False
        # Finished requests whose result this process stored in the result
        # backend since its last stamp (appended from Celery's threads).
        self._stored: collections.deque[str] = collections.deque(maxlen=MAX_STORED_WAITING)

    def result_stored(self, request_id: str) -> None:
        """This process stored ``request_id``'s result: its next stamp takes
        the request off ``results_to_check``, so the sweeper neither checks it
        nor stores it again once its caller forgot it (``AsyncResult.forget``)."""
        self._stored.append(request_id)

    def start(self, runtime: PostgresRuntime) -> None:
        """Beat and stamp from now on, on the running loop."""
        loop = asyncio.get_running_loop()
        self._beating = loop.create_task(self._heartbeats(runtime),
                                         name="loomflow-worker heartbeat")
        self._presence = loop.create_task(self._stamps(runtime),
                                          name="loomflow-worker presence")

    async def stop(self, runtime: PostgresRuntime | None) -> None:
        """Beat no more; the process's row marked stopped (when it ``runtime``
        is up), waiting for it no more than ``STOP_STAMP_WAIT``."""
        tasks, self._beating, self._presence = (self._beating, self._presence), None, None
        for task in tasks:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if runtime is not None:
            with anyio.CancelScope(shield=True):
                await self._stamp(runtime, stopped=True)

    async def _heartbeats(self, runtime: PostgresRuntime) -> None:
        """Stamp every running request of the process as alive: one urgent
        statement per lock connection and interval, never queued behind
        journal writes, and never two at once on a connection. A connection
        is fenced when it fails, or when nothing has stamped its runs for so
        long that the sweeper may soon end it (:func:`.fence_after`): a late
        loop or a busy connection only delays a stamp. A frozen process
        stamps nothing, so its lease runs out and the sweeper fences it."""
        interval = self.settings.heartbeat_interval
        runtime.journal.keep_alive(liveness(self.settings))
        while True:
            await anyio.sleep(interval)
            runtime.journal.heartbeat()

    async def _stamps(self, runtime: PostgresRuntime) -> None:
        """Stamp the process's own row in ``workers`` at once, then on every
        heartbeat interval, idle or not: one statement per interval, on a
        pooled connection (never a lock connection). Its connections are
        counted for the metrics on the same beat."""
        interval = self.settings.heartbeat_interval
        peers = sockets.peer_ports(self.settings)
        while True:
            if not await self._stamp(runtime, stopped=False):
                # Once more at once, on another connection: a new attempt of one
                # of its requests takes the process for dead when its row goes
                # unstamped for two intervals (see start_request).
                await anyio.sleep(RESTAMP_AFTER)
                await self._stamp(runtime, stopped=False)
            metrics.observe_connections(peers)
            await anyio.sleep(interval)

    async def _stamp(self, runtime: PostgresRuntime, *, stopped: bool) -> bool:
        """One stamp of the process's row (``stopped``: it closes); whether it
        was written. A failure is logged once per outage: the row is for the
        console, and says to a new attempt of one of its requests that the
        process lives (see ``start_request``)."""
        stored = [self._stored.popleft() for _ in range(len(self._stored))]
        beat = ledger.WorkerBeat(
            worker=self.worker, hostname=socket.gethostname(), pid=os.getpid(),
            slots=self.slots, interval=self.settings.heartbeat_interval,
            runs=self.runs(), stored=stored, loop_lag=self.lag(),
            lock_queue=self.lock_queue(), admitting=self.admitting(),
        )
        try:
            # Closing waits for it no more than STOP_STAMP_WAIT.
            with anyio.fail_after(min(2 * beat.interval, STOP_STAMP_WAIT) if stopped
                                  else 2 * beat.interval):
                async with runtime.pool.connection() as conn:
                    if stopped:
                        await ledger.worker_stopped(conn, beat)
                    else:
                        await ledger.worker_seen(conn, beat)
        except Exception as exc:
            self._stored.extendleft(reversed(stored))  # for the next stamp
            if not self._unseen:
                log.warning("could not stamp this worker's row in the workers table: %s",
                            exc, extra={"action": "worker_stamp", "worker": beat.worker})
            self._unseen = True
            return False
        self._unseen = False
        if not stopped and beat.admitting and beat.runs < beat.slots:
            try:
                self.room()
            except Exception:  # the row is stamped: that is what the heart is for
                log.exception("telling the process of its free slots failed",
                              extra={"action": "worker_stamp", "worker": beat.worker})
        return True
