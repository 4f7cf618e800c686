"""The README's first command: `loomflow-worker demo`, run as a new user would."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _demo(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loomflow_worker.cli", "demo", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("LOOMFLOW_WORKER_") and k != "ANTHROPIC_API_KEY"}
    env["LOOMFLOW_WORKER_DEMO_TOOL_SLEEP"] = "0.5"
    return env


def _check_story(out: str) -> None:
    assert re.search(r"runs finished\s+6/6", out), out
    assert re.search(r"worker killed\s+worker-[ab]; resumed elsewhere: \w{8}", out), out
    replayed = int(re.search(r"steps replayed\s+(\d+)", out)[1])  # type: ignore[index]
    assert replayed >= 2, out
    assert "each completed once: yes" in out, out


def test_the_demo_on_its_own_private_postgres_and_redis() -> None:
    done = _demo("--embedded", env=_clean_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "started a private Postgres" in done.stdout
    assert "started a private Redis" in done.stdout
    _check_story(done.stdout)


def test_the_demo_on_the_machines_services(dsn: str) -> None:
    env = {**_clean_env(), "LOOMFLOW_WORKER_DATABASE_URL": dsn}
    done = _demo(env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "private" not in done.stdout  # Postgres configured, Redis answering locally
    _check_story(done.stdout)
