"""Versioned schema migrations, safe when many processes start at once."""

from __future__ import annotations

import logging
from typing import Any

from psycopg import AsyncConnection

from .errors import SchemaError
from .sql import migrations, query

log = logging.getLogger(__name__)

# Every process migrating takes this transaction-level advisory lock first,
# so a fleet starting together applies each migration exactly once.
MIGRATION_LOCK_KEY = 0x6C6F6F6D_666C6F77  # "loomflow"


def latest_version() -> int:
    return migrations()[-1].version


async def applied_versions(conn: AsyncConnection[Any]) -> list[int]:
    cur = await conn.execute(query("schema_present"))
    row = await cur.fetchone()
    if not (row and row[0]):
        return []
    cur = await conn.execute(query("schema_versions"))
    return [r[0] for r in await cur.fetchall()]


async def migrate(conn: AsyncConnection[Any]) -> list[int]:
    """Apply the migrations this database lacks; return the versions applied.

    One transaction under an advisory lock: concurrent callers wait, then
    find nothing left to do. A database migrated by a newer release is
    refused rather than touched."""
    applied: list[int] = []
    async with conn.transaction():
        await conn.execute(query("migration_lock"), {"key": MIGRATION_LOCK_KEY})
        await conn.execute(query("create_schema_table"))
        done = set(await applied_versions(conn))
        if done and max(done) > latest_version():
            raise SchemaError(
                f"the database schema is at version {max(done)}, newer than this "
                f"loomflow-worker's {latest_version()}: upgrade loomflow-worker"
            )
        for migration in migrations():
            if migration.version in done:
                continue
            await conn.execute(migration.sql)
            await conn.execute(
                query("record_version"), {"version": migration.version, "name": migration.name}
            )
            applied.append(migration.version)
            log.info(
                "applied migration %04d_%s",
                migration.version,
                migration.name,
                extra={"action": "migrate", "version": migration.version},
            )
    return applied
