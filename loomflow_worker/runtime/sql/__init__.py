"""The package's SQL: named queries and versioned migrations, loaded once.

Each ``*.sql`` file here holds the queries of one owner (journal.sql: the
runtime's journal, ledger.sql: execution's ledger, sweeper.sql, admin.sql,
console.sql...), each under a ``-- name: <name>`` header followed by a
comment saying what it does and why; names are one namespace across the
files. Parameters are psycopg placeholders; nothing is assembled from input."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import LiteralString, cast

from ..errors import QueryError

_HEADER = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
# A line meant as a header that the pattern above does not read as one.
_MISSPELT = re.compile(r"^--\s*name\s*:.*$", re.MULTILINE)
# A comment goes to the server with its query: psycopg (and fastpath) would
# read a percent sign in it as a placeholder, psycopg.sql a brace as a field.
_UNSAFE_COMMENT = re.compile(r"^\s*--.*[%{}].*$", re.MULTILINE)


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
    files = sorted(resources.files(__package__).iterdir(), key=lambda entry: entry.name)
    return gather(
        (entry.name, entry.read_text("utf-8"))
        for entry in files if entry.name.endswith(".sql") and entry.is_file()
    )


def query(name: str) -> LiteralString:
    try:
        return queries()[name]
    except KeyError:
        raise QueryError(
            f"no query is named {name!r} in loomflow_worker/runtime/sql/*.sql: check the "
            "name against the files' '-- name:' headers"
        ) from None


def gather(files: Iterable[tuple[str, str]]) -> dict[str, LiteralString]:
    """The queries of ``(file name, text)`` pairs by name; a name that two
    files define is refused (:class:`QueryError`)."""
    found: dict[str, LiteralString] = {}
    where: dict[str, str] = {}
    for source, text in files:
        for name, sql in parse(text, source).items():
            if name in where:
                raise QueryError(
                    f"query {name!r} is defined in both {where[name]} and {source}: query "
                    "names are one namespace across the files; rename one, and its callers"
                )
            where[name] = source
            found[name] = sql
    return found


def parse(text: str, source: str = "<text>") -> dict[str, LiteralString]:
    """The queries of one file's ``text`` by name (``source`` names the file
    in errors). Refused (:class:`QueryError`): a query without a description,
    or without a statement, a name defined twice, a misspelt header, a
    statement before the first header (it would belong to no name), a
    comment holding ``%`` or a brace."""
    misspelt = [line for line in _MISSPELT.findall(text) if not _HEADER.fullmatch(line)]
    if misspelt:
        raise QueryError(f"{source}: {misspelt[0]!r} is not a header: write '-- name: <name>'")
    parts = _HEADER.split(text)
    if _statement(parts[0]):
        raise QueryError(
            f"{source}: SQL before the first '-- name:' header belongs to no query: "
            "put a header above it"
        )
    found: dict[str, LiteralString] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in found:
            raise QueryError(f"{source}: query {name!r} is defined twice: rename one")
        _check(name, body, source)
        # Read from the package's own files, never from input.
        found[name] = cast(LiteralString, body.strip().rstrip(";"))
    return found


def _check(name: str, body: str, source: str) -> None:
    first = body.strip().partition("\n")[0]
    if not (first.startswith("-- ") and first[3:].strip()):
        raise QueryError(
            f"{source}: query {name!r} has no description: under its '-- name: {name}' "
            "header, write a comment saying what it does and why (what it returns, the "
            "index it relies on, why it is shaped so)"
        )
    if not _statement(body):
        raise QueryError(f"{source}: query {name!r} has a description but no statement")
    unsafe = _UNSAFE_COMMENT.search(body)
    if unsafe:
        raise QueryError(
            f"{source}: a comment of query {name!r} holds '%' or a brace "
            f"({unsafe[0].strip()!r}), which would be read as a placeholder: reword it"
        )


def _statement(text: str) -> bool:
    """Whether ``text`` holds a line of SQL, not only comments and blanks."""
    return any(line.strip() and not line.lstrip().startswith("--") for line in text.splitlines())


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
