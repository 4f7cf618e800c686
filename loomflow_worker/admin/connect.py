"""The fleet's database for operator tools: one connection (driver errors as
the runtime translates them), passwords kept out of whatever is shown."""

from __future__ import annotations

import re
from collections.abc import Sequence
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ..runtime.conns import SyncConn
from ..runtime.errors import CONNECT, translated
from ..settings import Settings

#: Query-string keys whose values are credentials (``?password=``, ``&token=``...).
CREDENTIAL_KEY = re.compile(
    r"pass|pwd|secret|token|auth|credential|(?:^|[_-])key$|apikey", re.IGNORECASE
)
# Up to the last "@" of each URL: a password may hold an unescaped "@".
_URL_PASSWORD = re.compile(r"(//[^:/@;?#]*:)[^;]*@")
# One query parameter of a URL: its key and its value (up to the next
# parameter, the next ";"-separated URL or the fragment).
_QUERY_PARAM = re.compile(r"([?&])([^=&;#]*)=([^&;#]*)")
# A password in a libpq keyword string, quoted (with \' and \\ escapes) or not.
_KEYWORD_PASSWORD = re.compile(r"(?:^|\s)password\s*=\s*('(?:[^'\\]|\\.)*'?|\S+)")


def sanitize_url(url: str) -> str:
    """A broker or backend URL (or several, ``;``-separated) for display: each
    password masked (and, when it held an unescaped "@", all up to the URL's
    last "@"), and each credential in a query string (``?password=``,
    ``&token=``: see :data:`CREDENTIAL_KEY`)."""
    masked = _URL_PASSWORD.sub(r"\1***@", url)
    return _QUERY_PARAM.sub(
        lambda m: f"{m[1]}{m[2]}=***" if CREDENTIAL_KEY.search(unquote(m[2])) else m[0], masked
    )


def secrets_of(settings: Settings) -> list[str]:
    """The passwords and other credentials in the settings' connection strings
    (to scrub from any text shown)."""
    found: list[str] = []
    urls = [settings.database_url, settings.broker_url, settings.result_backend]
    if settings.events_url is not None:
        urls.append(settings.events_url)
    for url in urls:
        for secret in url_secrets(url.get_secret_value()):
            if len(secret) >= 3 and secret not in found:
                found.append(secret)
    return found


def url_secrets(raw: str) -> list[str]:
    """The credentials of one connection string: of each ``;``-separated URL its
    password and its query string's credentials; of a libpq keyword string its
    password, however it is quoted."""
    if "://" not in raw:
        password = _keyword_password(raw)
        return [password] if password else []
    found: list[str] = []
    for part in raw.split(";"):
        try:
            split = urlsplit(part.strip())
            password = split.password
        except ValueError:
            continue
        if password:
            found.append(password)
        found += [value for key, value in parse_qsl(split.query)
                  if value and CREDENTIAL_KEY.search(key)]
    return found


def _keyword_password(raw: str) -> str | None:
    try:
        password = conninfo_to_dict(raw).get("password")
    except psycopg.ProgrammingError:
        # Not parsable (shown nowhere as given, but scrubbed all the same).
        match = _KEYWORD_PASSWORD.search(raw)
        password = _unquoted(match[1]) if match else None
    return str(password) if password else None


def _unquoted(value: str) -> str:
    if not value.startswith("'"):
        return value
    return re.sub(r"\\(.)", r"\1", value[1:].removesuffix("'"))


def redact(text: str, secrets: Sequence[str]) -> str:
    """``text`` with every secret (as given, URL-encoded or decoded, or quoted
    as in a libpq keyword string) replaced by ``***``."""
    for secret in secrets:
        quoted = secret.replace("\\", "\\\\").replace("'", "\\'")
        for form in sorted({secret, unquote(secret), quote(secret, safe=""), quoted},
                           key=len, reverse=True):
            if form:
                text = text.replace(form, "***")
    return text


# ---- connections ----------------------------------------------------------------------------


def connect(settings: Settings, *, application_name: str = "loomflow-worker admin") -> SyncConn:
    """An autocommit connection to the fleet's database, or :class:`DatabaseUnavailable`."""
    dsn = settings.database_url.get_secret_value()
    with translated(CONNECT, dsn):
        return psycopg.connect(
            dsn,
            autocommit=True,
            connect_timeout=settings.connect_timeout,
            application_name=application_name,
        )

