"""The fleet's database for operator tools: one connection (driver errors as
the runtime translates them), passwords kept out of whatever is shown."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import psycopg

from ..runtime.errors import CONNECT, translated
from ..settings import Settings

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
    with translated(CONNECT, dsn):
        return psycopg.connect(
            dsn,
            autocommit=True,
            connect_timeout=settings.connect_timeout,
            application_name=application_name,
        )

