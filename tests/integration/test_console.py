"""The run console without a browser: who may look, who may cancel, what a page
shows of a prompt, bad filters, the command's refusals, and the list query's
plan on a ledger of many requests (real Postgres, the real cancel_run)."""

from __future__ import annotations

import html
import logging
import re
import socket
import time
from collections.abc import Iterator

import httpx
import psycopg
import pytest
from pydantic import SecretStr
from starlette.testclient import TestClient

from loomflow_worker.console import BackgroundConsole, create_app
from loomflow_worker.runtime.errors import InvalidInput
from loomflow_worker.runtime.sql import query
from loomflow_worker.settings import Settings
from loomflow_worker.tasks import run_agent, settings, sweeper

from .celery_harness import Fleet, ledger
from .helpers import calls
from .test_celery import _wait_for_execution
from .test_cli import cli

TOKEN = "console-token-" + "x" * 20
END = "zebra-at-the-end"
OUTSIDE = ("203.0.113.5", 50000)


def _settings(fleet: Fleet, token: str | None = TOKEN) -> Settings:
    """The fleet's settings (its database, Redis and prefix), with ``token``."""
    return settings().model_copy(
        update={"console_token": SecretStr(token) if token else None})


@pytest.fixture
def queued(fleet: Fleet) -> str:
    """A request in the ledger, queued (no worker runs), with a long prompt."""
    prompt = calls("q1") + "\nMind the weather and the trains. " * 20 + END
    return str(run_agent.delay(prompt, "console-s", user_id="ana").id)


@pytest.fixture
def client(fleet: Fleet) -> Iterator[TestClient]:
    with TestClient(create_app(_settings(fleet)), client=("127.0.0.1", 40000)) as local:
        yield local


def test_the_token_is_required_off_loopback_and_not_on_it(fleet: Fleet, queued: str) -> None:
    app = create_app(_settings(fleet))
    with TestClient(app, client=OUTSIDE, follow_redirects=False) as outside:
        for path in ("/requests", f"/runs/{queued}", "/fleet", "/sessions/console-s",
                     f"/runs/{queued}/events"):
            denied = outside.get(path)
            assert denied.status_code == 401, path
            assert "Mind the weather" not in denied.text and "queued" not in denied.text
        assert outside.get("/requests", headers={"Authorization": "Bearer wrong"}
                           ).status_code == 401
        bearer = outside.get("/requests", headers={"Authorization": f"Bearer {TOKEN}"})
        assert bearer.status_code == 200 and queued[:8] in bearer.text
        # The login form sets a cookie that holds a digest, not the token.
        assert outside.post("/login", data={"token": "nope", "next": "/fleet"}
                            ).status_code == 401
        login = outside.post("/login", data={"token": TOKEN, "next": "https://evil.example/"})
        assert login.status_code == 303 and login.headers["location"] == "/requests"
        cookie = login.cookies["lfw_console"]
        assert TOKEN not in cookie
        assert outside.get("/fleet").status_code == 200
        outside.cookies.clear()
        outside.cookies.set("lfw_console", cookie[:-1] + ("1" if cookie[-1] == "0" else "0"))
        assert outside.get("/fleet").status_code == 401
        outside.cookies.clear()
    with TestClient(app, client=("127.0.0.1", 40000)) as local:
        assert local.get("/requests").status_code == 200
        # Through a proxy on this host, a client is not local.
        assert local.get("/requests", headers={"X-Forwarded-For": "198.51.100.7"}
                         ).status_code == 401
    # Without a token, only loopback may look.
    with TestClient(create_app(_settings(fleet, None)), client=OUTSIDE) as outside:
        closed = outside.get("/requests", headers={"Authorization": f"Bearer {TOKEN}"})
        assert closed.status_code == 403 and "loopback" in closed.text


def _outside_address() -> str:
    """An address of this machine that is not loopback (the one its default route uses)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))
        address = str(probe.getsockname()[0])
    assert not address.startswith("127."), "this machine has no address off loopback"
    return address


def test_a_console_bound_off_loopback_wants_the_token_over_a_real_socket(fleet: Fleet) -> None:
    address = _outside_address()
    with pytest.raises(InvalidInput, match=r"not a loopback address.*CONSOLE_TOKEN"):
        BackgroundConsole(_settings(fleet, None), host=address)
    with BackgroundConsole(_settings(fleet), host=address) as console:
        assert console.url.startswith(f"http://{address}:")
        assert httpx.get(f"{console.url}/requests").status_code == 401
        assert httpx.get(f"{console.url}/requests",
                         headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_cancel_takes_the_token_always_and_only_by_post(
    fleet: Fleet, queued: str, client: TestClient
) -> None:
    path = f"/runs/{queued}/cancel"
    assert client.get(path).status_code == 405
    assert client.post(path).status_code == 403
    assert client.post(path, data={"token": "wrong"}).status_code == 403
    assert ledger(fleet.dsn, queued)["status"] == "queued"
    # A cross-site form posts the login cookie, never the token: refused.
    client.post("/login", data={"token": TOKEN}, follow_redirects=False)
    assert "lfw_console" in client.cookies
    assert client.post(path).status_code == 403
    assert ledger(fleet.dsn, queued)["status"] == "queued"
    done = client.post(path, data={"token": TOKEN}, follow_redirects=False)
    assert done.status_code == 303 and done.headers["location"].endswith("?cancel=cancelled")
    assert ledger(fleet.dsn, queued)["status"] == "cancelled"
    page = client.get(done.headers["location"])
    assert "Cancel sent: the request is cancelled now" in page.text
    # Without a token configured, cancelling is off, loopback or not.
    with TestClient(create_app(_settings(fleet, None)), client=("127.0.0.1", 1)) as no_token:
        off = no_token.post(path, data={"token": TOKEN})
        assert off.status_code == 403 and "LOOMFLOW_WORKER_CONSOLE_TOKEN" in off.text


def test_a_prompt_is_cut_except_on_its_own_page_when_asked(
    fleet: Fleet, queued: str, client: TestClient
) -> None:
    for path in ("/requests", "/sessions/console-s", f"/runs/{queued}"):
        page = client.get(path)
        assert page.status_code == 200 and queued[:8] in page.text
        assert "Mind the weather" in page.text and END not in page.text, path
    assert "show prompt (" in client.get(f"/runs/{queued}").text
    shown = client.get(f"/runs/{queued}?prompt=full")
    assert END in shown.text and "hide prompt" in shown.text


def test_bad_filters_and_unknown_requests_say_what_is_wrong(client: TestClient) -> None:
    def said(path: str, status: int = 400) -> str:
        page = client.get(path)
        assert page.status_code == status, path
        return html.unescape(page.text)

    assert "status 'done' is not a status; one of queued, running" in said(
        "/requests?status=done")
    assert "since: 'yesterday' is neither a duration ago" in said("/requests?since=yesterday")
    assert "since must be earlier than until" in said("/requests?since=1h&until=2h")
    assert "unknown filter 'colour'" in said("/requests?colour=red")
    assert "before must be a request's sequence number" in said("/requests?before=abc")
    assert "no request 'no-such-request' in the runs ledger" in said(
        "/runs/no-such-request", 404)


def test_the_command_refuses_to_listen_off_loopback_without_a_token(fleet: Fleet) -> None:
    done = cli(fleet, "console", "--host", "0.0.0.0", timeout=30)
    assert done.returncode == 2
    assert "not a loopback address" in done.stderr
    assert "LOOMFLOW_WORKER_CONSOLE_TOKEN" in done.stderr
    short = cli(fleet, "console", LOOMFLOW_WORKER_CONSOLE_TOKEN="short", timeout=30)
    assert short.returncode == 2 and "console_token: Value error, must be at least 16" \
        in short.stderr and "short" not in short.stderr.replace("console_token", "")


# ---- the list query's plan --------------------------------------------------------------------

MANY = 200_000

_FILL = """
INSERT INTO runs (request_id, scope, session_id, user_id, agent, prompt, status, enqueued_at,
                  finished_at)
SELECT 'r' || i, 's' || (i %% 5000) || '/u' || (i %% 300), 's' || (i %% 5000), 'u' || (i %% 300),
       CASE WHEN i %% 50 = 0 THEN 'triage' ELSE 'default' END, 'prompt ' || i,
       CASE WHEN i %% 97 = 0 THEN 'failed' WHEN i %% 1000 = 0 THEN 'queued' ELSE 'succeeded' END,
       now() - make_interval(secs => (%(n)s - i) * 0.5), now()
  FROM generate_series(1, %(n)s) AS i
"""


def _plan(conn: psycopg.Connection[object], params: dict[str, object]) -> tuple[str, float]:
    full = {"status": None, "session_id": None, "user_id": None, "agent": None, "since": None,
            "until": None, "before": None, "limit": 51, "prompt_chars": 120, **params}
    row = conn.execute("EXPLAIN (FORMAT JSON) " + query("console_requests"), full).fetchone()
    assert row is not None
    nodes: list[str] = []

    def walk(node: dict[str, object]) -> None:
        name = str(node["Node Type"])
        if "Index Name" in node:
            name += f" {node['Index Name']}"
        nodes.append(name)
        for child in node.get("Plans", []):  # type: ignore[attr-defined]
            walk(child)

    walk(row[0][0]["Plan"])
    started = time.perf_counter()
    conn.execute(query("console_requests"), full).fetchall()
    return " > ".join(nodes), (time.perf_counter() - started) * 1000


def test_the_list_query_reads_an_index_in_order_on_many_requests(fleet: Fleet) -> None:
    with psycopg.connect(fleet.dsn, autocommit=True, prepare_threshold=None) as conn:
        conn.execute(_FILL, {"n": MANY})
        conn.execute("ANALYZE runs")
        (last,) = conn.execute("SELECT max(seq) FROM runs").fetchone() or (0,)
        cases = {
            "no filter": ({}, "runs_seq_key"),
            "a page further": ({"before": last - 100_000}, "runs_seq_key"),
            "status failed": ({"status": "failed"}, "runs_status_seq"),
            # Few queued requests: the partial index of unfinished ones, then a sort.
            "status queued, older page": ({"status": "queued", "before": last // 2}, None),
            "session": ({"session_id": "s42"}, "runs_session"),
            "user": ({"user_id": "u7"}, "runs_user_seq"),
            "agent triage": ({"agent": "triage"}, "runs_agent_seq"),
            "user and status": ({"user_id": "u7", "status": "failed"}, None),
            "last hour": ({"since": _ago(conn, 3600)}, None),
            "an hour a day ago": ({"since": _ago(conn, 90000), "until": _ago(conn, 86400)},
                                  "runs_enqueued"),
            "failed, before a day ago": ({"status": "failed", "until": _ago(conn, 86400)},
                                         "runs_enqueued"),
        }
        for name, (params, index) in cases.items():
            plan, took = _plan(conn, params)
            print(f"{name:<28} {took:6.1f} ms  {plan}")
            assert "Seq Scan" not in plan, (name, plan)
            if index is not None:
                assert index in plan, (name, plan)
            assert took < 500, (name, took, plan)
        # The window's bounds on seq leave out nothing the window holds.
        since, until = _ago(conn, 90000), _ago(conn, 86400)
        full = {"status": None, "session_id": None, "user_id": None, "agent": None,
                "since": since, "until": until, "before": None, "limit": 1000,
                "prompt_chars": 10}
        listed = [r[0] for r in conn.execute(query("console_requests"), full)]
        expected = [r[0] for r in conn.execute(
            "SELECT request_id FROM runs WHERE enqueued_at >= %s AND enqueued_at < %s "
            "ORDER BY seq DESC LIMIT 1000", (since, until))]
        assert len(expected) == 1000 and listed == expected


def _ago(conn: psycopg.Connection[object], seconds: float) -> object:
    row = conn.execute("SELECT now() - make_interval(secs => %s)", (seconds,)).fetchone()
    assert row is not None
    return row[0]


FAST = {
    "LOOMFLOW_WORKER_SWEEP_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_LEASE": "3",
    "TEST_TOOL_SLEEP": "0.4",
}


def _worker_on_page(client: TestClient, worker: str) -> tuple[str, int] | None:
    """The state and runs in flight the fleet page shows for ``worker`` (node:pid)."""
    page = client.get("/fleet")
    assert page.status_code == 200
    found = re.search(
        rf'<tr data-worker="{re.escape(html.escape(worker))}" data-state="(\w+)".*?'
        r'<td class="num runs">(\d+)</td>', page.text)
    return None if found is None else (found[1], int(found[2]))


def _until_shown(client: TestClient, worker: str, expected: tuple[str, int],
                 timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    shown = None
    while time.monotonic() < deadline:
        shown = _worker_on_page(client, worker)
        if shown == expected:
            return
        time.sleep(0.1)
    raise AssertionError(f"the fleet page shows {worker} as {shown}, not {expected}")


def test_the_fleet_page_shows_workers_by_heartbeat_and_the_sweepers_actions(
    fleet: Fleet, client: TestClient
) -> None:
    fleet.start("w1", concurrency=1, **FAST)
    fleet.start("w2", concurrency=1, **FAST)
    killed = run_agent.delay(calls("f0", "f1", "f2", "f3"), "fleet-s")
    _, pid, _, _ = _wait_for_execution(fleet.dsn, "f1")
    victim = fleet.worker_of(pid)
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT holder FROM runs WHERE request_id = %s",
                           (killed.id,)).fetchone()
    assert row is not None and row[0].endswith(f":{pid}")
    first = str(row[0])
    # Seen by its heartbeat, with the run it carries.
    _until_shown(client, first, ("live", 1))

    fleet.kill(victim)
    assert killed.get(timeout=60)["output"].startswith("done: recorded f0")
    # No beat since the SIGKILL: stale after two of its intervals.
    _until_shown(client, first, ("stale", 1))
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT worker FROM run_attempts WHERE request_id = %s "
                           "AND attempt = 2", (killed.id,)).fetchone()
    assert row is not None
    second = str(row[0])
    _until_shown(client, second, ("live", 0))
    # The sweeper dispatched the killed run again, and the page says so.
    page = client.get("/fleet").text
    actions = re.findall(r'<tr data-action="(\w+)">(.*?)</tr>', page, re.S)
    assert any(action == "redispatch" and killed.id[:8] in cells
               for action, cells in actions), actions

    (survivor,) = fleet.workers  # the one not killed, which ran it again
    fleet.terminate(survivor)
    _until_shown(client, second, ("stopped", 0), timeout=5)


def test_the_fleet_page_shows_each_workers_load(fleet: Fleet, client: TestClient) -> None:
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO workers (worker, hostname, pid, slots, heartbeat_interval, runs,"
            " loop_lag, lock_queue, admitting) VALUES"
            " ('busy@h:7', 'h', 7, 1000, 600, 312, 0.73, 41, false),"
            " ('calm@h:8', 'h', 8, 1000, 600, 3, 0.004, 0, true)")
    page = client.get("/fleet").text
    rows = dict(re.findall(r'<tr data-worker="([^"]+)"[^>]*>(.*?)</tr>', page, re.S))
    assert '<td class="admitting">paused</td>' in rows["busy@h:7"]
    assert '<td class="num lag">0.73s</td>' in rows["busy@h:7"]
    assert '<td class="num queue">41</td>' in rows["busy@h:7"]
    assert '<td class="admitting">yes</td>' in rows["calm@h:8"]
    assert '<td class="num lag">0.00s</td>' in rows["calm@h:8"]


def test_the_sweeper_keeps_its_actions_and_the_workers_table_short(
    dsn: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sweeper, "KEEP_ACTIONS", 10)
    made = sweeper.Sweeper(Settings(database_url=dsn), lambda _: None)  # type: ignore[arg-type]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO workers (worker, hostname, pid, slots, heartbeat_interval, seen_at) "
            "VALUES ('old@h:1', 'h', 1, 1, 2, now() - interval '2 days'), "
            "('new@h:2', 'h', 2, 1, 2, now())")
        assert made.forget_workers(conn) == 1
        assert made.forget_workers(conn) == 0  # not again before PRUNE_EVERY
        for batch in range(3):
            made.actions.extend(sweeper.Action("redispatch", f"r{batch}-{i}") for i in range(7))
            made.record_actions(conn)
        assert made.actions == []
        kept = [r[0] for r in conn.execute(
            "SELECT coalesce(request_id, action) FROM sweeper_actions ORDER BY id")]
        assert len(kept) == 10 and kept[-1] == "r2-6"
        assert [r[0] for r in conn.execute("SELECT worker FROM workers")] == ["new@h:2"]
        # A failing record is logged, and the sweep goes on.
        conn.execute("ALTER TABLE sweeper_actions RENAME TO sweeper_actions_away")
        made.actions.append(sweeper.Action("fence", "r9"))
        with caplog.at_level(logging.WARNING, logger="loomflow_worker.sweeper"):
            made.record_actions(conn)
        assert "could not record 1 action" in caplog.text
        assert conn.execute("SELECT 1").fetchone() == (1,)
