"""The sweeper leader's watch over agent versions: requests waiting for a
version no live worker serves are never silent.

Every WATCH_EVERY seconds the leader reads each version's live workers and
pinned requests (``ledger_reads.agent_versions``): it sets the gauge of waiting
requests per agent and version, logs a WARNING (once a minute per version)
for a version whose requests wait with no live worker of it, and applies the
agent's ``on_version_gone`` policy (``register_agent``) once no worker of it
has been seen for its grace: ``"upgrade"`` moves them to the newest version a
live worker serves, ``"cancel"`` cancels them; ``"wait"`` (the default)
leaves them waiting."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from .. import metrics
from ..execution import ledger, ledger_reads
from ..execution.registry import agent_on_version_gone
from ..execution.versions import VersionInfo
from ..runtime.errors import InvalidInput

log = logging.getLogger(__name__)

#: How often the leader looks (seconds).
WATCH_EVERY = 5.0
#: How often it says again that a version's requests wait with no worker of it.
WARN_EVERY = 60.0
#: The most requests one look cancels per version.
CANCEL_PAGE = 500


#: Moves every queued request of an agent pinned to a version (agent, version,
#: by whom) to the newest version a live worker serves; returns how many, and where.
Upgrade = Callable[[str, str, str], tuple[int, str]]
#: Cancels a request.
Cancel = Callable[[str], object]


class VersionWatch:
    """What the sweeper's leader does about agent versions, each turn:
    ``upgrade`` and ``cancel`` carry out the on_version_gone policies (none:
    requests wait, whatever their agent's policy)."""

    def __init__(self, upgrade: Upgrade | None = None, cancel: Cancel | None = None) -> None:
        self._upgrade, self._cancel = upgrade, cancel
        self._next = 0.0
        self._warned: dict[tuple[str, str], float] = {}

    def watch(self, conn: Any) -> int:
        """One look, at most every WATCH_EVERY seconds; how many versions it read
        (0 between looks)."""
        now = time.monotonic()
        if now < self._next:
            return 0
        self._next = now + WATCH_EVERY
        found = [VersionInfo(**row) for row in ledger_reads.agent_versions(conn)]
        metrics.report_version_waiting(
            {(v.agent, v.version): v.waiting for v in found if v.waiting})
        for info in found:
            if info.waiting and not info.live:
                self._stranded(conn, info, now)
        return len(found)

    def _stranded(self, conn: Any, info: VersionInfo, now: float) -> None:
        """``info``'s requests wait and no live worker serves it."""
        policy, grace = agent_on_version_gone(info.agent)
        gone_for = (info.now - info.seen_at).total_seconds() if info.seen_at else None
        waited = (info.now - info.waiting_since).total_seconds() if info.waiting_since else 0.0
        if (policy != "wait" and waited >= grace and (gone_for is None or gone_for >= grace)
                and self._apply(conn, info, policy, grace)):
            return
        key = (info.agent, info.version)
        if now < self._warned.get(key, 0.0):
            return
        self._warned[key] = now + WARN_EVERY
        seen = (f"none alive for {gone_for:.0f}s" if gone_for is not None
                else "no worker of it known")
        then = ("" if policy == "wait" else
                f"; its policy ({policy}) acts after {grace:g}s with no worker of it")
        log.warning(
            "%d requests of agent %r wait for a worker of version %s (%s)%s: start a worker "
            "of that version, or move them with `loomflow-worker upgrade --agent %s --from %s`",
            info.waiting, info.agent, info.version, seen, then, info.agent, info.version,
            extra={"action": "version_waiting", "agent": info.agent, "version": info.version})

    def _apply(self, conn: Any, info: VersionInfo, policy: str, grace: float) -> bool:
        """Apply the policy to the version's waiting requests; ``False`` when it
        could not (no live version to move them to: said as waiting is)."""
        by = f"on_version_gone={policy} after {grace:g}s"
        try:
            if policy == "upgrade" and self._upgrade is not None:
                count, to = self._upgrade(info.agent, info.version, by)
                what = f"moved to version {to}"
            elif policy == "cancel" and self._cancel is not None:
                ids = ledger.waiting_for_version(conn, info.agent, info.version, CANCEL_PAGE)
                for request_id in ids:
                    self._cancel(request_id)
                count, what = len(ids), "cancelled"
            else:
                return False
        except InvalidInput as exc:
            log.info("agent %r version %s: its policy %s could not act yet: %s", info.agent,
                     info.version, policy, exc,
                     extra={"action": "version_policy", "agent": info.agent})
            return False
        log.warning("%d requests of agent %r waiting for version %s %s (%s)", count, info.agent,
                    info.version, what, by,
                    extra={"action": "version_policy", "agent": info.agent,
                           "version": info.version})
        return True
