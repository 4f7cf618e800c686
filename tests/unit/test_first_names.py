"""Public names renamed to the README's words (a "run" that meant the ledger's
request, a ``lease`` that meant the lease's timeout) keep working under their
first names: applications, scripts and deployments use them."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

import pytest

import loomflow_worker
from loomflow_worker import admin
from loomflow_worker.settings import Settings


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


def test_the_lease_timeout_is_still_read_from_loomflow_worker_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LOOMFLOW_WORKER_LEASE", "12")
    assert Settings().lease_timeout == 12.0
    assert Settings(lease_timeout=8).lease_timeout == 8.0  # code overrides the environment
    monkeypatch.delenv("LOOMFLOW_WORKER_LEASE")
    monkeypatch.setenv("LOOMFLOW_WORKER_LEASE_TIMEOUT", "9")  # not a variable of its own
    assert Settings().lease_timeout == 30.0


def test_the_lease_timeout_keeps_its_first_name_in_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOMFLOW_WORKER_LEASE", "12")
    given = Settings(lease=7)
    assert (given.lease_timeout, given.lease) == (7.0, 7.0)


NAMES_PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "names.md"


def _surface() -> dict[str, list[str]]:
    """The package's public names, as the code has them."""
    import loomflow_worker.runtime
    import loomflow_worker.tasks
    import loomflow_worker.testing
    from loomflow_worker import cli, metrics
    from loomflow_worker.runtime.sql import migrations
    from loomflow_worker.tasks.dispatch import RESUME_AGENT, RUN_AGENT

    created = re.compile(r"CREATE (?:TABLE|VIEW|OR REPLACE VIEW) (?:IF NOT EXISTS )?(\w+)")
    return {
        "imports": [*loomflow_worker.__all__, *loomflow_worker.tasks.__all__,
                    *loomflow_worker.runtime.__all__, *loomflow_worker.testing.__all__],
        "commands": [name for name, command in cli.main.commands.items() if not command.hidden],
        "tasks": [RUN_AGENT, RESUME_AGENT],
        "metrics": sorted(set(re.findall(r'"(loomflow_worker_\w+)"',
                                         Path(metrics.__file__).read_text()))),
        "tables": sorted({name for m in migrations() for name in created.findall(m.sql)}),
    }


@pytest.mark.parametrize("kind", ["imports", "commands", "tasks", "metrics", "tables"])
def test_the_names_page_lists_every_public_name(kind: str) -> None:
    listed = set(re.findall(r"`([^`]+)`", NAMES_PAGE.read_text()))
    assert [name for name in _surface()[kind] if name not in listed] == []


def test_the_names_page_lists_every_old_name_kept() -> None:
    from loomflow_worker.tasks.old_names import STORED_MODULES

    page = NAMES_PAGE.read_text()
    old = [*STORED_MODULES, "cancel_run", "loomflow-worker runs", "admin.get_run",
           "admin.list_runs", "admin.run_status", "admin.RunDetail", "admin.RunRow",
           "admin.RunStatus", "LOOMFLOW_WORKER_LEASE"]
    assert [name for name in old if name not in page] == []
