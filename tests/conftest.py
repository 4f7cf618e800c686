"""Fixtures: a fresh database per test, cloned from a migrated template;
where no Postgres or Redis answers, private ones for the run (see
``tests/stand_ins.py``); under ``CI=true`` a skipped test fails (see
``tests/needs.py``); and a test that starts a process (a worker, a subprocess,
a private server) fails unless it is marked ``slow``, so that ``-m "not slow"``
runs in one process."""

from __future__ import annotations

from tests import stand_ins

# Before anything reads the addresses (tests.needs, the Celery harness), as
# pytest loads this file ahead of every test module: a pytest-xdist worker, or
# a phase of ``python -m tests``, finds those its parent started answering.
_STAND_INS = stand_ins.start_missing()

import concurrent.futures
import os
import sys
import uuid
from collections.abc import AsyncIterator, Generator, Iterator

import pluggy
import psycopg
import pytest
from psycopg import sql

from loomflow_worker.runtime import PostgresRuntime, migrate
from loomflow_worker.runtime.sql import query
from tests.needs import ADMIN_DSN, skip_as_failure, skip_reason, skips_fail

# Every write of a journal entry, kept by a trigger: a step key written twice
# (bookkeeping keys aside) is a completed step that ran again, whatever the
# tool's own records say about when its side effect finished.
JOURNAL_WRITES_DDL = """
CREATE TABLE journal_writes (
    id BIGSERIAL PRIMARY KEY, session_id TEXT NOT NULL, step_name TEXT NOT NULL,
    backend_pid INTEGER NOT NULL, written_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION journal_writes_log() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO journal_writes (session_id, step_name, backend_pid)
    VALUES (NEW.session_id, NEW.step_name, pg_backend_pid());
    RETURN NEW;
END $$;
CREATE TRIGGER journal_steps_writes AFTER INSERT OR UPDATE ON journal_steps
    FOR EACH ROW EXECUTE FUNCTION journal_writes_log();
CREATE TRIGGER journal_streams_writes AFTER INSERT OR UPDATE ON journal_streams
    FOR EACH ROW EXECUTE FUNCTION journal_writes_log();
"""


def dsn_for(dbname: str) -> str:
    return psycopg.conninfo.make_conninfo(ADMIN_DSN, dbname=dbname)


def _admin(statement: sql.Composable) -> None:
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(statement)


# What a test starts a process with, as Python audits it.
_STARTS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn",
                     "os.posix_spawnp"})
_started: list[str] = []  # by the test now running


def _note_start(event: str, args: tuple[object, ...]) -> None:
    if event in _STARTS:
        _started.append(f"{event} {args[1] if len(args) > 1 else ''}"[:200])


sys.addaudithook(_note_start)


def _unmarked_start(item: pytest.Item, report: pytest.TestReport) -> None:
    """Fail a passing test not marked ``slow`` that started a process."""
    if report.passed and _started and item.get_closest_marker("slow") is None:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} started a process ({_started[0]}) but is not marked slow: "
            "mark it (@pytest.mark.slow, or pytestmark = pytest.mark.slow for the module) "
            "so that the fast tier, -m \"not slow\", stays in one process"
        )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _started.clear()


def _skip_fails(report: pytest.CollectReport | pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail") and skips_fail(os.environ):
        report.outcome = "failed"
        report.longrepr = skip_as_failure(skip_reason(report.longrepr))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[
        None, pluggy.Result[pytest.TestReport], None]:
    outcome = yield
    report = outcome.get_result()
    if call.when == "call":
        _unmarked_start(item, report)
    _skip_fails(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[
        None, pluggy.Result[pytest.CollectReport], None]:
    outcome = yield
    _skip_fails(outcome.get_result())


def pytest_sessionstart(session: pytest.Session) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if _STAND_INS.notice is not None and reporter is not None:
        reporter.write_line(_STAND_INS.notice)


def pytest_unconfigure(config: pytest.Config) -> None:
    _STAND_INS.stop()


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def template_db() -> Iterator[str]:
    name = f"lfw_template_{uuid.uuid4().hex[:10]}"
    _admin(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        with psycopg.connect(dsn_for(name), autocommit=True) as conn:
            import anyio

            async def apply() -> None:
                async with await psycopg.AsyncConnection.connect(dsn_for(name)) as aconn:
                    await migrate(aconn)

            anyio.run(apply)
            # The effects tool's table, as EffectsLog.setup makes it.
            conn.execute(query("effects_table"))
            conn.execute(JOURNAL_WRITES_DDL)
        yield name
    finally:
        _admin(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
def empty_dsn() -> Iterator[str]:
    """A database with no schema at all."""
    name = f"lfw_empty_{uuid.uuid4().hex[:10]}"
    _admin(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield dsn_for(name)
    finally:
        _admin(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


class _Clones:
    """Fresh copies of the template, each made one test ahead in a thread of its
    own, so that a test does not wait for its database to be copied."""

    def __init__(self, template: str) -> None:
        self.template = template
        self._next: concurrent.futures.Future[str] | None = None
        self._maker = concurrent.futures.ThreadPoolExecutor(1, "lfw-clone")

    def _clone(self) -> str:
        name = f"lfw_test_{uuid.uuid4().hex[:10]}"
        _admin(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(self.template)
            )
        )
        return name

    def take(self) -> str:
        """A database no test had, and the next one started."""
        made = self._next.result() if self._next is not None else self._clone()
        self._next = self._maker.submit(self._clone)
        return made

    def close(self) -> None:
        self._maker.shutdown(wait=True)
        if self._next is not None and self._next.exception() is None:
            _drop(self._next.result())


def _drop(name: str) -> None:
    _admin(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(scope="session")
def _clones(template_db: str) -> Iterator[_Clones]:
    clones = _Clones(template_db)
    try:
        yield clones
    finally:
        clones.close()


@pytest.fixture
def dsn(_clones: _Clones) -> Iterator[str]:
    """A migrated database of this test's own, dropped afterwards."""
    name = _clones.take()
    try:
        yield dsn_for(name)
    finally:
        _drop(name)


@pytest.fixture
async def runtime(dsn: str, request: pytest.FixtureRequest) -> AsyncIterator[PostgresRuntime]:
    """A runtime on the test's database; parametrized indirectly, its number of
    lock connections (``@pytest.mark.parametrize("runtime", [1], indirect=True)``)."""
    rt = await PostgresRuntime.connect(
        dsn, lock_wait_timeout=10, lock_connections=getattr(request, "param", 2))
    try:
        yield rt
    finally:
        await rt.aclose()
