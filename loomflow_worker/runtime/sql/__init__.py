"""The package's SQL: named queries and versioned migrations, loaded once.

Each ``*.sql`` file here holds the queries of one owner (journal.sql: the
runtime's journal, ledger.sql: execution's ledger, sweeper.sql, admin.sql,
console.sql...), each under a ``-- name: <name>`` header; names are one
namespace across the files. Parameters are psycopg placeholders; nothing is
assembled from input."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import LiteralString, cast

_HEADER = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: LiteralString


@cache
def queries() -> dict[str, LiteralString]:
    """Every query of the ``*.sql`` files here by its ``-- name:`` header.

    Plain strings, not ``psycopg.sql`` objects: psycopg caches their parsing
    and prepares them after a few runs, so a journal write costs no more
    than a hand-written statement."""
    found: dict[str, LiteralString] = {}
    for entry in sorted(resources.files(__package__).iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".sql") and entry.is_file():
            found.update(parse(entry.read_text("utf-8")))
    return found


def parse(text: str) -> dict[str, LiteralString]:
    """The queries of one file's ``text`` by name."""
    parts = _HEADER.split(text)
    found: dict[str, LiteralString] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        # Read from the package's own files, never from input.
        found[name] = cast(LiteralString, body.strip().rstrip(";"))
    return found


def query(name: str) -> LiteralString:
    return queries()[name]


@cache
def migrations() -> tuple[Migration, ...]:
    """The migrations, ordered by version (``NNNN_name.sql``)."""
    folder = resources.files(__package__).joinpath("migrations")
    found = []
    for entry in folder.iterdir():
        match = re.fullmatch(r"(\d{4})_(\w+)\.sql", entry.name)
        if match:
            text: LiteralString = entry.read_text("utf-8")
            found.append(Migration(int(match[1]), match[2], text))
    found.sort(key=lambda m: m.version)
    return tuple(found)
