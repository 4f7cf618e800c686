"""The README's first command: `loomflow-worker demo`, run as a new user would."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx

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


def test_the_demo_on_the_machines_services_ends_serving_the_console(dsn: str) -> None:
    env = {**_clean_env(), "LOOMFLOW_WORKER_DATABASE_URL": dsn}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    demo = subprocess.Popen(
        [sys.executable, "-m", "loomflow_worker.cli", "demo", "--console", "--console-port",
         str(port)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )
    try:
        assert demo.stdout is not None
        out = ""
        for line in demo.stdout:
            out += line
            if "Ctrl-C to stop" in line:
                break
        found = re.search(rf"console\s+(http://127\.0\.0\.1:{port}/runs/([0-9a-f-]+)) ", out)
        assert found, out
        # The run it links to is the one whose worker was killed: two attempt lanes.
        resumed = re.search(r"resumed elsewhere: ([\w, ]+)\n", out)
        assert resumed and found[2][:8] in resumed[1].split(", "), out
        page = httpx.get(found[1], timeout=30)
        assert page.status_code == 200
        assert page.text.count('<g class="lane') == 2 and 'data-outcome="worker died"' in page.text
        demo.send_signal(signal.SIGINT)  # Ctrl-C
        rest, _ = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert demo.returncode == 0, out + rest
    assert "private" not in out  # Postgres configured, Redis answering locally
    _check_story(out)
