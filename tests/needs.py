"""What the tests need beyond Python packages: PostgreSQL's admin connection
(:data:`ADMIN_DSN`), programs, and what CI makes of a skip.

A test that needs a program the machine lacks (PgBouncer, Chromium, kubectl)
is skipped with a reason naming what to install, so ``python -m pytest`` on a
fresh machine passes. Under ``CI=true`` (what ``.ci/run`` sets) any skip is a
failure instead: CI installs everything and must run every test.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pytest

#: A superuser's connection to the server the tests make their databases on.
ADMIN_DSN = os.environ.get(
    "LOOMFLOW_WORKER_TEST_ADMIN_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"
)

# Debian puts daemons in sbin, which a user's PATH may lack.
SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")


@dataclass(frozen=True)
class Program:
    """A program found by one of ``names`` on PATH (or in ``SBIN``), and how to get it."""

    names: tuple[str, ...]
    install: str
    purpose: str
    sbin: bool = False

    def find(self, path: str | None = None) -> str | None:
        search = os.environ.get("PATH", os.defpath) if path is None else path
        if self.sbin:
            search = os.pathsep.join([search, *SBIN])
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


PGBOUNCER = Program(("pgbouncer",), "apt-get install pgbouncer",
                    "the pooler tests", sbin=True)
CHROMIUM = Program(("chromium", "chromium-browser"), "apt-get install chromium",
                   "the console's browser tests")
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
