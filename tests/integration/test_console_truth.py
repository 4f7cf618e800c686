"""What the console's run page and `show` say of a request explain themselves:
a worker's death is charged to the request (a crash) or not (shared with
other runs of its process), and says which and why."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from loomflow_worker.console import create_app
from loomflow_worker.tasks import run_agent, settings

from .celery_harness import Fleet, ledger
from .helpers import calls, cli, wait_for_execution

FAST = {
    "LOOMFLOW_WORKER_SWEEP_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_LEASE": "3",
    "TEST_TOOL_SLEEP": "0.4",
}


@pytest.fixture
def client(fleet: Fleet) -> Iterator[TestClient]:
    with TestClient(create_app(settings()), client=("127.0.0.1", 40000),
                    base_url="http://localhost:8040") as local:
        yield local


def _text(fragment: str) -> str:
    """An HTML fragment's text, its whitespace flattened."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


def _attempt_row(page: str, attempt: int) -> str:
    found = re.search(rf'<tr data-attempt="{attempt}">(.*?)</tr>', page, re.S)
    assert found is not None, page
    return _text(found[1])


def _counts(page: str) -> str:
    found = re.search(r"<dt>counts</dt><dd>(.*?)</dd>", page, re.S)
    assert found is not None, page
    return _text(found[1])


def _killed_mid_run(fleet: Fleet, pool: str, *names: str) -> list[str]:
    """Requests of sessions ``names`` running at once in one worker (of
    ``pool``, one slot a request), killed mid-run and finished by another;
    their ids."""
    results = [run_agent.delay(calls(f"{n}0", f"{n}1", f"{n}2"), f"session-{n}")
               for n in names]
    fleet.start("w1", concurrency=len(names), pool=pool, **FAST)
    for name in names:
        wait_for_execution(fleet.dsn, f"{name}1")
    fleet.kill("w1")
    fleet.start("w2", concurrency=len(names), pool=pool, **FAST)
    for name, result in zip(names, results, strict=True):
        assert result.get(timeout=60)["output"].startswith(f"done: recorded {name}0")
    return [str(result.id) for result in results]


@pytest.mark.slow
def test_a_death_shared_with_other_runs_says_it_is_not_a_crash_of_the_request(
    fleet: Fleet, client: TestClient
) -> None:
    first, _ = _killed_mid_run(fleet, "threads", "a", "b")
    assert ledger(fleet.dsn, first)["crashes"] == 0

    page = client.get(f"/runs/{first}").text
    counts = _counts(page)
    assert "0 crashes" in counts
    assert ("attempt 1's worker died with other runs of its process: not counted as a "
            "crash of this request") in counts
    died = _attempt_row(page, 1)
    assert "worker died" in died
    assert ("its worker process died with 1 other request's run in it: a death shared with "
            "other runs is not a crash of this request") in died
    assert "succeeded" in _attempt_row(page, 2)

    shown = cli(fleet, "show", first)
    assert shown.returncode == 0, shown.stderr
    assert "attempt 1: its worker process died with 1 other request's run in it" in shown.stdout
    assert "not counted as a crash of this request" in shown.stdout

    # The journal names each step as a person reads it, its key on hover.
    steps = dict(re.findall(r'<td class="step"><code title="([^"]+)">([^<]+)</code>', page))
    labels = {html.unescape(label): html.unescape(key) for key, label in steps.items()}
    assert {"model call 1", 'tool record(tag="a0")', 'tool record(tag="a1")',
            'tool record(tag="a2")'} <= set(labels), labels
    assert labels['tool record(tag="a1")'].startswith("idem:tool_call_")
    assert labels["model call 1"].startswith("model_call_1@")
    assert re.search(r'tool record\(tag="a1"\)\s+idem:tool_call_', shown.stdout), shown.stdout


@pytest.mark.slow
def test_a_death_alone_says_it_is_a_crash_of_the_request(
    fleet: Fleet, client: TestClient
) -> None:
    (killed,) = _killed_mid_run(fleet, "prefork", "c")
    assert ledger(fleet.dsn, killed)["crashes"] == 1

    page = client.get(f"/runs/{killed}").text
    counts = _counts(page)
    assert "1 crash" in counts
    assert "attempt 1's worker died while no other run died with it: counted as a crash" in counts
    assert ("its worker process died while it ran alone with no other request's run dying "
            "there: a crash of this request") in _attempt_row(page, 1)
