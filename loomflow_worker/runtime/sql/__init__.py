"""The package's SQL: named queries and versioned migrations, loaded once.

Each layer keeps its queries beside it, in its own ``sql/`` folder: this one
the runtime's (journal.sql, signals.sql, prune.sql, migrate.sql, and the
migrations; demo.sql and testing.sql, of the demo and the testing helpers,
modules with no folder of their own), ``execution/sql`` the ledger's,
``sweeper/sql`` the sweeper's, ``admin/sql`` the operator tools',
``console/sql`` the console's. Each
``*.sql`` file holds queries under a ``-- name: <name>`` header followed by a
comment saying what it does and why; names are one namespace across every
folder (a query is found by its name alone, wherever it lives). The folders
are found by that convention (``loomflow_worker/<layer>/sql/``): the runtime
imports none of the layers above it. Parameters are psycopg placeholders;
nothing is assembled from input."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import LiteralString

from ..errors import QueryError

_HEADER = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
# A line meant as a header that the pattern above does not read as one.
_MISSPELT = re.compile(r"^--\s*name\s*:.*$", re.MULTILINE)
# A comment line holding a percent sign or a brace is refused: it does not go to the
# server (see _as_sent), but a comment after a statement on its line does, where
# psycopg (and fastpath) would read the percent sign as a placeholder, psycopg.sql
# the brace as a field; one rule for every comment.
_UNSAFE_COMMENT = re.compile(r"^\s*--.*[%{}].*$", re.MULTILINE)


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: LiteralString


#: The package whose layers keep their queries in a ``sql/`` folder each.
ROOT = __name__.split(".")[0]


def folders() -> list[str]:
    """The layers that keep queries, as ``layer/sql`` paths inside the
    package (this one first): every ``loomflow_worker/<layer>/sql/`` folder
    holding a ``*.sql`` file."""
    root = resources.files(ROOT)
    found = []
    for layer in sorted(root.iterdir(), key=lambda entry: entry.name):
        folder = layer.joinpath("sql")
        if layer.is_dir() and folder.is_dir() and any(
                entry.name.endswith(".sql") for entry in folder.iterdir()):
            found.append(f"{layer.name}/sql")
    return sorted(found, key=lambda path: path != "runtime/sql")


def folder(path: str) -> list[tuple[str, str]]:
    """The ``*.sql`` files of one ``layer/sql`` folder of the package, as
    ``(layer/sql/file.sql, text)`` pairs ordered by name."""
    entries = sorted(resources.files(ROOT).joinpath(path).iterdir(),
                     key=lambda entry: entry.name)
    return [(f"{path}/{entry.name}", entry.read_text("utf-8"))
            for entry in entries if entry.name.endswith(".sql") and entry.is_file()]


@cache
def queries() -> dict[str, LiteralString]:
    """Every query of every layer's ``sql/*.sql`` files by its ``-- name:``
    header.

    Plain strings, not ``psycopg.sql`` objects: psycopg caches their parsing
    and prepares them after a few runs, so a journal write costs no more
    than a hand-written statement."""
    return gather(pair for path in folders() for pair in folder(path))


def query(name: str) -> LiteralString:
    try:
        return queries()[name]
    except KeyError:
        raise QueryError(
            f"no query is named {name!r} in loomflow_worker/*/sql/*.sql: check the "
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
        found[name] = _as_sent(name, body)
    return found


def _as_sent(name: str, body: str) -> LiteralString:
    """The query as it goes to the server: its name as its one comment (what
    ``pg_stat_statements`` and ``pg_stat_activity`` show first), then its
    statement without its comment lines. psycopg caches the parsing of a query
    of at most 4,096 characters only: ``insert_run`` with its comments (4,574)
    was parsed again at every enqueue, a tenth of its CPU."""
    code = "\n".join(line for line in body.strip().splitlines()
                     if not line.lstrip().startswith("--"))
    return f"-- {name}\n{code.strip().rstrip(';')}"


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
