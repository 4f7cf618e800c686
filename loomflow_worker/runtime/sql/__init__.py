"""The runtime's SQL: named queries and versioned migrations, loaded once."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

from psycopg import sql

_HEADER = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


@cache
def queries() -> dict[str, sql.SQL]:
    """Every query of ``queries.sql`` by its ``-- name:`` header."""
    text = resources.files(__package__).joinpath("queries.sql").read_text("utf-8")
    parts = _HEADER.split(text)
    found: dict[str, sql.SQL] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        found[name] = sql.SQL(body.strip().rstrip(";"))
    return found


def query(name: str) -> sql.SQL:
    return queries()[name]


@cache
def migrations() -> tuple[Migration, ...]:
    """The migrations, ordered by version (``NNNN_name.sql``)."""
    folder = resources.files(__package__).joinpath("migrations")
    found = []
    for entry in folder.iterdir():
        match = re.fullmatch(r"(\d{4})_(\w+)\.sql", entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    return tuple(found)
