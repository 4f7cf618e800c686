"""Every page's Python examples, run: a page whose scripts need no worker runs them in
this process against a test database; a page that registers agents or sends requests
gets a real worker (``loomflow-worker worker`` in the example's folder), and its scripts
run one after another in processes of their own, as a reader runs them. A script's
``assert`` lines are what its page promises. The README's story, with its crash, is
tests/integration/test_readme_example.py."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from tests.doc_blocks import (
    ROOT,
    Block,
    agent_modules,
    blocks,
    needs_worker,
    pages,
    worker,
    write_files,
)

from .celery_harness import Fleet

#: Pages whose examples tests/integration/test_readme_example.py runs, crash and all.
TOLD_ELSEWHERE = {ROOT / "README.md", ROOT / "docs" / "getting-started.md"}


def _runnable(page: Path) -> bool:
    return page not in TOLD_ELSEWHERE and any(b.kind != "fragment" for b in blocks(page))


IN_PROCESS = [p for p in pages() if _runnable(p) and not needs_worker(blocks(p))]
BESIDE_A_WORKER = [p for p in pages() if _runnable(p) and needs_worker(blocks(p))]


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _imported_files(shown: list[Block]) -> list[str]:
    """The page's files that are neither agents modules nor run by its scripts."""
    scripts = "\n".join(b.code for b in shown if b.kind == "script")
    agents = set(agent_modules(shown))
    return [module for b in shown if b.kind == "file" and b.title
            if (module := b.title.removesuffix(".py")) not in agents and module not in scripts]


def test_the_pages_have_examples_to_run() -> None:
    assert len(IN_PROCESS) >= 1 and len(BESIDE_A_WORKER) >= 5, (IN_PROCESS, BESIDE_A_WORKER)


@pytest.mark.parametrize("page", IN_PROCESS, ids=_name)
def test_a_pages_examples_run_in_process(page: Path, dsn: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    shown = blocks(page)
    write_files(shown, tmp_path)
    monkeypatch.setenv("LOOMFLOW_WORKER_DATABASE_URL", dsn)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for module in _imported_files(shown):
        runpy.run_path(str(tmp_path / f"{module}.py"))
    scripts = [b for b in shown if b.kind == "script"]
    for block in scripts:
        exec(compile(block.code, str(block), "exec"), {"__name__": "__main__"})


@pytest.mark.slow
@pytest.mark.parametrize("page", BESIDE_A_WORKER, ids=_name)
def test_a_pages_examples_run_beside_a_worker(page: Path, fleet: Fleet, tmp_path: Path) -> None:
    shown = blocks(page)
    folder = tmp_path / "app"
    folder.mkdir()
    write_files(shown, folder)
    env = {k: v for k, v in fleet.env.items() if k not in ("LOOMFLOW_WORKER_AGENTS", "PYTHONPATH")}
    agents = agent_modules(shown)
    assert agents, f"{_name(page)} sends requests but registers no agent"
    for module in _imported_files(shown):
        done = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=folder, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{module}.py of {_name(page)}:\n{done.stderr}"
    log = tmp_path / "worker.log"
    with worker(folder, env, log, agents):
        for block in (b for b in shown if b.kind == "script"):
            done = subprocess.run([sys.executable, "-c", block.code], cwd=folder, env=env,
                                  capture_output=True, text=True, timeout=180)
            assert done.returncode == 0, (
                f"the example at {block} failed:\n{done.stdout}{done.stderr}\n--- worker\n"
                + log.read_text(errors="replace")[-4000:])
