"""The processes of quarantine a worker process runs (see
:mod:`loomflow_worker.worker.quarantine.attempts`): one request alone, or a few suspects
together, each answered through the process's pipe."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from typing import Any

from ...execution import ledger
from ...execution.statuses import QuarantineLevel
from . import child as quarantine

log = logging.getLogger(__name__)

#: How long a process whose last attempt replied may take to end before it is stopped.
EXIT_GRACE = 10.0


@dataclass
class QuarantineRuns:
    """The processes of quarantine this process runs, and the requests in
    them (see :mod:`loomflow_worker.worker.quarantine.attempts`)."""

    #: How many processes of quarantine run now (at most ``ALONE_AT_ONCE``).
    taken: int = 0
    #: Notified when one of them ends, or a request leaves one. Taken
    #: before :attr:`guard` when both are held.
    freed: threading.Condition = field(default_factory=threading.Condition)
    #: The process of quarantine of each request in one, by request id
    #: (``None`` while it finds one).
    running: dict[str, QuarantineProcess | None] = field(default_factory=dict)
    #: The groups of suspects that run, some of which may take more.
    groups: list[QuarantineProcess] = field(default_factory=list)
    #: Whether the fork server they come from was told what to import.
    preloaded: bool = False
    #: The requests among them a revoke with terminate stopped.
    revoked: set[str] = field(default_factory=set)
    #: Held while :attr:`running`, :attr:`groups`, :attr:`revoked` or a
    #: group's requests are read or changed.
    guard: threading.Lock = field(default_factory=threading.Lock)

    def give_back(self) -> None:
        """One process of quarantine ended."""
        with self.freed:
            self.taken -= 1
            self.freed.notify_all()

    def room(self) -> None:
        """A request left its process of quarantine (another may join it)."""
        with self.freed:
            self.freed.notify_all()


@dataclass
class Member:
    """One request's attempt in a process of quarantine."""

    #: Set once its reply came, or its process ended without one.
    ended: threading.Event = field(default_factory=threading.Event)
    reply: dict[str, Any] | None = None


class QuarantineProcess:
    """A process of quarantine: one request alone (``level`` ALONE), or up
    to ``capacity`` suspects at once (GROUP), another taking the place of each
    that leaves, so that its death takes at most that many with it. Its
    reader thread logs its lines as their requests' and hands each attempt
    its reply; it is closed once it runs none (its process ends then), and
    gives its slot back once its process ended."""

    def __init__(self, runs: QuarantineRuns, level: QuarantineLevel, capacity: int,
                 on_death: Callable[[str], None]) -> None:
        """``on_death(worker)``: its process died (``worker``: the ledger's name
        for it), called before its attempts learn it."""
        #: The worker process's processes of quarantine, this one among them.
        self.runs = runs
        self.level = level
        self._on_death = on_death
        #: Its process, as the ledger names the worker running its attempts.
        self.worker: str | None = None
        self.capacity = capacity
        #: The requests in it, whose attempt has not ended.
        self.members: dict[str, Member] = {}
        #: Closed to more requests (its process ends with its last attempt).
        self.closed = False
        self.process: BaseProcess | None = None
        #: The request that starts its process; set once it started (or failed to).
        self.first: str | None = None
        self.started = threading.Event()
        self._jobs: Connection | None = None
        self._sending = threading.Lock()

    def join(self, request_id: str) -> Member | None:
        """Count ``request_id`` among its requests, unless it is closed or
        full (called under :attr:`QuarantineRuns.guard`)."""
        if self.closed or len(self.members) >= self.capacity:
            return None
        self.first = self.first or request_id
        self.members[request_id] = member = Member()
        return member

    def start(self, job: dict[str, Any], processes: ForkServerContext) -> None:
        """Start its process, forked by ``processes``, with its first attempt, ``job``."""
        reader, writer = processes.Pipe(duplex=False)
        jobs_in, jobs_out = processes.Pipe(duplex=False)
        first = {**job, "worker_pid": os.getpid(), "quarantine": int(self.level),
                 "capacity": self.capacity}
        alone = self.level == QuarantineLevel.ALONE
        name = (f"{quarantine.PROCESS_NAME} {job['request_id']}" if alone
                else f"{quarantine.PROCESS_NAME} group of {job['request_id']}")
        self.process = processes.Process(
            target=quarantine.child, args=(first, jobs_in, writer), name=name)
        try:
            self.process.start()
        finally:
            writer.close()
            jobs_in.close()
        assert self.process.pid is not None  # started
        self.worker = ledger.worker_name(job["node"], self.process.pid)
        self._jobs = jobs_out
        try:
            threading.Thread(target=self._read, args=(reader,), daemon=True,
                             name=f"quarantine {self.process.pid}").start()
        except BaseException:
            self.process.kill()  # never left running unwatched
            raise

    def send(self, message: dict[str, Any]) -> None:
        """Send its process a message (nothing once it has ended)."""
        with self._sending:
            if self._jobs is None:
                return
            with suppress(OSError, ValueError):
                self._jobs.send_bytes(json.dumps(message).encode())

    def stop(self) -> None:
        """Stop its process now: its attempts' deaths, none of them its own
        when it ran several."""
        if self.process is not None and self.process.exitcode is None:
            self.process.kill()

    def _read(self, reader: Connection) -> None:
        assert self.process is not None
        closed_at: float | None = None
        try:
            while True:
                if closed_at is None and self.closed:
                    closed_at = time.monotonic()
                elif closed_at is not None and time.monotonic() - closed_at > EXIT_GRACE:
                    # Its last attempt replied, but it does not end (a
                    # tool's thread that lingers): stopped, its replies stand.
                    self.stop()
                if not reader.poll(0.5):
                    if self.process.exitcode is not None:
                        break  # ended, its pipe held open by a process it left
                    continue
                try:
                    message = reader.recv_bytes()
                except (EOFError, OSError):
                    break  # it ended, or died within a message
                if self._line(message):
                    self.close_if_idle()
        finally:
            reader.close()
            self.process.join()
            if self.process.exitcode and self.worker is not None:
                # Died (or stopped): its attempts' next ones need not wait
                # for it to stop stamping its row.
                self._on_death(self.worker)
            self.release()

    def release(self) -> None:
        """Its process ended, or never started: closed, the attempts still
        in it ended without a reply, and its slot given back (once)."""
        with self.runs.guard:
            self.closed = True
            ended, self.members = list(self.members.values()), {}
        with self._sending:
            if self._jobs is not None:
                self._jobs.close()
                self._jobs = None
        for member in ended:
            member.ended.set()
        self.runs.give_back()

    def close_if_idle(self) -> None:
        """Close it once it runs no request: its process ends (the next
        suspects start another)."""
        with self.runs.guard:
            if self.members or self.process is None:
                return
            self.closed = True
        self.send({"close": True})

    def _line(self, message: bytes) -> bool:
        """Log a log line of its process as its request's, or hand a reply
        to its attempt; whether it was a reply."""
        try:
            item = json.loads(message)
        except ValueError:
            item = None
        if not isinstance(item, dict):
            log.info("process of quarantine %s: %r", self.process and self.process.pid, message,
                     extra={"action": "quarantine_log"})
            return False
        request_id = item.get("request")
        if "reply" in item:
            with self.runs.guard:
                member = self.members.pop(str(request_id), None)
            if member is not None:
                member.reply = item["reply"] if isinstance(item["reply"], dict) else None
                member.ended.set()
                self.runs.room()
            return True
        how = "alone" if self.level == QuarantineLevel.ALONE else "in quarantine"
        # At the level the process logged it at: an ERROR there is one here.
        level = item.get("level")
        if not isinstance(level, int) or not logging.DEBUG <= level <= logging.CRITICAL:
            level = logging.INFO
        if request_id is None:
            log.log(level, "process of quarantine %s: %s", self.process and self.process.pid,
                    item.get("log"), extra={"action": "quarantine_log"})
        else:
            log.log(level, "request %s (%s): %s", request_id, how, item.get("log"),
                    extra={"action": "quarantine_log", "request": request_id})
        return False
