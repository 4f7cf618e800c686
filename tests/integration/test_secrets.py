"""No password or API key in the worker's logs, a run's events, its stored result, or
anything the CLI prints."""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import psycopg
import pytest
import redis
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from loomflow_worker.events import iter_events
from loomflow_worker.tasks import settings
from tests.needs import ADMIN_DSN

from .celery_harness import REDIS_URL, Fleet, wait_status
from .helpers import calls, cli, enqueued, lines, wait_for_execution, wait_until

pytestmark = pytest.mark.slow

class Secrets:
    def __init__(self, role: str, password: str, api_key: str, dsn: str) -> None:
        self.role = role
        self.password = password
        self.api_key = api_key
        self.dsn = dsn

    def assert_absent(self, what: str, text: str) -> None:
        assert text, f"{what}: nothing to look at"
        assert self.password not in text, f"{what} shows the database password"
        assert self.api_key not in text, f"{what} shows the API key"


@pytest.fixture
def secrets(fleet: Fleet) -> Iterator[Secrets]:
    """A Postgres role with a password, owning the fleet's database, and a worker
    environment that reaches Postgres through it with a fake Anthropic key."""
    role = f"lfw_secret_{uuid.uuid4().hex[:8]}"
    password = f"Pw{uuid.uuid4().hex}"
    api_key = f"sk-ant-api03-{uuid.uuid4().hex}{uuid.uuid4().hex}"
    parts = conninfo_to_dict(fleet.dsn)
    dbname = str(parts["dbname"])
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
            sql.Identifier(role), sql.Literal(password)))
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        for statement in (
            "GRANT ALL ON SCHEMA public TO {}",
            "GRANT ALL ON ALL TABLES IN SCHEMA public TO {}",
            "GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {}",
        ):
            conn.execute(sql.SQL(statement).format(sql.Identifier(role)))
    # The server trusts 127.0.0.1, so any password logs in; it is in the URL all the same.
    dsn = f"postgresql://{role}:{password}@{parts.get('host') or '127.0.0.1'}:" \
          f"{parts.get('port') or 5432}/{dbname}"
    fleet.env["LOOMFLOW_WORKER_DATABASE_URL"] = dsn
    fleet.env["ANTHROPIC_API_KEY"] = api_key
    try:
        yield Secrets(role, password, api_key, dsn)
    finally:
        fleet.stop_all()
        with psycopg.connect(fleet.dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def test_no_secret_in_logs_events_results_or_cli_output(
    fleet: Fleet, secrets: Secrets
) -> None:
    fleet.start("w1", concurrency=1, TEST_TOOL_SLEEP="2.0", TEST_FLAKY_FAILURES="100",
                LOOMFLOW_WORKER_MAX_RETRIES="0", LOOMFLOW_WORKER_HANDOFF_GRACE="0.5",
                LOOMFLOW_WORKER_SWEEP_INTERVAL="0.3")
    # The worker really connects as the role (its pool child, once started).
    def connected() -> int:
        with psycopg.connect(fleet.dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE usename = %s", (secrets.role,)
            ).fetchone()
        return int(row[0]) if row is not None else 0

    wait_until(connected, f"the worker connected as {secrets.role}", 30, every=0.1)

    outputs: list[tuple[str, str]] = []

    def run(*args: str, **env: str) -> str:
        done = cli(fleet, *args, **env)
        text = done.stdout + done.stderr
        outputs.append((" ".join(args), text))
        return done.stdout

    # A run that succeeds, one killed mid-tool and resumed, one that fails.
    waited = run("enqueue", calls("k1"), "--session", "s", "--wait")
    ok_id = lines(waited)[0]
    run("enqueue", calls("k2"), "--session", "s", "--wait", "--json")
    crashed = enqueued(fleet, calls("c1", "c2"), "c")
    _, pid, _, _ = wait_for_execution(fleet.dsn, "c2")
    os.kill(pid, signal.SIGKILL)
    wait_status(fleet.dsn, crashed, ("succeeded",))
    failed = run("enqueue", "flaky\n" + calls("f"), "--session", "f", "--agent", "flaky",
                 "--wait")
    failed_id = lines(failed)[0]
    assert wait_status(fleet.dsn, failed_id, ("failed",)) == "failed"

    # Every subcommand, and the error paths that name a connection: each a
    # process of its own, four at a time (none changes what another prints),
    # their outputs kept in this order.
    commands: list[tuple[tuple[str, ...], dict[str, str]]] = []

    def later(*args: str, **env: str) -> None:
        commands.append((args, env))

    for request_id in (ok_id, crashed, failed_id):
        later("show", request_id)
        later("show", request_id, "--json")
        later("tail", request_id)
        later("tail", request_id, "--json")
    later("runs")
    later("runs", "--json")
    later("cancel", ok_id)
    later("signal", "s", "hello", '{"a": 1}')
    later("doctor")
    later("doctor", "--json")
    later("migrate")
    later("show", str(uuid.uuid4()))
    bad_broker = f"redis://:{secrets.password}@127.0.0.1:1/0"
    later("doctor", LOOMFLOW_WORKER_BROKER_URL=bad_broker)
    down = secrets.dsn.replace(f":{conninfo_to_dict(fleet.dsn).get('port') or 5432}/", ":1/")
    assert secrets.password in down
    later("runs", LOOMFLOW_WORKER_DATABASE_URL=down, LOOMFLOW_WORKER_CONNECT_TIMEOUT="2")
    later("doctor", LOOMFLOW_WORKER_DATABASE_URL=down, LOOMFLOW_WORKER_CONNECT_TIMEOUT="2")
    later("enqueue", "p", "--session", "s", LOOMFLOW_WORKER_DATABASE_URL=down,
          LOOMFLOW_WORKER_CONNECT_TIMEOUT="2")
    later("enqueue", "p", "--session", "s2", "--wait", "--timeout", "30",
          LOOMFLOW_WORKER_BROKER_URL=bad_broker)
    bad_escape = secrets.dsn.replace(secrets.password, secrets.password + "%zz")
    later("runs", LOOMFLOW_WORKER_DATABASE_URL=bad_escape)
    later("doctor", LOOMFLOW_WORKER_DATABASE_URL=bad_escape)
    later("prune", "--older-than", "30d", "--yes")
    with ThreadPoolExecutor(4) as pool:
        done = pool.map(lambda command: cli(fleet, *command[0], **command[1]), commands)
        for (args, _), each in zip(commands, done, strict=True):
            outputs.append((" ".join(args), each.stdout + each.stderr))
    for command, text in outputs:
        secrets.assert_absent(f"`loomflow-worker {command}`", text)
    # The CLI did run against the password-protected database, and said what went wrong
    # when it could not.
    first: dict[str, str] = {}
    for command, text in outputs:
        first.setdefault(command, text)
        print(f"$ loomflow-worker {command}\n{text}")
    assert "succeeded" in first["runs"]
    assert first[f"show {ok_id}"].count("executed in attempt 1") >= 2
    assert "FAIL broker: redis://:***@127.0.0.1:1/0 unreachable" in first["doctor"] or any(
        "FAIL broker: redis://:***@127.0.0.1:1/0 unreachable" in text for _, text in outputs)
    assert any("invalid percent-encoded token" in text and '"***' in text
               for _, text in outputs)

    # The worker's logs (its log file and its stdout/stderr).
    fleet.stop_all()
    logs = "".join(p.read_text(errors="replace") for p in fleet.logs.glob("w1.*"))
    secrets.assert_absent("the worker's logs", logs)
    assert "ready." in logs

    # The events of every run, and every stored result and error.
    for request_id in (ok_id, crashed, failed_id):
        events = list(iter_events(request_id, settings=settings(), follow=False))
        assert events and events[-1].kind == "end"
        secrets.assert_absent(f"the events of {request_id}",
                              json.dumps([asdict(e) for e in events]))
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT request_id, result::text, error FROM runs").fetchall()
    assert len(rows) >= 4
    secrets.assert_absent("the runs ledger", json.dumps(rows))
    client = redis.Redis.from_url(REDIS_URL)
    try:
        stored = [
            client.get(key) or b""
            for key in client.scan_iter(match=f"{fleet.prefix}celery-task-meta-*")
        ]
    finally:
        client.close()
    assert stored
    secrets.assert_absent("the stored Celery results", b"".join(stored).decode(errors="replace"))

    # Four runs above, and the one enqueued while the broker was unreachable: accepted,
    # then published by the worker's sweeper.
    pruned = cli(fleet, "prune", "--older-than", "0s", "--yes")
    assert pruned.returncode == 0 and "5 finished requests" in pruned.stdout
    secrets.assert_absent("`loomflow-worker prune`", pruned.stdout + pruned.stderr)
