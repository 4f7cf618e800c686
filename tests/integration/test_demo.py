"""The README's first command: `loomflow-worker demo`, run as a new user would."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from tests.needs import ADMIN_DSN, REDIS_URL
from tests.stand_ins import where

pytestmark = pytest.mark.slow

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
    # Its services stop, saying so, before its last line: where to see the run.
    assert "- stopping the private Postgres" in done.stdout
    assert done.stdout.rstrip().splitlines()[-1] == (
        "  console              `loomflow-worker demo --console` ends serving the killed "
        "run's page in the run console")


def _children(pid: int) -> set[int]:
    """The processes below ``pid`` (from /proc), whatever session they started."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        kids = {child for child, ppid in parents.items() if ppid == parent} - found
        found |= kids
        todo.extend(kids)
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def _demo_database_of(out: str) -> str:
    found = re.search(r"created the database (loomflow_worker_demo_[0-9a-f]+) for this demo", out)
    assert found, out
    return found[1]


def _databases_named(name: str) -> list[str]:
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        return [r[0] for r in conn.execute(
            "SELECT datname FROM pg_database WHERE datname = %s", (name,))]


class _ConsoleDemo:
    """``demo --console`` on the machine's services (Postgres: ``dsn``), its
    temporary folders under ``tmp``, read until it serves the console."""

    def __init__(self, dsn: str, tmp: Path) -> None:
        env = {**_clean_env(), "LOOMFLOW_WORKER_DATABASE_URL": dsn,
               "LOOMFLOW_WORKER_BROKER_URL": REDIS_URL, "TMPDIR": str(tmp)}
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loomflow_worker.cli", "demo", "--console", "--console-port",
             str(self.port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        assert self.proc.stdout is not None
        self.out = ""
        for line in self.proc.stdout:
            self.out += line
            if "Ctrl-C to stop" in line:
                break
        self.children = _children(self.proc.pid)

    def stop(self, signum: int) -> str:
        self.proc.send_signal(signum)
        rest, _ = self.proc.communicate(timeout=60)
        return rest

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in _alive(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_the_demo_on_the_machines_services_ends_serving_the_console(
    dsn: str, tmp_path: Path
) -> None:
    """On a server it did not start, the demo works in a database of its own,
    dropped at the end: the configured database gets no table and no row, and
    the console shows this demo's runs only. Ctrl-C says what it waits for."""
    demo = _ConsoleDemo(dsn, tmp_path)
    try:
        out = demo.out
        port = demo.port
        found = re.search(rf"console\s+(http://127\.0\.0\.1:{port}/runs/([0-9a-f-]+)) ", out)
        assert found, out
        # The run it links to is the one whose worker was killed: two attempt lanes.
        resumed = re.search(r"resumed elsewhere: ([\w, ]+)\n", out)
        assert resumed and found[2][:8] in resumed[1].split(", "), out
        page = httpx.get(found[1], timeout=30)
        assert page.status_code == 200
        assert page.text.count('<g class="lane') == 2 and 'data-outcome="worker died"' in page.text
        # Its console lists its own six requests, none of another demo's.
        listed = httpx.get(f"http://127.0.0.1:{port}/requests", timeout=30)
        assert listed.status_code == 200
        assert len(set(re.findall(r'href="/runs/([0-9a-f-]{36})"', listed.text))) == 6
        database = _demo_database_of(out)
        assert _databases_named(database) == [database]
        rest = demo.stop(signal.SIGINT)  # Ctrl-C
    finally:
        demo.close()
    assert demo.proc.returncode == 0, out + rest
    assert "private" not in out  # Postgres and Redis configured
    _check_story(out)
    assert "- stopping worker-" in rest and "killed if still there after 10 s" in rest, rest
    assert f"- dropping the demo's database {database}" in rest, rest
    assert _databases_named(database) == []
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM runs").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM loomflow_worker_effects").fetchone() == (0,)
    assert _alive(demo.children) == set()
    assert list(tmp_path.iterdir()) == []


def test_sigterm_stops_the_demo_and_everything_it_started(dsn: str, tmp_path: Path) -> None:
    """SIGTERM to `demo --console` stops it as Ctrl-C does: no worker left
    running, no temporary folder, no database left behind."""
    demo = _ConsoleDemo(dsn, tmp_path)
    try:
        assert len(_alive(demo.children)) >= 1, demo.out  # worker-a, at least
        assert len(list(tmp_path.iterdir())) == 2
        rest = demo.stop(signal.SIGTERM)
        left = _alive(demo.children)
    finally:
        demo.close()
    assert left == set(), demo.out
    assert list(tmp_path.iterdir()) == []
    assert "- SIGTERM: stopping everything" in rest, rest
    assert _databases_named(_demo_database_of(demo.out)) == []


def test_a_user_who_may_not_create_databases_is_told_what_to_do(dsn: str) -> None:
    role = f"lfw_nocreatedb_{os.getpid()}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN NOCREATEDB").format(sql.Identifier(role)))
    try:
        env = {**_clean_env(),
               "LOOMFLOW_WORKER_DATABASE_URL": make_conninfo(dsn, user=role)}
        done = _demo(env=env)
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"the demo creates a database of its own on {where(ADMIN_DSN)}/" in done.stderr
    assert "permission denied to create database" in done.stderr
    assert "give the user CREATEDB" in done.stderr and "--embedded" in done.stderr
    assert "Traceback" not in done.stderr
