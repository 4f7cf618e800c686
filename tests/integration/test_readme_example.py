"""The README's own agent, run as a reader runs it: a worker started in the folder of
``myagents.py``, ``enqueue.py`` from another process, the worker SIGKILLed during the
second request and started again, and ``loomflow-worker show`` on what happened. The
same story in docs/getting-started.md."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.doc_blocks import COMMAND, ROOT, Block, blocks, worker, write_files

from .celery_harness import Fleet
from .helpers import wait_until

pytestmark = pytest.mark.slow

PAGES = [ROOT / "README.md", ROOT / "docs" / "getting-started.md"]


def _env(fleet: Fleet) -> dict[str, str]:
    env = {k: v for k, v in fleet.env.items() if k not in ("LOOMFLOW_WORKER_AGENTS", "PYTHONPATH")}
    return {**env, "PYTHONUNBUFFERED": "1"}


def _worker(folder: Path, env: dict[str, str], log: Path) -> Any:
    return worker(folder, env, log, ["myagents"])


def _first_calls_journaled(dsn: str) -> int:
    """The journaled first tool calls of the session's runs."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM journal_steps"
                           " WHERE step_name LIKE '%idem:tool\\_call\\_1\\_0%'").fetchone()
    return int(row[0]) if row else 0


def _charged(log: Path) -> list[str]:
    return re.findall(r"charged order (\d+)", log.read_text(errors="replace"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_offline_example_runs_crashes_and_resumes_as_the_page_says(
        page: Path, fleet: Fleet, tmp_path: Path) -> None:
    shown: list[Block] = blocks(page)
    assert sorted(b.title or "" for b in shown if b.kind == "file") == ["enqueue.py",
                                                                        "myagents.py"]
    folder = tmp_path / "app"
    folder.mkdir()
    write_files(shown, folder)
    env = _env(fleet)
    log = tmp_path / "worker.log"

    with _worker(folder, env, log):
        done = subprocess.run([sys.executable, "enqueue.py"], cwd=folder, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert re.fullmatch(r"request \S+\ndone: charged 1, charged 2, charged 3\n",
                            done.stdout), done.stdout
        assert _charged(log) == ["1", "2", "3"]

    # Again; the worker killed while order 2 is being charged, then started again.
    second = subprocess.Popen([sys.executable, "enqueue.py"], cwd=folder, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with _worker(folder, env, log) as proc:
            wait_until(lambda: _charged(log) == ["1", "2", "3", "1"], "order 1 charged again",
                       60, every=0.05)
            # ... and journaled: a reader's kill comes seconds later.
            wait_until(lambda: _first_calls_journaled(fleet.dsn) == 2,
                       "order 1's call journaled", 60, every=0.05)
            os.killpg(proc.pid, signal.SIGKILL)  # pkill -9 -f 'loomflow-worker worker'
        with _worker(folder, env, log):
            out, err = second.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            second.kill()
    assert second.returncode == 0, out + err
    request_id = re.fullmatch(r"request (\S+)\ndone: charged 1, charged 2, charged 3\n", out)
    assert request_id, out
    # Order 1 replayed from the journal: charged once by this request. Order 2 was in
    # flight at the kill (maybe charged, maybe not), and 3 is charged once.
    charged = _charged(log)[4:]
    assert "1" not in charged and charged.count("3") == 1 and charged[-1] == "3", charged

    story = subprocess.run([str(COMMAND), "show", request_id[1]], cwd=folder, env=env,
                           capture_output=True, text=True, timeout=60)
    assert story.returncode == 0, story.stdout + story.stderr
    assert "succeeded" in story.stdout, story.stdout
    assert re.search(r"\n  1 .* worker died\b.*\n  2 .* succeeded\b.*\n", story.stdout), \
        story.stdout
    assert "executed in attempt 1, replayed in 2" in story.stdout, story.stdout
