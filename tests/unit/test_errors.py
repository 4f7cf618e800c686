"""Errors: a failure stored in the result backend decodes to its class, under
the module it names now and under the modules earlier versions named; driver
errors become this package's errors by one translation (no services)."""

from __future__ import annotations

import psycopg
import pytest
from celery import Celery
from celery.backends.base import Backend
from psycopg_pool import PoolTimeout

import loomflow_worker.tasks  # noqa: F401  (what a caller reading a result imports)
from loomflow_worker.execution import request_errors as errors
from loomflow_worker.runtime.errors import (
    CONNECT,
    DatabaseUnavailable,
    InvalidInput,
    SchemaError,
    driver_error,
    translated,
)

ENDINGS = [errors.RunFailed, errors.RunDead, errors.RunCancelled]


@pytest.fixture
def backend() -> Backend:
    # The base of every Celery result backend: the JSON encoding of a failure
    # (``prepare_exception``) and its decoding (``exception_to_python``).
    return Backend(app=Celery(set_as_current=False), serializer="json")


@pytest.mark.parametrize("cls", ENDINGS)
def test_a_stored_failure_names_the_errors_module_and_decodes_to_its_class(
    backend: Backend, cls: type[Exception]
) -> None:
    stored = backend.prepare_exception(cls("the agent raised ValueError"))
    assert stored["exc_module"] == "loomflow_worker.execution.request_errors"
    decoded = backend.exception_to_python(stored)
    assert type(decoded) is cls
    assert str(decoded) == "the agent raised ValueError"


@pytest.mark.parametrize("module", ["loomflow_worker.execution.execute",
                                    "loomflow_worker.execution.errors",
                                    "loomflow_worker.tasks.execute"])
@pytest.mark.parametrize("cls", ENDINGS)
def test_a_failure_stored_by_an_earlier_version_decodes_to_the_same_class(
    backend: Backend, module: str, cls: type[Exception]
) -> None:
    stored = {"exc_type": cls.__qualname__, "exc_module": module, "exc_message": ["boom"]}
    decoded = backend.exception_to_python(stored)
    assert type(decoded) is cls
    assert str(decoded) == "boom"


DSN = "postgresql://app:s3cret-pw@db.example:5433/fleet"


@pytest.mark.parametrize(
    ("raised", "ours"),
    [
        (psycopg.OperationalError("connection refused"), DatabaseUnavailable),
        (psycopg.InterfaceError("the connection is closed"), DatabaseUnavailable),
        (PoolTimeout("couldn't get a connection after 5.00 sec"), DatabaseUnavailable),
        (psycopg.errors.UndefinedTable('relation "runs" does not exist'), SchemaError),
    ],
)
def test_driver_errors_become_ours_naming_the_server_never_its_password(
    raised: Exception, ours: type[Exception]
) -> None:
    translated_error = driver_error(raised, "record the request in", DSN,
                                    then="nothing was enqueued")
    assert type(translated_error) is ours
    text = str(translated_error)
    assert "db.example:5433/fleet" in text and "nothing was enqueued" in text
    assert "s3cret-pw" not in text


def test_a_connection_string_libpq_refuses_is_bad_input_with_its_quotes_masked() -> None:
    refused = psycopg.ProgrammingError('invalid connection option "s3cret-pw"')
    found = driver_error(refused, CONNECT, DSN)
    assert isinstance(found, InvalidInput)
    assert "s3cret-pw" not in str(found) and "invalid connection option" in str(found)
    # A failed statement is no connection string: it is not translated.
    assert driver_error(psycopg.errors.SyntaxError("syntax error"), "query", DSN) is None


def test_translated_keeps_the_cause_and_lets_other_errors_through() -> None:
    cause = psycopg.OperationalError("server closed the connection unexpectedly")
    with pytest.raises(DatabaseUnavailable) as info, translated("query", DSN):
        raise cause
    assert info.value.__cause__ is cause
    assert "can't query Postgres at db.example:5433/fleet: server closed" in str(info.value)
    with pytest.raises(KeyError), translated("query", DSN):
        raise KeyError("not a driver's")
    # A wait that ran out (``enqueue --wait``) is no unreachable server.
    with pytest.raises(TimeoutError), translated("query", DSN):
        raise TimeoutError("still queued after 1s")
