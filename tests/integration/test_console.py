"""The run console without a browser: who may look, who may cancel, what a page
shows of a prompt, bad filters, the command's refusals, and the list query's
plan on a ledger of many requests (real Postgres, the real cancel_request)."""

from __future__ import annotations

import html
import json
import logging
import re
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

import anyio
import httpx
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict
from pydantic import SecretStr, ValidationError
from starlette.applications import Starlette
from starlette.testclient import TestClient

from loomflow_worker import admin
from loomflow_worker.console import BackgroundConsole, create_app, data
from loomflow_worker.runtime.errors import InvalidInput
from loomflow_worker.runtime.sql import query
from loomflow_worker.settings import Settings
from loomflow_worker.sweeper import leader
from loomflow_worker.sweeper.actions import Action
from loomflow_worker.sweeper.leader import Sweeper
from loomflow_worker.tasks import run_agent, settings

from .celery_harness import Fleet, ledger
from .helpers import calls, cli, wait_fleet_page, wait_for_execution, wait_until

TOKEN = "console-token-" + "x" * 20
END = "zebra-at-the-end"
OUTSIDE = ("203.0.113.5", 50000)
LOCAL = ("127.0.0.1", 40000)


def _browser(app: Starlette, address: tuple[str, int] = LOCAL, *,
             base_url: str = "http://localhost:8040", **kwargs: Any) -> TestClient:
    """A client of ``app`` at ``address``, naming the console by a host it serves."""
    return TestClient(app, client=address, base_url=base_url, **kwargs)


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
    with _browser(create_app(_settings(fleet))) as local:
        yield local


def test_the_token_is_required_off_loopback_and_not_on_it(fleet: Fleet, queued: str) -> None:
    app = create_app(_settings(fleet))
    with _browser(app, OUTSIDE, follow_redirects=False) as outside:
        for path in ("/requests", f"/runs/{queued}", "/fleet", "/sessions/console-s",
                     f"/runs/{queued}/events"):
            denied = outside.get(path)
            assert denied.status_code == 401, path
            assert "Mind the weather" not in denied.text and "queued" not in denied.text
            assert str(conninfo_to_dict(fleet.dsn)["dbname"]) not in denied.text
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
    with _browser(app) as local:
        assert local.get("/requests").status_code == 200
        # Through a proxy on this host, a client is not local.
        assert local.get("/requests", headers={"X-Forwarded-For": "198.51.100.7"}
                         ).status_code == 401
    # Without a token, only loopback may look.
    with _browser(create_app(_settings(fleet, None)), OUTSIDE) as outside:
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
    with _browser(create_app(_settings(fleet, None))) as no_token:
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


def test_the_console_answers_only_the_hosts_it_serves(fleet: Fleet, queued: str) -> None:
    """A page of another site whose name resolves to the console's address (DNS
    rebinding) names its own host: refused, over a real socket, with no data."""
    full = f"/runs/{queued}?prompt=full"
    dbname = str(conninfo_to_dict(fleet.dsn)["dbname"])
    with BackgroundConsole(_settings(fleet)) as console:
        port = console.url.rsplit(":", 1)[1]
        for host in ("rebind.attacker.example", f"rebind.attacker.example:{port}",
                     "localhost.attacker.example", "127.0.0.1.nip.io", "", "a b"):
            refused = httpx.get(console.url + full, headers={"Host": host})
            assert refused.status_code == 400, host
            assert "LOOMFLOW_WORKER_CONSOLE_HOSTS" in refused.text
            assert END not in refused.text and queued not in refused.text
            assert dbname not in refused.text  # not even the database's name
        assert httpx.get(console.url + "/login",
                         headers={"Host": "rebind.attacker.example"}).status_code == 400
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST.", f"[::1]:{port}",
                     "127.0.0.2"):
            shown = httpx.get(console.url + full, headers={"Host": host})
            assert shown.status_code == 200 and END in shown.text, host
    # A public name the console is reached by, in the setting.
    named = _settings(fleet).model_copy(update={"console_hosts": ["console.example.com"]})
    with BackgroundConsole(named) as console:
        for host, status in (("console.example.com", 200), ("console.example.com:443", 200),
                             ("other.example.com", 400)):
            assert httpx.get(console.url + full, headers={"Host": host}).status_code == status
    # The --host it listens on, by its address.
    address = _outside_address()
    with BackgroundConsole(_settings(fleet), host=address) as console:
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.get(console.url + "/requests", headers=bearer).status_code == 200
        assert httpx.get(console.url + "/requests", headers={
            **bearer, "Host": "rebind.attacker.example"}).status_code == 400
    # Bound to every address: any address names it, a name only from the setting.
    with BackgroundConsole(_settings(fleet), host="0.0.0.0") as console:
        port = console.url.rsplit(":", 1)[1]
        local = f"http://127.0.0.1:{port}"
        assert httpx.get(local + full, headers={"Host": f"{address}:{port}"}).status_code == 200
        assert httpx.get(local + full, headers={"Host": "rebind.attacker.example"}
                         ).status_code == 400


def test_the_hosts_setting_takes_names_not_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    variable = "LOOMFLOW_WORKER_CONSOLE_HOSTS"
    monkeypatch.setenv(variable, "Console.Example.com., 10.0.0.5,[2001:db8::5]")
    assert Settings().console_hosts == ["console.example.com", "10.0.0.5", "[2001:db8::5]"]
    for bad in ("https://console.example.com", "console.example.com:443", "a b", "x/y"):
        monkeypatch.setenv(variable, bad)
        with pytest.raises(ValidationError, match="without scheme, port or path"):
            Settings()


@pytest.mark.slow
def test_the_token_can_be_required_on_loopback_too(fleet: Fleet, queued: str) -> None:
    """A forwarder on this host (socat, ssh -L) makes its clients look local:
    console_require_token makes loopback present the token as well."""
    strict = _settings(fleet).model_copy(update={"console_require_token": True})
    with _browser(create_app(strict), follow_redirects=False) as local:
        for path in ("/requests", f"/runs/{queued}?prompt=full", "/fleet"):
            denied = local.get(path)
            assert denied.status_code == 401 and END not in denied.text, path
        assert local.get("/requests", headers={"Authorization": f"Bearer {TOKEN}"}
                         ).status_code == 200
        assert local.post("/login", data={"token": TOKEN}).status_code == 303
        assert local.get(f"/runs/{queued}?prompt=full").status_code == 200
    with pytest.raises(ValidationError, match="console_require_token is on but console_token"):
        Settings(console_require_token=True)
    done = cli(fleet, "console", LOOMFLOW_WORKER_CONSOLE_REQUIRE_TOKEN="true",
               LOOMFLOW_WORKER_CONSOLE_TOKEN="", timeout=30)
    assert done.returncode == 2 and "console_require_token is on" in done.stderr


def _login_cookie(response: Any) -> dict[str, str]:
    """The login cookie's Set-Cookie header (of a TestClient's response), as
    attribute: value (lower case)."""
    (header,) = [h for h in response.headers.get_list("set-cookie")
                 if h.startswith("lfw_console=")]
    parts = [p.strip() for p in header.split(";")]
    attributes = {p.partition("=")[0].lower(): p.partition("=")[2] for p in parts[1:]}
    return {"value": parts[0].partition("=")[2], **attributes}


def test_a_login_is_its_own_cookie_that_expires_and_logs_out(
    fleet: Fleet, queued: str
) -> None:
    app = create_app(_settings(fleet))
    with _browser(app, OUTSIDE, follow_redirects=False) as outside:
        first = _login_cookie(outside.post("/login", data={"token": TOKEN}))
        second = _login_cookie(outside.post("/login", data={"token": TOKEN}))
        # A value per login, neither the token nor a fixed digest of it.
        assert first["value"] != second["value"] and TOKEN not in first["value"]
        assert first["max-age"] == "43200" and first["path"] == "/"
        assert "httponly" in first and first["samesite"].lower() == "strict"
        assert "secure" not in first  # plain http, no proxy believed
        # Both logins open the pages, until each one's lifetime ends.
        for login in (first, second):
            outside.cookies.clear()
            outside.cookies.set("lfw_console", login["value"])
            assert outside.get(f"/runs/{queued}").status_code == 200
        # A proxy's X-Forwarded-Proto is not believed unless the setting says so.
        assert "secure" not in _login_cookie(outside.post(
            "/login", data={"token": TOKEN}, headers={"X-Forwarded-Proto": "https"}))
    with _browser(app, OUTSIDE, base_url="https://localhost", follow_redirects=False) as tls:
        assert "secure" in _login_cookie(tls.post("/login", data={"token": TOKEN}))
    proxied = _settings(fleet).model_copy(update={"console_trust_proxy": True,
                                                  "console_login_lifetime": 2.0})
    with _browser(create_app(proxied), OUTSIDE, follow_redirects=False) as behind:
        login = _login_cookie(behind.post("/login", data={"token": TOKEN},
                                          headers={"X-Forwarded-Proto": "https"}))
        assert "secure" in login and login["max-age"] == "2"
        behind.cookies.set("lfw_console", login["value"])
        assert behind.get("/requests").status_code == 200
        # Past its lifetime, the same cookie opens nothing, and the form says why.
        wait_until(lambda: behind.get("/requests").status_code, "the login expired", 10,
                   until=lambda status: status != 200, every=0.2)
        expired = behind.get("/requests")
        assert expired.status_code == 401 and "Your login has expired" in expired.text


def test_logout_clears_the_login_and_takes_the_logout_key(fleet: Fleet, queued: str) -> None:
    with _browser(create_app(_settings(fleet)), OUTSIDE, follow_redirects=False) as outside:
        outside.post("/login", data={"token": TOKEN})
        login = outside.cookies["lfw_console"]
        # A cross-site form posts the cookie, never the logout key: refused, still logged in.
        for form in ({}, {"key": "0" * 64}):
            refused = outside.post("/logout", data=form)
            assert refused.status_code == 403 and "still logged in" in refused.text
        assert outside.cookies["lfw_console"] == login
        assert outside.get(f"/runs/{queued}").status_code == 200
        page = outside.get("/logout")
        found = re.search(r'name="key" value="([0-9a-f]{64})"', page.text)
        assert page.status_code == 200 and found is not None
        done = outside.post("/logout", data={"key": found[1]})
        assert done.status_code == 303 and done.headers["location"] == "/login"
        cleared = _login_cookie(done)
        assert cleared["value"] in ("", '""') and cleared["max-age"] == "0"
        assert "lfw_console" not in outside.cookies
        assert outside.get(f"/runs/{queued}").status_code == 401
        # The cookie kept elsewhere still works until it expires (no session store):
        # a new token ends every login at once.
        outside.cookies.set("lfw_console", login)
        assert outside.get("/requests").status_code == 200
    rotated = _settings(fleet, TOKEN + "-new")
    with _browser(create_app(rotated), OUTSIDE) as outside:
        outside.cookies.set("lfw_console", login)
        assert outside.get("/requests").status_code == 401


def test_odd_parameters_get_a_400_that_says_why(client: TestClient) -> None:
    for params, said in (
        ("before=\u00b2", "before must be a request's sequence number (ASCII digits"),
        ("before=99999999999999999999", "at most 9223372036854775807"),
        ("before=9223372036854775808", "at most 9223372036854775807"),
        ("since=" + "1" * 5000, "is not a duration"),
        ("since=" + "1" * 5000 + "d", "is longer than 365000d"),
        ("until=" + "9" * 4400 + "s", "is longer than 365000d"),
        ("since=\u0663d", "since: '\u0663d' is neither a duration ago"),
    ):
        page = client.get("/requests?" + params)
        assert page.status_code == 400, params[:40]
        assert said in html.unescape(page.text), (params[:40], page.text[-600:])
        assert len(page.text) < 20_000  # the value is quoted cut short
    assert client.get(f"/requests?before={2**63 - 1}").status_code == 200


def test_a_last_event_id_beyond_a_stream_id_replays_from_the_start(
    fleet: Fleet, queued: str, client: TestClient
) -> None:
    done = client.post(f"/runs/{queued}/cancel", data={"token": TOKEN}, follow_redirects=False)
    assert done.status_code == 303 and ledger(fleet.dsn, queued)["status"] == "cancelled"
    # Beyond 64 bits, or not ASCII digits (Redis refused the first two mid-stream).
    for after in ("99999999999999999999-0", "1-18446744073709551616",
                  "\u00b2-1".encode("latin-1")):
        events = client.get(f"/runs/{queued}/events", headers={"Last-Event-ID": after})
        assert events.status_code == 200, after
        assert "event: end" in events.text and "cancelled" in events.text, after


def test_a_request_id_with_a_slash_is_linked_and_shown(fleet: Fleet, client: TestClient) -> None:
    """Ids with a slash and other reserved characters: listed, linked and shown
    (an id ending in /events or /cancel is the one exception: see RunId)."""
    ids = {"team/a-1", "team/b/../c?x=1#y", "100% sure", "team/events/1"}
    for request_id in ids:
        run_agent.apply_async((calls("q1"), "slash-s"), task_id=request_id)
    listed = client.get("/requests?session=slash-s").text
    links = re.findall(r'<td class="id"><a href="/runs/([^"]+)"', listed)
    assert {unquote(html.unescape(link)) for link in links} == ids
    for link in links:
        page = client.get("/runs/" + html.unescape(link))
        assert page.status_code == 200, link
        assert unquote(html.unescape(link)) in html.unescape(page.text)
    # Typed by hand, with the slash as it is.
    page = client.get("/runs/team/a-1")
    assert page.status_code == 200 and "slash-s" in page.text
    cancelled = client.post("/runs/team/a-1/cancel", data={"token": TOKEN},
                            follow_redirects=False)
    assert cancelled.status_code == 303
    assert cancelled.headers["location"] == "/runs/team%2Fa-1?cancel=cancelled"
    assert ledger(fleet.dsn, "team/a-1")["status"] == "cancelled"


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_fleet_page_shows_workers_by_heartbeat_and_the_sweepers_actions(
    fleet: Fleet, client: TestClient
) -> None:
    fleet.start("w1", concurrency=1, **FAST)
    fleet.start("w2", concurrency=1, **FAST)
    killed = run_agent.delay(calls("f0", "f1", "f2", "f3"), "fleet-s")
    _, pid, _, _ = wait_for_execution(fleet.dsn, "f1")
    victim = fleet.worker_of(pid)
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT holder FROM runs WHERE request_id = %s",
                           (killed.id,)).fetchone()
    assert row is not None and row[0].endswith(f":{pid}")
    first = str(row[0])
    # Seen by its heartbeat, with the run it carries.
    wait_fleet_page(client, first, ("live", 1))

    fleet.kill(victim)
    assert killed.get(timeout=60)["output"].startswith("done: recorded f0")
    # No beat since the SIGKILL: stale after two of its intervals.
    wait_fleet_page(client, first, ("stale", 1))
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT worker FROM run_attempts WHERE request_id = %s "
                           "AND attempt = 2", (killed.id,)).fetchone()
    assert row is not None
    second = str(row[0])
    wait_fleet_page(client, second, ("live", 0))
    # The sweeper dispatched the killed run again, and the page says so.
    page = client.get("/fleet").text
    actions = re.findall(r'<tr data-action="(\w+)">(.*?)</tr>', page, re.S)
    assert any(action == "redispatch" and killed.id[:8] in cells
               for action, cells in actions), actions

    (survivor,) = fleet.workers  # the one not killed, which ran it again
    fleet.terminate(survivor)
    wait_fleet_page(client, second, ("stopped", 0), timeout=5)


@pytest.mark.slow
def test_show_and_the_run_page_read_one_model_of_a_request(
    fleet: Fleet, client: TestClient
) -> None:
    """`show` and the console read a request as one model (admin.RequestDetail): the
    same row, attempts and journal, each entry with the attempts that ran and
    replayed it; here of a run whose first worker died mid-run."""
    fleet.start("w1", concurrency=1, **FAST)
    fleet.start("w2", concurrency=1, **FAST)
    killed = run_agent.delay(calls("m0", "m1", "m2"), "model-s")
    _, pid, _, _ = wait_for_execution(fleet.dsn, "m1")
    fleet.kill(fleet.worker_of(pid))
    assert killed.get(timeout=60)["output"].startswith("done: recorded m0")

    done = cli(fleet, "show", killed.id, "--json")
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)

    async def read() -> admin.RequestDetail:
        pool = data.make_pool(_settings(fleet))
        await pool.open()
        try:
            return await data.get_request(pool, killed.id)
        finally:
            await pool.close()

    paged = anyio.run(read)
    # Read a moment apart: the clock, and when a live worker of the request's
    # version last stamped its row, move between the two reads.
    moving = {"now": None, "version_seen_at": None}
    assert {**paged.as_json(), **moving} == {**shown, **moving}
    assert shown["version_seen_at"] is not None
    first, second = shown["attempts"]
    assert shown["attempts_count"] == 2 and first["next_started_at"] == second["started_at"]
    page = client.get(f"/runs/{killed.id}").text
    assert "2 attempts" in page and 'data-outcome="worker died"' in page
    assert "executed in attempt 1, replayed in 2" in page


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
    monkeypatch.setattr(leader, "KEEP_ACTIONS", 10)
    made = Sweeper(Settings(database_url=dsn), lambda _: None)  # type: ignore[arg-type]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO workers (worker, hostname, pid, slots, heartbeat_interval, seen_at) "
            "VALUES ('old@h:1', 'h', 1, 1, 2, now() - interval '2 days'), "
            "('new@h:2', 'h', 2, 1, 2, now())")
        assert made.retention.forget_workers(conn) == 1
        assert made.retention.forget_workers(conn) == 0  # not again before PRUNE_EVERY
        for batch in range(3):
            made.actions.extend(Action("redispatch", f"r{batch}-{i}") for i in range(7))
            made.record_actions(conn)
        assert made.actions == []
        kept = [r[0] for r in conn.execute(
            "SELECT coalesce(request_id, action) FROM sweeper_actions ORDER BY id")]
        assert len(kept) == 10 and kept[-1] == "r2-6"
        assert [r[0] for r in conn.execute("SELECT worker FROM workers")] == ["new@h:2"]
        # A failing record is logged, and the sweep goes on.
        conn.execute("ALTER TABLE sweeper_actions RENAME TO sweeper_actions_away")
        made.actions.append(Action("fence", "r9"))
        with caplog.at_level(logging.WARNING, logger="loomflow_worker.sweeper"):
            made.record_actions(conn)
        assert "could not record 1 action" in caplog.text
        assert conn.execute("SELECT 1").fetchone() == (1,)


@pytest.mark.slow
def test_the_fleet_page_shows_each_limit_each_keys_backlog_and_each_model_budget(
    fleet: Fleet, client: TestClient
) -> None:
    assert cli(fleet, "limits", "concurrency", "per_key", "1").returncode == 0
    assert cli(fleet, "limits", "set", "anthropic", "--rpm", "300").returncode == 0
    # The first of alice's three goes out; the other two wait on her limit.
    for i in range(3):
        run_agent.delay(calls(f"x{i}"), f"limit-s{i}", user_id="alice")
    run_agent.delay(calls("y"), "limit-b", user_id="bob")
    page = client.get("/fleet")
    assert page.status_code == 200
    text = page.text
    assert re.search(r'data-limit="per_key">.*?<td class="num">1</td>'
                     r'<td class="num waiting">2</td>', text), text
    assert re.search(r'data-key="alice">.*?<td class="num queued">3</td>'
                     r'<td class="num on-limit">2</td>', text), text
    assert re.search(r'data-key="bob">.*?<td class="num queued">1</td>'
                     r'<td class="num on-limit">0</td>', text), text
    assert 'data-model-key="anthropic"><td>anthropic</td><td class="num">300</td>' in text
