"""Worker-side hook for the chaos tests (imported through LOOMFLOW_WORKER_AGENTS).

With ``TEST_LOSE_WORKER_AFTER_COMMIT=<marker file>``, the first run that
succeeds SIGKILLs its whole worker (main process and every pool child, as
a lost node) right after its finishing commit, before Celery stores the
result, acks the message or publishes the handoff to the next request."""

from __future__ import annotations

import os
import signal
from typing import Any


def _lose_worker_after_commit(marker: str) -> None:
    from loomflow_worker.tasks import perform as task_app

    namespace = vars(task_app)
    execute = namespace["execute"]

    async def execute_then_lose_worker(*args: Any, **kwargs: Any) -> Any:
        outcome = await execute(*args, **kwargs)
        if outcome.kind == "succeeded" and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            os.killpg(os.getpgid(0), signal.SIGKILL)
        return outcome

    namespace["execute"] = execute_then_lose_worker


if os.environ.get("TEST_LOSE_WORKER_AFTER_COMMIT"):
    _lose_worker_after_commit(os.environ["TEST_LOSE_WORKER_AFTER_COMMIT"])
