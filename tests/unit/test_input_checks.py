"""Checks on what a user gives: text Postgres can store, JSON metadata, connection
strings and broker URLs shown or refused without their passwords, durations."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pydantic import SecretStr, ValidationError

from loomflow_worker.admin import MAX_DURATION, parse_duration, validation_message
from loomflow_worker.runtime import InvalidInput
from loomflow_worker.runtime.errors import describe_dsn
from loomflow_worker.runtime.validate import check_id, check_json_text, check_text
from loomflow_worker.settings import (
    COMMON_BACKENDS,
    COMMON_TRANSPORTS,
    Settings,
    broker_problem,
    conninfo_problem,
    result_backend_problem,
)

PASSWORD = "Pw-s3cret"


@pytest.mark.parametrize(
    ("dsn", "shown"),
    [
        (f"postgresql://u:{PASSWORD}@db.internal:6432/app", "db.internal:6432/app"),
        (f"postgresql://u:{PASSWORD}@x@db/app", "db:5432/app"),  # an unescaped "@"
        (f"postgresql://u:{PASSWORD}%zz@db/app", "<unparsable connection string>"),
        (f"host=db password={PASSWORD} dbname=app", "db:5432/app"),
        (f"postgresql://u@db/app?password={PASSWORD}", "db:5432/app"),
        (f"postgresql://u:{PASSWORD}@/{PASSWORD}?host=/tmp", "/tmp:5432/***"),
        (f"postgresql://u:{PASSWORD}@h1:1,h2:2/app", "h1,h2:1,2/app"),
    ],
)
def test_describe_dsn_never_shows_the_password(dsn: str, shown: str) -> None:
    assert describe_dsn(dsn) == shown


@pytest.mark.parametrize(
    "dsn",
    [
        f"postgresql://u:{PASSWORD}%zz@db/app",
        f"postgresql://u:{PASSWORD}@x@db/app",
        f"postgres://u:{PASSWORD}@db/app%zz",
        f"u:{PASSWORD}@db/app",
    ],
)
def test_a_connection_string_libpq_cannot_use_is_refused_without_its_password(dsn: str) -> None:
    problem = conninfo_problem(dsn)
    assert problem and PASSWORD not in problem
    with pytest.raises(ValidationError) as info:
        Settings(database_url=SecretStr(dsn))
    message = validation_message(info.value)
    assert message.startswith("database_url: Value error, not a connection string libpq")
    assert PASSWORD not in message + str(info.value)


def test_usable_connection_strings_pass() -> None:
    for dsn in ("postgresql://u:p%40ss@db/app", "host=db dbname=app", "postgresql:///app",
                "postgresql://u@db/app?application_name=a@b"):
        assert conninfo_problem(dsn) is None, dsn


def test_broker_urls_need_a_transport_kombu_has() -> None:
    for url in ("redis://h:6379/0", "rediss://h/0", "amqp://g:g@h//", "sqla+postgresql://h/d",
                "redis://a:1/0;redis://b:1/0", "memory://"):
        assert broker_problem(url) is None, url
    assert "unknown broker transport 'foo'" in str(broker_problem("foo://h"))
    assert "unknown broker transport 'kafkaa'" in str(broker_problem("redis://a;kafkaa://b"))
    assert "not a broker URL" in str(broker_problem(f"{PASSWORD}@h"))
    assert PASSWORD not in str(broker_problem(f"x y://{PASSWORD}@h"))


def test_the_schemes_accepted_without_asking_kombu_or_celery_are_theirs() -> None:
    from celery.app.backends import BACKEND_ALIASES
    from kombu.transport import TRANSPORT_ALIASES

    assert COMMON_TRANSPORTS.issubset(TRANSPORT_ALIASES)
    assert COMMON_BACKENDS.issubset(BACKEND_ALIASES)


def test_result_backends_need_a_backend_celery_has() -> None:
    for url in ("redis://h:6379/1", "rediss://h/1", "rpc://", "db+postgresql://h/d",
                "myapp.backends:Custom://h", "cache+memcached://h/"):
        assert result_backend_problem(url) is None, url
    assert "unknown result backend 'foo'" in str(result_backend_problem("foo://h"))
    assert PASSWORD not in str(result_backend_problem(f"x y://{PASSWORD}@h"))
    with pytest.raises(ValidationError, match="result_backend"):
        Settings(result_backend=SecretStr("foo://h"))


def test_text_postgres_cannot_store_is_refused_with_where_it_is() -> None:
    assert check_text("prompt", "C:\\u0000dir é ✓ 😀") == "C:\\u0000dir é ✓ 😀"
    with pytest.raises(InvalidInput, match=r"prompt contains a NUL character at position 2"):
        check_text("prompt", "ab\x00")
    with pytest.raises(InvalidInput, match=r"unpaired surrogate \('\\udc80'\) at position 1"):
        check_text("prompt", "a\udc80")


def test_an_id_is_bounded_in_characters_and_in_bytes() -> None:
    assert check_id("session_id", "s" * 512) == "s" * 512
    assert check_id("session_id", "é" * 512) == "é" * 512  # 1,024 bytes
    with pytest.raises(InvalidInput, match="session_id is 513 characters long; the limit is 512"):
        check_id("session_id", "s" * 513)
    # 512 emoji: 2,048 bytes, more than a B-tree entry of two of them can hold.
    with pytest.raises(InvalidInput, match="user_id is 2048 bytes as UTF-8; the limit is 1024"):
        check_id("user_id", "\U0001f600" * 512)


def test_json_text_is_walked_without_recursion() -> None:
    check_json_text("metadata", {"path": "C:\\u0000dir", "n": [1, 2.5, None, True, {"k": "v"}]})
    with pytest.raises(InvalidInput, match=r"metadata\['a'\]\[0\]\['b'\] contains a NUL"):
        check_json_text("metadata", {"a": [{"b": "\x00"}]})
    deep: object = "leaf"
    for _ in range(200_000):
        deep = [deep]
    with pytest.raises(InvalidInput, match="nests deeper than 64 levels"):
        check_json_text("metadata", deep)
    at_limit: object = {}
    for _ in range(63):
        at_limit = {"a": at_limit}
    check_json_text("metadata", at_limit)


def test_durations_longer_than_a_thousand_years_are_refused() -> None:
    assert parse_duration("365000d") == MAX_DURATION
    for text in ("365001d", "9999999d", "999999999999999999999d", "99999999999999h"):
        with pytest.raises(InvalidInput, match="longest duration accepted"):
            parse_duration(text)
    assert parse_duration("1d12h") == timedelta(days=1, hours=12)


@pytest.mark.parametrize(
    ("countdown", "eta", "says"),
    [("ten", None, "countdown must be a number"), (True, None, "countdown must be a number"),
     (float("inf"), None, "countdown must be a number"), (1e300, None, "up to"),
     (None, "soon", "not an ISO 8601"), (None, 12, "eta must be a datetime"),
     (None, "9999-01-01T00:00:00", "ten years")],
)
def test_a_countdown_or_eta_celery_cannot_use_is_refused(
    countdown: object, eta: object, says: str
) -> None:
    from loomflow_worker.tasks.eta import start_at

    with pytest.raises(InvalidInput, match=says):
        start_at(countdown, eta)


def test_a_start_time_is_read_as_celery_reads_it() -> None:
    from datetime import UTC, datetime

    from loomflow_worker.execution.ledger import StartAt
    from loomflow_worker.tasks.eta import start_at

    assert start_at(None, None) is None
    assert start_at(0, None) is None and start_at(-5, None) is None  # at once
    assert start_at(2.5, datetime(2020, 1, 1, tzinfo=UTC)) == StartAt(countdown=2.5)
    soon = datetime.now(UTC).replace(microsecond=0) + timedelta(minutes=5)
    naive = soon.replace(tzinfo=None)  # a naive eta is in the app's timezone (UTC)
    assert start_at(None, naive) == StartAt(eta=soon)
    assert start_at(None, soon.isoformat()) == StartAt(eta=soon)


@pytest.mark.parametrize("epoch", [-1, 2**31, 10**12, True, 1.5, "3"])
def test_an_epoch_postgres_cannot_store_is_refused_by_run_options(epoch: object) -> None:
    from loomflow_worker.runtime import run_options

    with (pytest.raises(InvalidInput, match=r"epoch must be an integer from 0 to 2147483647"),
          run_options(epoch=epoch)):  # type: ignore[arg-type]
        pass


def test_the_largest_epoch_postgres_stores_is_accepted() -> None:
    from loomflow_worker.runtime import run_options

    with run_options(epoch=2**31 - 1):
        pass
