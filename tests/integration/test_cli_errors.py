"""A user's mistakes at the ``loomflow-worker`` command get a one-line error and
an exit code, never a traceback or a password; prune measures ages on the
database's clock."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from click.testing import CliRunner

from loomflow_worker import cli as cli_module
from loomflow_worker.runtime import prune

from .celery_harness import Fleet
from .helpers import cli

PASSWORD = "S3cret"
# Each is a connection string libpq can't use as given; the password must not show.
BAD_DSNS = [
    f"postgresql://u:{PASSWORD}%zzPW@127.0.0.1:1/db",  # an invalid percent-escape
    f"postgresql://u:{PASSWORD}@x@127.0.0.1:1/db",  # an unescaped "@"
    f"postgresql://u:{PASSWORD}@127.0.0.1:1/db%zz",  # an invalid escape after it
    f"host=127.0.0.1 port=1 password={PASSWORD}x dbname",  # key=value, broken
]
COMMANDS = [
    ("migrate",),
    ("runs",),
    ("enqueue", "p", "--session", "s"),
    ("prune", "--older-than", "1d", "--yes"),
]


def _one_line_error(done: object, code: int) -> str:
    assert isinstance(done, __import__("subprocess").CompletedProcess)
    text = done.stdout + done.stderr
    assert done.returncode == code, text
    assert "Traceback" not in text, text
    errors = [line for line in done.stderr.splitlines() if line.startswith(("error:", "Error:"))]
    assert len(errors) == 1, done.stderr
    return errors[0]


@pytest.mark.slow
@pytest.mark.parametrize("bad_dsn", BAD_DSNS)
def test_no_password_in_any_output_whatever_the_connection_string(
    fleet: Fleet, bad_dsn: str
) -> None:
    for command in COMMANDS:
        done = cli(fleet, *command, LOOMFLOW_WORKER_DATABASE_URL=bad_dsn)
        error = _one_line_error(done, 2)
        assert "LOOMFLOW_WORKER_* settings: database_url" in error
        assert PASSWORD not in done.stdout + done.stderr, (command, done.stderr)
    doctor = cli(fleet, "doctor", LOOMFLOW_WORKER_DATABASE_URL=bad_dsn)
    assert doctor.returncode == 1 and "FAIL settings: database_url" in doctor.stdout
    assert PASSWORD not in doctor.stdout + doctor.stderr


@pytest.mark.slow
def test_doctor_shows_no_password_given_in_a_query_string_or_quoted(fleet: Fleet) -> None:
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    redis_url = "redis://127.0.0.1:6379/0?db=0&password=" + PASSWORD + "Qs"
    parts = {k: str(v) for k, v in conninfo_to_dict(fleet.dsn).items() if k != "password"}
    keyword_dsn = make_conninfo("", **parts, password=f"a b '{PASSWORD}'")
    assert f"'{PASSWORD}'" not in keyword_dsn and " " in keyword_dsn  # quoted, escaped
    for variable in ("LOOMFLOW_WORKER_RESULT_BACKEND", "LOOMFLOW_WORKER_EVENTS_URL"):
        env = {variable: redis_url, "LOOMFLOW_WORKER_DATABASE_URL": keyword_dsn}
        done = cli(fleet, "doctor", "--json", **env)
        text = done.stdout + done.stderr
        assert "redis://127.0.0.1:6379/0?db=0&password=***" in text, text
        assert PASSWORD not in text, text


@pytest.mark.slow
def test_a_worker_refuses_a_connection_string_it_cannot_use_and_shows_no_password(
    fleet: Fleet,
) -> None:
    fleet.env["LOOMFLOW_WORKER_DATABASE_URL"] = BAD_DSNS[0]
    with pytest.raises(RuntimeError, match="exited at start") as info:
        fleet.start("w1", concurrency=1)
    assert "invalid percent-encoded token" in str(info.value)
    assert "the worker does not start" in str(info.value)
    logs = "".join(p.read_text(errors="replace") for p in fleet.logs.glob("w1.*"))
    assert PASSWORD not in logs + str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "env", "code", "says"),
    [
        (("prune", "--older-than", "9999999d", "--yes"), {}, 2, "longest duration accepted"),
        (("runs", "--older-than", "99999999999999999999d"), {}, 2, "longest duration"),
        (("runs", "--limit", "1e23"), {}, 2, "--limit"),
        (("runs", "--limit", "100000000000000000000000"), {}, 2, "1000000"),
        (("enqueue", "p", "--session", "s"), {"LOOMFLOW_WORKER_BROKER_URL": "foo://x"}, 2,
         "unknown broker transport 'foo'"),
        (("enqueue", "p", "--session", "s"), {"LOOMFLOW_WORKER_BROKER_URL": "localhost"}, 2,
         "not a broker URL"),
        (("enqueue", "p", "--session", "s"), {"LOOMFLOW_WORKER_RESULT_BACKEND": "foo://x"}, 2,
         "unknown result backend 'foo'"),
        (("runs",), {"LOOMFLOW_WORKER_BROKER_TRANSPORT_OPTIONS": "{bad"}, 2,
         'field "broker_transport_options"'),
        # Arguments that are not UTF-8 (they reach Python as lone surrogates).
        (("show", "\udcff"), {}, 2, "request_id contains an unpaired surrogate"),
        (("runs", "--session", "r\udcff"), {}, 2, "session_id contains an unpaired surrogate"),
    ],
)
def test_a_mistake_gets_one_line_and_an_exit_code(
    fleet: Fleet, args: tuple[str, ...], env: dict[str, str], code: int, says: str
) -> None:
    done = cli(fleet, *args, **env)
    assert says in _one_line_error(done, code)
    assert cli(fleet, "runs", "--json").stdout == ""  # nothing was written


@pytest.mark.slow
def test_doctor_reports_transport_options_that_are_not_json(fleet: Fleet) -> None:
    done = cli(fleet, "doctor", LOOMFLOW_WORKER_BROKER_TRANSPORT_OPTIONS="{bad")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.startswith('FAIL settings: error parsing value for field '
                                  '"broker_transport_options"'), done.stdout


@contextlib.contextmanager
def refusing_server(code: str, message: str) -> Iterator[int]:
    """A server that speaks just enough of the Postgres protocol to refuse every
    login with ``code`` (a SQLSTATE) and ``message``, as a server refuses a wrong
    password; yields its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def refuse(conn: socket.socket) -> None:
        with conn:
            while True:
                header = conn.recv(8, socket.MSG_WAITALL)
                if len(header) < 8:
                    return
                length, version = struct.unpack("!ii", header)
                if version in (80877103, 80877104):  # SSL or GSS encryption asked: no
                    conn.sendall(b"N")
                    continue
                conn.recv(length - 8, socket.MSG_WAITALL)
                fields = b"".join(kind + text.encode() + b"\0" for kind, text in (
                    (b"S", "FATAL"), (b"V", "FATAL"), (b"C", code), (b"M", message)))
                body = fields + b"\0"
                conn.sendall(b"E" + struct.pack("!i", len(body) + 4) + body)
                return

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=refuse, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        stop.set()
        thread.join()
        listener.close()


@pytest.mark.slow
def test_enqueue_with_a_wrong_password_says_the_login_failed_at_once(fleet: Fleet) -> None:
    refused = 'password authentication failed for user "app"'
    with refusing_server("28P01", refused) as port:
        started = time.monotonic()
        done = cli(fleet, "enqueue", "p", "--session", "s",
                   LOOMFLOW_WORKER_DATABASE_URL=f"postgresql://app:{PASSWORD}@127.0.0.1:{port}/db",
                   LOOMFLOW_WORKER_CONNECT_TIMEOUT="10")
        took = time.monotonic() - started
    error = _one_line_error(done, 3)
    assert refused in error and f"127.0.0.1:{port}/db" in error, error
    assert PASSWORD not in done.stdout + done.stderr
    assert took < 8, f"took {took:.1f}s: the pool waited for its connect timeout"


# ---- prune on the database's clock ----------------------------------------------------------


def _finished(conn: psycopg.Connection[object], request_id: str, ago: timedelta) -> None:
    conn.execute(
        "INSERT INTO runs (request_id, scope, session_id, agent, prompt, status, enqueued_at,"
        " finished_at) VALUES (%s, %s, 's', 'default', 'p', 'succeeded', now() - %s,"
        " now() - %s)",
        (request_id, f"scope-{request_id}", ago + timedelta(seconds=1), ago),
    )


def test_prune_measures_ages_on_the_database_clock_not_the_callers(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        _finished(conn, "a-minute-ago", timedelta(minutes=1))
        _finished(conn, "two-days-ago", timedelta(days=2))

    class FastClock(datetime):
        """The caller's clock, two days fast."""

        @classmethod
        def now(cls, tz: object = None) -> FastClock:
            real = datetime.now(UTC) + timedelta(days=2)
            return cls.fromtimestamp(real.timestamp(), tz=tz)  # type: ignore[arg-type]

    for module in (cli_module, prune):
        monkeypatch.setattr(module, "datetime", FastClock)
    done = CliRunner().invoke(
        cli_module.main, ["prune", "--older-than", "1d", "--yes"],
        env={"LOOMFLOW_WORKER_DATABASE_URL": dsn},
    )
    assert done.exit_code == 0, done.output
    with psycopg.connect(dsn, autocommit=True) as conn:
        left = [r[0] for r in conn.execute("SELECT request_id FROM runs")]
    assert left == ["a-minute-ago"]


def test_the_prune_cutoff_is_the_database_now(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:  # one transaction: one now()
        cutoff = prune.cutoff(conn, timedelta(days=1, seconds=30))
        row = conn.execute("SELECT now() - interval '1 day 30 seconds'").fetchone()
    assert row is not None and cutoff == row[0]
