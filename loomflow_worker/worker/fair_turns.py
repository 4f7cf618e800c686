"""Publishing the requests withheld for their fair turn as runs end, one look at
a time per process.

Each run's end makes room in the broker for a request withheld in the ledger for
its fair turn (see ``loomflow_worker_fair_next``). A process ending dozens of
runs a second does not look once for each: ends that come while a look is
under way, or within :data:`LOOK_EVERY` of the last, are answered by the next
look, which publishes as many as there is room for then (a look that sent a
whole page is followed by another, :data:`AGAIN_AFTER_A_PAGE` later). The process's
heartbeat pokes it too, when its row says it has free slots: a process that
starts on a withheld backlog fills them at once. Each look first writes how
many runs the process carries, and whether it takes new requests, in its row
(while requests are withheld): what may wait in the broker follows the fleet's
free slots, and slots freed by runs that ended together, or by admission
resuming, are offered at the next look, not at the next heartbeat. So the looks
cost a statement every tenth of a second at most, not one per run, and their
messages go out in one batch over one broker connection. A look that fails is left to
the sweeper's leader, which publishes withheld requests on each sweep.

A part of the worker process (its context makes one once its runtime is up,
when the Celery binding gave it a way to publish, at the worker's boot): an
attempt sees it only as execution's :class:`~..execution.host.TurnLooks`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import anyio
from psycopg_pool import AsyncConnectionPool

from ..execution import ledger
from ..execution.pending import Pending

log = logging.getLogger(__name__)

#: At most one look per this many seconds per process: a request withheld for its
#: turn waits that much longer at worst, and a busy process makes ten looks a
#: second at most, whatever its rate of ends (each look weighs the keys with
#: requests withheld on Postgres: fewer, larger looks cost it less).
LOOK_EVERY = 0.1
#: How soon a look that sent a whole page is followed by another (more may have room).
AGAIN_AFTER_A_PAGE = 0.02


class FairTurns:
    """Looks for requests whose fair turn came, as runs end (:meth:`poke`),
    and hands them to ``publish`` (blocking: it runs in a thread). ``looker``:
    what the process says of itself now (how many runs it carries, whether it
    takes new requests), which each look writes in its row first: slots freed
    by runs that ended together, or by admission taking requests again, take
    withheld requests at the next look, not at the next heartbeat's stamp."""

    def __init__(
        self,
        pool: AsyncConnectionPool,
        fair: Callable[[], Awaitable[bool]],
        publish: Callable[[list[Pending]], None],
        every: float = LOOK_EVERY,
        *,
        looker: Callable[[], ledger.LookerState] | None = None,
    ) -> None:
        self._pool = pool
        self._fair = fair
        self._publish = publish
        self._looker = looker
        self._every = every
        self._asked = False
        self._looking: asyncio.Task[None] | None = None

    def poke(self) -> None:
        """A run ended, or the process's row says it has free slots (on the
        process's loop): look soon."""
        self._asked = True
        if self._looking is None:
            self._looking = asyncio.get_running_loop().create_task(
                self._looks(), name="loomflow-worker fair turns")

    async def _looks(self) -> None:
        try:
            while self._asked:
                self._asked = False
                wait = self._every
                try:
                    if await self.look() >= ledger.FAIR_PAGE:
                        self._asked = True  # a full page: more may have room
                        wait = min(wait, AGAIN_AFTER_A_PAGE)
                except Exception as exc:  # the sweeper publishes them
                    log.warning("could not publish requests waiting their fair turn (%s); "
                                "the sweeper will", exc, extra={"action": "fair_turn"})
                await asyncio.sleep(wait)
        finally:
            self._looking = None

    async def look(self) -> int:
        """Publish the requests whose fair turn came now; how many."""
        if not await self._fair():
            return 0
        async with self._pool.connection() as conn:
            turn = await ledger.fair_next(conn, None if self._looker is None else self._looker())
        if turn:
            await anyio.to_thread.run_sync(self._publish, turn)
        return len(turn)

    async def aclose(self) -> None:
        """Stop looking (a look under way is cancelled: the sweeper publishes
        what it marked and did not send)."""
        task, self._looking = self._looking, None
        if task is not None:
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(task, return_exceptions=True)
