"""The fleet's database for operator tools: one connection, driver errors as
this package's, passwords kept out of whatever is shown."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import psycopg

from ..runtime.errors import DatabaseUnavailable, InvalidInput, SchemaError
from ..runtime.store import describe_dsn
from ..settings import Settings, first_line

Conn = psycopg.Connection[Any]


def secrets_of(settings: Settings) -> list[str]:
    """The passwords in the settings' connection strings (to scrub from any text shown)."""
    found: list[str] = []
    urls = [settings.database_url, settings.broker_url, settings.result_backend]
    if settings.events_url is not None:
        urls.append(settings.events_url)
    for url in urls:
        raw = url.get_secret_value()
        try:
            password = urlsplit(raw).password
        except ValueError:
            password = None
        if not password:
            match = re.search(r"(?:^|\s)password\s*=\s*'?([^'\s]+)", raw)
            password = match[1] if match else None
        if password and len(password) >= 3:
            found.append(password)
    return found


def redact(text: str, secrets: Sequence[str]) -> str:
    """``text`` with every secret (and its URL-encoded form) replaced by ``***``."""
    for secret in secrets:
        for form in {secret, unquote(secret), quote(secret, safe="")}:
            if form:
                text = text.replace(form, "***")
    return text


# ---- connections ----------------------------------------------------------------------------


def connect(settings: Settings, *, application_name: str = "loomflow-worker admin") -> Conn:
    """An autocommit connection to the fleet's database, or :class:`DatabaseUnavailable`."""
    dsn = settings.database_url.get_secret_value()
    try:
        return psycopg.connect(
            dsn,
            autocommit=True,
            connect_timeout=settings.connect_timeout,
            application_name=application_name,
        )
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(
            f"can't connect to Postgres at {describe_dsn(dsn)}: {first_line(exc)}; check "
            "that the server is running and LOOMFLOW_WORKER_DATABASE_URL is right"
        ) from exc
    except psycopg.ProgrammingError as exc:
        # libpq quotes the offending part, which may be the password.
        reason = redact(first_line(exc), secrets_of(settings))
        raise InvalidInput(
            f"LOOMFLOW_WORKER_DATABASE_URL is not a valid connection string: {reason}"
        ) from exc


@contextmanager
def translated(dsn_hint: str = "") -> Iterator[None]:
    """Driver errors of admin queries as this package's errors, the cause kept."""
    try:
        yield
    except psycopg.errors.UndefinedTable as exc:
        raise SchemaError(
            "the loomflow-worker tables are missing: run `loomflow-worker migrate` against "
            f"this database{dsn_hint}"
        ) from exc
    except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
        raise DatabaseUnavailable(
            f"lost the connection to Postgres{dsn_hint}: {first_line(exc)}"
        ) from exc
