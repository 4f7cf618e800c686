"""Moving requests to another version of their agent on purpose.

A request is pinned to the version of its agent its first attempt ran; a
deploy that retires that version leaves it waiting for a worker of it.
:func:`upgrade_requests` moves it to a version the fleet serves: its
completed steps stay in its journal and are never executed again (its next
attempt replays its journaled model calls by position, so their tool calls
replay too), and only what had not completed runs on the new code."""

from __future__ import annotations

from dataclasses import dataclass

from .. import tracing
from ..execution import ledger, ledger_reads
from ..execution.request_errors import RequestNotFound
from ..execution.statuses import TERMINAL
from ..execution.versions import check_version, queue_suffix
from ..runtime.conns import SyncConn
from ..runtime.errors import InvalidInput
from ..runtime.validate import check_id
from ..worker.state import PROCESS
from .application import settings
from .dispatch import dispatch_recorded


@dataclass(frozen=True)
class Upgraded:
    """What an upgrade did: the agent, the version the requests now run on,
    and each request moved with the version it left."""

    agent: str
    to: str
    moved: list[tuple[str, str]]


def upgrade_request(request_id: str, to: str | None = None, *, by: str = "upgrade") -> Upgraded:
    """Move one queued request pinned to a version of its agent to version
    ``to`` (by default the newest version a live worker serves). Refused, with
    nothing changed, for an unknown or finished request, one that never
    started (it runs on any version), one running (it moves once it waits), an
    unknown version, or the version it is pinned to."""
    check_id("request_id", request_id)
    settings()
    with PROCESS.ledger_connection() as conn:
        row = ledger_reads.request_row(conn, {"request_id": request_id, "prompt_chars": 0})
        if row is None:
            raise RequestNotFound(request_id)
        agent, status, pinned = row["agent"], row["status"], row["agent_version"]
        if status in TERMINAL:
            raise InvalidInput(f"request {request_id} already {status}: only an unfinished "
                               "request moves to another version")
        if pinned is None:
            raise InvalidInput(f"request {request_id} has not started: it runs on any version "
                               "of its agent already")
        if status == "running":
            raise InvalidInput(f"request {request_id} is running on version {pinned}: it moves "
                               "once it waits for a worker of its version; try again then")
        target = _target(conn, agent, to, pinned)
        with conn.transaction():
            moved = ledger.upgrade_requests(
                conn, to=target, by=by, default_queue=settings().queue,
                suffix=queue_suffix(agent, target), request_id=request_id)
    return _published(agent, target, moved)


def upgrade_agent(agent: str, from_version: str, to: str | None = None, *,
                  by: str = "upgrade") -> Upgraded:
    """Move every queued request of ``agent`` pinned to ``from_version`` to
    version ``to`` (by default the newest version a live worker serves). A
    running one is left: it finishes where it runs, or moves once it waits."""
    check_version(from_version)
    settings()
    with PROCESS.ledger_connection() as conn:
        target = _target(conn, agent, to, from_version)
        with conn.transaction():
            moved = ledger.upgrade_requests(
                conn, to=target, by=by, default_queue=settings().queue,
                suffix=queue_suffix(agent, target), agent=agent, from_version=from_version)
    return _published(agent, target, moved)


def _target(conn: SyncConn, agent: str, to: str | None, pinned: str) -> str:
    """The version to move requests of ``agent`` pinned to ``pinned`` to: ``to``,
    which a worker must have registered, or the newest a live worker serves."""
    known = ledger.known_versions(conn, agent)
    names = ", ".join(f"{v['version']}{' (live)' if v['live'] else ''}" for v in known) or "none"
    if to is None:
        live = [v["version"] for v in known if v["live"] and v["version"] != pinned]
        if not live:
            raise InvalidInput(f"no live worker serves another version of agent {agent!r} "
                               f"(known: {names}); start one, or name a version with --to")
        return str(live[0])
    check_version(to)
    if to == pinned:
        raise InvalidInput(f"version {to} is the version it is pinned to already; name another")
    if to not in {v["version"] for v in known}:
        raise InvalidInput(f"no worker has registered version {to} of agent {agent!r} "
                           f"(known: {names}); start a worker of it first")
    return to


def _published(agent: str, to: str, moved: list[ledger.Moved]) -> Upgraded:
    for one in moved:
        dispatch_recorded(one.pending, f"moved to version {to}")
        tracing.note(one.pending.routing, "upgrade", one.pending.request_id,
                     from_version=one.from_version, to_version=to)
    return Upgraded(agent, to, [(one.pending.request_id, one.from_version) for one in moved])


def upgrade_stranded(agent: str, from_version: str, by: str) -> tuple[int, str]:
    """:func:`upgrade_agent` to the newest live version, as the sweeper's
    on_version_gone policy calls it: how many requests moved, and where."""
    done = upgrade_agent(agent, from_version, by=by)
    return len(done.moved), done.to
