"""The ledger's side of one attempt: the statements an attempt of a request
makes, in order, on one connection (its lease's lock connection once it
holds the scope, a pooled one before), each a method of :class:`Attempt`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

from ..runtime import PostgresRuntime
from ..runtime.store import Conn, Lease, OpenChoice
from . import budgets, ledger
from .pending import Pending
from .request import RunRequest

T = TypeVar("T")


class Io(Protocol):
    """Runs one piece of ledger work on a connection: the lease's lock
    connection (``Lease.io``) or a pooled one (:func:`pooled`)."""

    def __call__(self, fn: Callable[[Conn], Awaitable[T]]) -> Awaitable[T]: ...


def pooled(runtime: PostgresRuntime) -> Io:
    """Ledger work on a connection of the runtime's pool, one at a time."""

    async def run(fn: Callable[[Conn], Awaitable[T]]) -> T:
        async with runtime.pool.connection() as conn:
            return await fn(conn)

    return run


class Attempt:
    """One attempt of ``request_id`` (in ``scope``) as the ledger hears it:
    ``number`` once it started, its statements on ``io``; holding the scope,
    on its ``lease``'s lock connection."""

    __slots__ = ("io", "lease", "number", "request_id", "scope")

    def __init__(self, io: Io, request_id: str, scope: str, lease: Lease | None = None) -> None:
        self.io, self.request_id, self.scope, self.lease = io, request_id, scope, lease
        self.number = 0

    def holding(self, lease: Lease) -> Attempt:
        """The attempt once it holds the scope: on ``lease``'s lock connection."""
        return Attempt(lease.io, self.request_id, self.scope, lease)

    def _held(self) -> Lease:
        if self.lease is None:
            raise RuntimeError(f"attempt of {self.request_id} sent a statement for the "
                               "scope's holder before it took the scope's lock")
        return self.lease

    # Before it runs: where it waits, or whether it runs here.

    async def ensure_row(self, req: RunRequest, arrival: ledger.Arrival | None) -> None:
        """The request's row, for a message published by name (no row yet)."""
        request_id = self.request_id
        await self.io(lambda conn: ledger.ensure_row(conn, request_id, req, arrival))

    async def park(self, options: dict[str, Any] | None) -> bool:
        """Parked behind an older request of its session (``False``: it was
        handed the session meanwhile; go on)."""
        request_id = self.request_id
        return await self.io(lambda conn: ledger.park(conn, request_id, options))

    async def park_on_limit(self, options: dict[str, Any] | None, reason: str,
                            slots: list[int]) -> None:
        """Parked on its full limit ``reason`` (whose slots are ``slots``)."""
        request_id = self.request_id
        await self.io(lambda conn: ledger.park_on_limit(conn, request_id, options, reason, slots))

    async def park_if_spent(self, names: list[str],
                            options: dict[str, Any] | None) -> budgets.Spent | None:
        """Parked when one of its budgets ``names`` is spent (that budget), else ``None``."""
        request_id = self.request_id
        return await self.io(lambda conn: budgets.park_if_spent(conn, request_id, names, options))

    async def mark_dispatched(self, other: str) -> None:
        """The request ``other`` it parks behind is published again."""
        await self.io(lambda conn: ledger.mark_dispatched(conn, other))

    async def mark_quarantined(self) -> None:
        """Handed to a process of quarantine, as a dispatch would hand it."""
        request_id = self.request_id
        await self.io(lambda conn: ledger.mark_quarantined(conn, request_id))

    async def hand_off(self) -> ledger.Handoff | None:
        """The scope handed to its oldest unfinished request (unless handed already)."""
        scope = self.scope
        return await self.io(lambda conn: ledger.hand_off_async(conn, scope))

    async def await_version(self, options: dict[str, Any] | None, default_queue: str,
                            suffix: str) -> Pending | None:
        """Queued again for a worker of the version it is pinned to."""
        request_id = self.request_id
        return await self.io(lambda conn: ledger.await_version(
            conn, request_id, options, default_queue, suffix))

    async def start(self, worker: str, stale_after: float, opening: OpenChoice | None, *,
                    lease: float, interval: float, quarantine: int,
                    version: str | None) -> ledger.Started:
        """Started under the scope's lock (see :func:`.ledger.start`); its number kept."""
        started = await self._held().send(ledger.start(
            self.request_id, self.scope, worker, stale_after, opening, lease=lease,
            interval=interval, quarantine=quarantine, version=version))
        self.number = started.attempt
        return started

    # As it runs, and as it ends.

    async def clear_suspicion(self) -> None:
        """Its first completed step: its record is clean."""
        request_id = self.request_id
        await self.io(lambda conn: ledger.clear_suspicion(conn, request_id))

    async def finish(self, epoch: int, usage: Mapping[str, Any] | None, *, status: str,
                     result: Any, error: str | None,
                     error_type: str | None) -> ledger.Handoff | None:
        """Its request's end, with the attempt's ``usage``, in one round trip."""
        return await self._held().send(ledger.finish_batch(
            self.request_id, self.scope, self.number, epoch, usage=usage, status=status,
            result=result, error=error, error_type=error_type))

    async def record_usage(self, usage: Mapping[str, Any]) -> None:
        """Its model calls, as it ends without finishing its request."""
        request_id, number = self.request_id, self.number
        await self.io(lambda conn: ledger.record_usage(conn, request_id, number, usage))

    async def schedule_retry(self, error: Exception, countdown: float) -> None:
        """Its run raised: the request runs again ``countdown`` seconds from now."""
        request_id, number = self.request_id, self.number
        await self.io(lambda conn: ledger.schedule_retry(
            conn, request_id, number, error, countdown))

    async def pause(self, countdown: float, reason: str, booked_key: str | None,
                    booked_in: float | None) -> None:
        """Its slot given back for ``countdown`` seconds (its model key's wait)."""
        request_id, number = self.request_id, self.number
        await self.io(lambda conn: ledger.pause(
            conn, request_id, number, countdown, reason, booked_key, booked_in))

    async def park_on_signal(self, session_id: str, signal: str, reason: str,
                             options: dict[str, Any] | None) -> None:
        """Its slot given back until ``signal`` arrives for ``session_id``."""
        request_id, number = self.request_id, self.number
        await self.io(lambda conn: ledger.park_on_signal(
            conn, request_id, number, session_id, signal, reason, options))

    async def end(self, outcome: str) -> None:
        """The attempt closed with ``outcome``, its request left as it is."""
        request_id, number = self.request_id, self.number
        await self.io(lambda conn: ledger.end_attempt(conn, request_id, number, outcome))

    async def requeue_interrupted(self) -> None:
        """Stopped from outside (a shutdown): interrupted, its request queued again."""
        request_id, number = self.request_id, self.number
        await self.io(lambda conn: ledger.requeue_interrupted(conn, request_id, number))
