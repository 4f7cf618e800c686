"""What the operator tools raise besides the runtime's errors."""

from __future__ import annotations

from ..runtime.errors import LoomflowWorkerError


class RequestNotFound(LoomflowWorkerError, LookupError):
    """No request with this id in the runs ledger."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(
            f"no request {request_id!r} in the runs ledger (pruned, mistyped, or enqueued "
            "against another database); `loomflow-worker runs` lists the recent ones"
        )
