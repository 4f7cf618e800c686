"""Celery worker options the threads pool cannot honour are refused at start,
with one line saying what to use instead, whether given on the command line or
in the Celery config."""

from __future__ import annotations

from pathlib import Path

import pytest

from .celery_harness import ROOT, Fleet

pytestmark = pytest.mark.slow


def _refusal(fleet: Fleet, args: tuple[str, ...] = (), **env: str) -> str:
    """Start ``loomflow-worker worker`` with ``args``; the line it exits with."""
    fleet.start("w1", cli=True, pool="threads", concurrency=4, wait=False, args=args, **env)
    code, out = fleet.wait_exit("w1", timeout=30)
    assert code != 0, out
    lines = [line for line in out.splitlines() if line.startswith("loomflow-worker:")]
    assert len(lines) == 1, out
    return lines[0]


def test_autoscale_on_the_threads_pool_is_refused_at_start(fleet: Fleet) -> None:
    line = _refusal(fleet, ("--autoscale", "8,2"))
    assert "--autoscale is not supported on the threads pool" in line
    assert "set -c" in line and "scale the fleet by processes" in line


@pytest.mark.parametrize(
    ("args", "option"),
    [(("--max-tasks-per-child", "3"), "--max-tasks-per-child"),
     (("--max-memory-per-child", "200000"), "--max-memory-per-child")],
)
def test_recycling_options_on_the_threads_pool_are_refused_at_start(
    fleet: Fleet, args: tuple[str, ...], option: str
) -> None:
    line = _refusal(fleet, args)
    assert f"{option} " in line and "is not supported on the threads pool" in line
    assert "-P prefork" in line


@pytest.mark.parametrize(
    ("setting", "option"),
    [("worker_max_tasks_per_child = 3", "worker_max_tasks_per_child"),
     ("worker_max_memory_per_child = 200000", "worker_max_memory_per_child")],
)
def test_recycling_settings_in_the_celery_config_are_refused_too(
    fleet: Fleet, tmp_path: Path, setting: str, option: str
) -> None:
    (tmp_path / "recycling_config.py").write_text(setting + "\n")
    line = _refusal(fleet, CELERY_CONFIG_MODULE="recycling_config",
                    PYTHONPATH=f"{ROOT}:{tmp_path}")
    assert f"({option})" in line and "-P prefork" in line
