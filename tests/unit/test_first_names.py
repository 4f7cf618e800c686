"""Public names that spoke of a "run" for the ledger's request, renamed to the
README's words, keep working under their first names: applications and
scripts call them."""

from __future__ import annotations

from datetime import UTC, datetime

import loomflow_worker
from loomflow_worker import admin


def test_cancel_run_is_cancel_request() -> None:
    assert loomflow_worker.cancel_run is loomflow_worker.cancel_request
    assert {"cancel_request", "cancel_run"} <= set(loomflow_worker.__all__)


def test_the_request_reads_keep_their_first_names() -> None:
    assert admin.get_run is admin.get_request
    assert admin.list_runs is admin.list_requests
    assert admin.run_status is admin.request_status
    assert admin.RunDetail is admin.RequestDetail
    assert admin.RunRow is admin.RequestSummary
    assert admin.RunStatus is admin.RequestStatus


def test_show_json_prints_the_worker_as_holder_too() -> None:
    """``show --json`` printed the worker as ``holder`` first; scripts read it."""
    now = datetime(2025, 6, 1, tzinfo=UTC)
    detail = admin.RequestDetail(
        request_id="r1", seq=1, scope="s", session_id="s", user_id=None, agent="a",
        kind="run", prompt="p", prompt_length=1, metadata={}, status="running", epoch=1,
        attempts_count=1, failures=0, crashes=0, worker="celery@h:12", cancel_requested=False,
        result=None, error=None, error_type=None, enqueued_at=now, started_at=now,
        heartbeat_at=now, finished_at=None, not_before=None, now=now,
    )
    assert detail.holder == "celery@h:12"
    shown = detail.as_json()
    assert (shown["worker"], shown["holder"]) == ("celery@h:12", "celery@h:12")
