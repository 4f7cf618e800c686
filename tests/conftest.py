"""Fixtures: a fresh database per test, cloned from a migrated template."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator

import psycopg
import pytest
from psycopg import sql

from loomflow_worker.runtime import PostgresRuntime, migrate

ADMIN_DSN = os.environ.get(
    "LOOMFLOW_WORKER_TEST_ADMIN_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"
)


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
            conn.execute(
                "CREATE TABLE IF NOT EXISTS loomflow_worker_effects ("
                " id BIGSERIAL PRIMARY KEY, tag TEXT NOT NULL, pid INTEGER NOT NULL,"
                " started_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),"
                " finished_at TIMESTAMPTZ)"
            )
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


@pytest.fixture
def dsn(template_db: str) -> Iterator[str]:
    """A migrated database of this test's own, dropped afterwards."""
    name = f"lfw_test_{uuid.uuid4().hex[:10]}"
    _admin(
        sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template_db)
        )
    )
    try:
        yield dsn_for(name)
    finally:
        _admin(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
async def runtime(dsn: str) -> AsyncIterator[PostgresRuntime]:
    rt = await PostgresRuntime.connect(dsn, lock_wait_timeout=10)
    try:
        yield rt
    finally:
        await rt.aclose()
