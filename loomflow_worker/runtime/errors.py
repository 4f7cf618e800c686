"""What the runtime raises, each with what went wrong and what to do, and the
one translation of the driver's errors (psycopg, its pool) into these."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg.conninfo import conninfo_to_dict


class LoomflowWorkerError(Exception):
    """Base of every error this package raises."""


class InvalidInput(LoomflowWorkerError, ValueError):
    """An argument was refused before anything was read or written."""


class DatabaseUnavailable(LoomflowWorkerError):
    """Postgres could not be reached or refused the connection."""


class SessionPooler(InvalidInput):
    """The database URL leads to a pooler in transaction or statement mode,
    whose connections are not one server session each."""


class SchemaError(LoomflowWorkerError):
    """The database schema is missing, or newer than this package."""


class QueryError(LoomflowWorkerError):
    """A query file of the package is malformed (a query with no description,
    a name defined twice), or code asked for a query no file defines."""


class SessionBusy(LoomflowWorkerError):
    """Another run holds the (session, user) scope.

    Raised when the scope's lock could not be taken within the wait the
    caller allowed (``lock_wait_timeout``)."""

    def __init__(self, scope: str, waited_s: float | None, *, detail: str | None = None) -> None:
        self.scope = scope
        self.waited_s = waited_s
        if detail is not None:
            super().__init__(f"session scope {scope!r} is busy: {detail}; retry later")
            return
        if waited_s is None or waited_s <= 0:
            detail = "and the run was not allowed to wait"
        else:
            detail = f"for longer than {waited_s:g}s"
        super().__init__(
            f"session scope {scope!r} is busy: another run on it is in progress {detail}; "
            "retry later, or raise lock_wait_timeout to wait longer"
        )


#: The SQLSTATE of a write the database refused because its attempt has ended
#: (``loomflow_worker_refuse``, migration 0034): the attempt is fenced.
FENCED_SQLSTATE = "LW001"


class LockLost(LoomflowWorkerError):
    """The run's lock connection failed, so the run no longer owns its scope.

    Once raised, the run is fenced: no further journal entry is written
    and it cannot finish. Run the request again to resume it from the
    journal; completed steps replay."""

    def __init__(self, scope: str, cause: str) -> None:
        self.scope = scope
        self.cause = cause
        super().__init__(
            f"lost the lock on session scope {scope!r} ({cause}); this attempt is fenced "
            "and wrote nothing more: run the request again to resume it from the journal"
        )


class OpenFailed(Exception):
    """A run's open query failed after its scope's lock was taken (within
    the store: the lock is freed and ``error`` raised)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class RunStopped(BaseException):
    """Raised at a run's next step boundary after it was asked to stop.

    A ``BaseException`` so that no ``except Exception`` (loomflow turns a
    tool's exceptions into error results) keeps the run going."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"the run was stopped at a step boundary: {reason}")


class Diverged(BaseException):
    """A resumed run reached a tool call whose position in its journal holds a
    completed call of other content (another tool or other arguments: the
    agent's code, its instructions or its model changed under the request).
    Raised before the call executes: a completed side effect never runs
    again under other content. A ``BaseException``, as :class:`RunStopped`:
    loomflow turns a tool's exceptions into error results."""

    def __init__(self, step: str, journaled: str, attempted: str) -> None:
        self.step = step
        self.journaled = journaled
        self.attempted = attempted
        # Its arguments as given: a copy of it (an exception group's) is made from them.
        super().__init__(step, journaled, attempted)

    def __str__(self) -> str:
        return (
            f"the run diverged from its journal at {self.step}: it completed {self.journaled} "
            f"there, and now calls {self.attempted}; nothing was executed. The agent changed "
            "under the request (its code, instructions or model): finish it on the code it "
            "started on"
        )


# ---- driver errors --------------------------------------------------------------------------

#: What :func:`translated` is told when the driver's error came from connecting.
CONNECT = "connect to"

# A quoted part of a libpq parse error: a piece of the connection string given,
# which may be its password.
_QUOTED = re.compile(r'"([^"]*)"')


def first_line(exc: BaseException) -> str:
    """The first line of an error's text (its type when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def describe_dsn(conninfo: str) -> str:
    """``host:port/dbname`` of a connection string, never its password.

    Whatever the string looks like: an unparsable one is not shown at all,
    a host or database name that took in part of an unescaped password (an
    ``@`` in it) is cut after its last ``@``, and the password, wherever it
    ended up, is masked."""
    try:
        parts = conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError:
        return "<unparsable connection string>"

    def shown(key: str) -> str:
        return str(parts.get(key) or "").rsplit("@", 1)[-1]

    host = shown("host") or shown("hostaddr") or "localhost (socket)"
    text = f"{host}:{shown('port') or 5432}/{shown('dbname') or shown('user')}"
    password = str(parts.get("password") or "")
    return text.replace(password, "***") if len(password) >= 3 else text


def masked_quotes(text: str) -> str:
    """``text`` with every quoted piece longer than a character masked: what
    libpq quotes of a connection string it can't parse may be its password."""
    return _QUOTED.sub(lambda m: m[0] if len(m[1]) <= 1 else '"***"', text)


def driver_error(
    exc: BaseException, doing: str, dsn: str | None = None, *, then: str = ""
) -> LoomflowWorkerError | None:
    """This package's error for the driver's ``exc``, met trying to ``doing``
    (``"connect to"``, ``"record the request in"``, ...) Postgres at ``dsn``;
    ``then`` says what it means for the caller (``"nothing was enqueued"``).
    ``None`` for an error that is not the driver's, or no sign of an
    unreachable server, a missing schema or a bad connection string (a
    failed statement, say).

    Every message names the server by :func:`describe_dsn`, so never its
    password."""
    where = f"Postgres at {describe_dsn(dsn)}" if dsn else "Postgres"
    tail = f"; {then}" if then else ""
    if isinstance(exc, psycopg.errors.UndefinedTable):
        return SchemaError(
            f"the loomflow-worker tables are missing in {where}: run `loomflow-worker migrate` "
            f"(or start a worker, which migrates) against this database{tail}"
        )
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        # A pool's PoolTimeout is an OperationalError.
        return DatabaseUnavailable(
            f"can't {doing} {where}: {first_line(exc)}{tail}; check that the server is running "
            "and LOOMFLOW_WORKER_DATABASE_URL is right"
        )
    if doing == CONNECT and isinstance(exc, psycopg.ProgrammingError):
        return InvalidInput(
            f"LOOMFLOW_WORKER_DATABASE_URL is not a valid connection string: "
            f"{masked_quotes(first_line(exc))}"
        )
    return None


@contextmanager
def translated(doing: str, dsn: str | None = None, *, then: str = "") -> Iterator[None]:
    """Driver errors raised inside as :func:`driver_error` has them, the cause kept."""
    try:
        yield
    except psycopg.Error as exc:
        ours = driver_error(exc, doing, dsn, then=then)
        if ours is None:
            raise
        raise ours from exc
