"""The worker the app starts (``celery worker``, ``loomflow-worker worker``):
Celery's, except that an idle worker skips the soft shutdown.

Celery's soft shutdown (SIGTERM under ``REMAP_SIGTERM=SIGQUIT``, as
``loomflow-worker worker`` runs it) waits ``worker_soft_shutdown_timeout``
for the runs in flight, then requeues those still running. The app asks it
to wait even when no task runs (``worker_enable_soft_shutdown_on_idle``), so
that messages held for an eta or a rate limit are requeued cleanly; but a
worker with no run in flight and no message held has nothing to wait for,
and stops at once.

Celery sends ``worker_shutdown`` on a warm shutdown only; this worker sends
it on a cold (or soft) one too, so whatever closes on that signal (the
sweeper, the connections of a threads pool's process, which also records the
process ``stopped`` in the workers table) closes however the worker stops."""

from __future__ import annotations

import logging

from celery.apps.worker import Worker as CeleryWorker
from celery.worker import state as worker_state

from .state import PROCESS

log = logging.getLogger(__name__)


def holds_work() -> bool:
    """Whether this worker has a run in flight or a message it received and
    has not finished: reserved, running or waiting for its eta (Celery's
    requests), or held for a rate limit (received, neither started nor
    acknowledged since)."""
    if worker_state.requests or worker_state.active_requests:
        return True
    return any(request.time_start is None and not request.acknowledged
               for request in list(PROCESS.held.values()))


class Worker(CeleryWorker):  # type: ignore[misc]
    """Celery's worker, whose soft shutdown is skipped when it holds no work."""

    def wait_for_soft_shutdown(self) -> None:
        if not holds_work():
            log.info("worker: no run in flight and no message held; stopping at once",
                     extra={"action": "shutdown_idle"})
            return
        super().wait_for_soft_shutdown()

    def terminate(self, in_sighandler: bool = False) -> None:
        """A cold shutdown (SIGQUIT, or SIGTERM as ``loomflow-worker worker``
        remaps it, after the soft shutdown): Celery's, then ``worker_shutdown``
        as a warm shutdown sends it."""
        super().terminate(in_sighandler=in_sighandler)
        if not in_sighandler or self.pool.signal_safe:
            self._send_worker_shutdown()
