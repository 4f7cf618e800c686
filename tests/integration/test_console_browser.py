"""The run console in a real browser (Debian's headless Chromium, found on
PATH, driven by Playwright) against real workers: a run whose worker was SIGKILLed mid-run
shows two attempt lanes and its replayed steps; a run followed live; and no
secret on any page. Screenshots of each page go to tests/artifacts/console/."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from pydantic import SecretStr

from loomflow_worker import admin
from loomflow_worker.console import BackgroundConsole
from loomflow_worker.settings import Settings
from loomflow_worker.tasks import run_agent, settings
from tests.needs import ADMIN_DSN, CHROMIUM

from .celery_harness import ROOT, Fleet
from .helpers import calls, wait_for_execution

pytestmark = pytest.mark.slow

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SHOTS = ROOT / "tests" / "artifacts" / "console"
RECOVERY = {
    "LOOMFLOW_WORKER_SWEEP_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_LEASE": "3",
    "TEST_TOOL_SLEEP": "0.4",
}
TOKEN = "browser-test-token-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        found = playwright.chromium.launch(executable_path=CHROMIUM.require(),
                                           args=CHROMIUM_ARGS)
        try:
            yield found
        finally:
            found.close()


@pytest.fixture
def browser(chromium: Browser) -> Iterator[Browser]:
    """The module's Chromium; the pages a test opened are closed after it."""
    try:
        yield chromium
    finally:
        for context in chromium.contexts:
            context.close()


def _shot(page: Page, name: str) -> Path:
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


def _console_settings(**change: object) -> Settings:
    return settings().model_copy(update={"console_token": SecretStr(TOKEN), **change})


def test_a_killed_run_shows_two_attempts_and_its_replayed_steps(
    fleet: Fleet, browser: Browser
) -> None:
    fleet.start("w1", concurrency=1, **RECOVERY)
    fleet.start("w2", concurrency=1, **RECOVERY)
    tags = [f"b{i}" for i in range(4)]
    killed = run_agent.delay(calls(*tags), "trip-ana", user_id="ana")
    _, pid, _, _ = wait_for_execution(fleet.dsn, tags[2])
    victim = fleet.worker_of(pid)
    fleet.kill(victim)
    assert killed.get(timeout=60)["output"].startswith("done: recorded b0")
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        # What `loomflow-worker show` computes, to compare the picture with.
        detail = admin.get_request(conn, killed.id)
    assert len(detail.attempts) == 2
    executed_first = sorted(s.name for s in detail.journal if s.executed_in == 1)
    replayed_second = sorted(s.name for s in detail.journal if 2 in s.replayed_in)
    assert replayed_second, "the resumed attempt replayed nothing: the test proved nothing"

    with BackgroundConsole(_console_settings()) as console:
        page = browser.new_page(viewport={"width": 1280, "height": 900})

        page.goto(f"{console.url}/requests?status=succeeded")
        expect(page.locator(f"tr[data-request='{killed.id}']")).to_be_visible()
        _shot(page, "requests")

        page.goto(f"{console.url}/runs/{killed.id}")
        lanes = page.locator("svg#timeline g.lane")
        expect(lanes).to_have_count(2)
        first, second = lanes.nth(0), lanes.nth(1)
        assert first.get_attribute("data-outcome") == "worker died"
        assert second.get_attribute("data-outcome") == "succeeded"
        # The first lane is the killed worker's, the second another's.
        assert (first.locator(".lane-worker").text_content() or "").startswith(f"{victim}-")
        assert not (second.locator(".lane-worker").text_content() or "").startswith(victim)
        expect(first.locator(".mark.replayed")).to_have_count(0)
        first_steps = sorted(first.locator(".mark.executed").evaluate_all(
            "marks => marks.map(m => m.dataset.step)"))
        second_replayed = sorted(second.locator(".mark.replayed").evaluate_all(
            "marks => marks.map(m => m.dataset.step)"))
        assert first_steps == executed_first
        assert second_replayed == replayed_second
        expect(second.locator(".mark.executed")).not_to_have_count(0)
        expect(first.locator("line.gone")).to_have_count(1)  # no end recorded: it died
        # Executed and replayed marks are drawn in two colours.
        fills = page.evaluate(
            "[...document.querySelectorAll('#timeline .mark')]"
            ".map(m => m.classList[1] + ' ' + getComputedStyle(m).fill)")
        colours = {kind: {f.split(" ", 1)[1] for f in fills if f.startswith(kind)}
                   for kind in ("executed", "replayed")}
        assert len(colours["executed"]) == 1 and len(colours["replayed"]) == 1
        assert colours["executed"] != colours["replayed"]
        # The live events, replayed from the stream to its end.
        expect(page.locator("#events")).to_have_attribute("data-state", "ended")
        events = page.locator("#events li")
        expect(events.last).to_contain_text("succeeded")
        assert any(" replay " in text for text in events.all_text_contents())
        expect(page.locator("#outcome pre.result")).to_contain_text("recorded b3")
        _shot(page, "run")
        page.locator("#timeline").screenshot(path=str(SHOTS / "timeline.png"))

        page.click("text=trip-ana")
        expect(page.locator("section.scope[data-user='ana'] tr")).to_have_count(2)
        expect(page.locator("section.scope")).to_contain_text("the scope is free")
        _shot(page, "session")

        # A run followed live: its events arrive while it runs, then the page shows its end.
        live = run_agent.delay(calls(*(f"l{i}" for i in range(5))), "live-bo")
        behind = run_agent.delay(calls("m1"), "live-bo")
        page.goto(f"{console.url}/runs/{live.id}")
        box = page.locator("#events")
        expect(box).to_have_attribute("data-live", "1")
        page.wait_for_function(
            "() => { const b = document.querySelector('#events');"
            " return b && b.dataset.state === 'following' && Number(b.dataset.count) > 0; }",
            timeout=30_000)
        _shot(page, "run-live")
        # Meanwhile, its session: the running request holds the scope, the next waits.
        other = browser.new_page(viewport={"width": 1280, "height": 700})
        other.goto(f"{console.url}/sessions/live-bo")
        expect(other.locator(f"tr[data-request='{live.id}'] td.role")).to_have_text(
            "holds the scope")
        expect(other.locator(f"tr[data-request='{behind.id}'] td.role")).to_have_text("waits")
        _shot(other, "session-busy")
        live.get(timeout=60)
        expect(page.locator("h1 .status")).to_have_text("succeeded", timeout=30_000)
        expect(page.locator("svg#timeline g.lane")).to_have_count(1)
        behind.get(timeout=60)

        page.goto(f"{console.url}/fleet")
        workers = page.locator("#workers tbody tr")
        expect(workers).not_to_have_count(0)
        died = page.locator("#workers tr.dead")
        expect(died).to_have_count(1)
        expect(page.locator("#sweeper")).to_contain_text("Leader:")
        # The killed worker's process went stale, and the sweeper sent its run again.
        expect(page.locator("#seen tr[data-state='stale']")).to_have_count(1)
        expect(page.locator("#seen tr[data-state='live']")).not_to_have_count(0)
        expect(page.locator("#sweeper tr[data-action='redispatch']")).not_to_have_count(0)
        expect(page.locator("#connections")).to_contain_text("loomflow-worker sweeper")
        expect(page.locator("#queue")).to_contain_text("message")
        _shot(page, "fleet")


@pytest.fixture
def password_dsn(fleet: Fleet) -> Iterator[tuple[str, str]]:
    """The fleet's database through a role with a password (the server trusts
    loopback, so it logs in; the password is in the URL all the same)."""
    role = f"lfw_console_{uuid.uuid4().hex[:8]}"
    password = f"Pw{uuid.uuid4().hex}"
    parts = conninfo_to_dict(fleet.dsn)
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
            sql.Identifier(role), sql.Literal(password)))
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA public TO {}").format(
            sql.Identifier(role)))
    try:
        yield (f"postgresql://{role}:{password}@127.0.0.1:{parts.get('port') or 5432}/"
               f"{parts['dbname']}", password)
    finally:
        with psycopg.connect(fleet.dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE usename = %s", (role,))
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def test_no_secret_on_any_page(
    fleet: Fleet, browser: Browser, password_dsn: tuple[str, str]
) -> None:
    dsn, password = password_dsn
    fleet.start("w1", concurrency=1)
    # A run whose metadata and prompt quote the secrets (as a careless caller might).
    done = run_agent.delay(calls("p1") + f"\nconnect with {dsn}", "secret-s",
                           metadata={"dsn": dsn, "token": TOKEN})
    done.get(timeout=60)
    queued = run_agent.delay(calls("p2"), "secret-s", agent="default")
    run_agent.delay(calls("p3"), "secret-s")
    with BackgroundConsole(_console_settings(database_url=SecretStr(dsn))) as console:
        page = browser.new_page()
        seen: list[tuple[str, str]] = []
        for path in ("/requests", "/sessions/secret-s", f"/runs/{done.id}",
                     f"/runs/{done.id}?prompt=full", f"/runs/{queued.id}", "/fleet",
                     "/login", "/runs/nothing-here", "/requests?status=nope"):
            page.goto(console.url + path)
            if path.startswith(f"/runs/{done.id}"):
                expect(page.locator("#events")).to_have_attribute("data-state", "ended")
            seen.append((path, page.content()))
        events = page.request.get(f"{console.url}/runs/{done.id}/events")
        seen.append(("events", events.text()))
    for path, text in seen:
        assert password not in text, f"{path} shows the database password"
        assert TOKEN not in text, f"{path} shows the console token"
    pages = dict(seen)
    # The pages did show what held them, masked: the database, the metadata, the prompt.
    assert "127.0.0.1:" in pages["/fleet"] and "***" in pages[f"/runs/{done.id}"]
    assert "connect with postgresql://" in pages[f"/runs/{done.id}?prompt=full"]
    assert "p1" in pages["events"] and "end" in pages["events"]


def test_a_rebound_name_reads_nothing(fleet: Fleet, chromium: Browser) -> None:
    """DNS rebinding: a page of rebind.attacker.example, whose name now resolves
    to the console's address, loads the console's pages as its own origin. The
    console answers that host with 400 and no data."""
    prompt = calls("r1") + "\nthe secret plan is in the prompt"
    queued = run_agent.delay(prompt, "rebind-s", user_id="ana")
    rebound = chromium.browser_type.launch(executable_path=CHROMIUM.require(), args=[
        *CHROMIUM_ARGS, "--host-resolver-rules=MAP rebind.attacker.example 127.0.0.1"])
    try:
        with BackgroundConsole(_console_settings()) as console:
            port = console.url.rsplit(":", 1)[1]
            page = rebound.new_page()
            answer = page.goto(f"http://rebind.attacker.example:{port}/runs/{queued.id}"
                               "?prompt=full")
            assert answer is not None and answer.status == 400
            text = page.content()
            assert "the secret plan" not in text and queued.id not in text
            assert "LOOMFLOW_WORKER_CONSOLE_HOSTS" in text
            # The same page by a name the console serves.
            answer = page.goto(f"http://localhost:{port}/runs/{queued.id}?prompt=full")
            assert answer is not None and answer.status == 200
            assert "the secret plan" in page.content()
    finally:
        rebound.close()


def test_long_ids_never_wrap(fleet: Fleet, browser: Browser) -> None:
    """Session, user and request ids stay on one line in every list and
    heading, cut with an ellipsis when too long, whole in their title."""
    session = "trip-lisbon-porto-" + "-".join(f"leg{i}" for i in range(14))
    user = "user-" + uuid.uuid4().hex + "-" + uuid.uuid4().hex
    queued = run_agent.delay(calls("w1"), session, user_id=user)
    with BackgroundConsole(_console_settings()) as console:
        page = browser.new_page(viewport={"width": 1100, "height": 800})
        for path in ("/requests", f"/sessions/{session}", f"/runs/{queued.id}"):
            page.goto(console.url + path)
            idents = page.locator(".ident")
            expect(idents).not_to_have_count(0)
            shown = idents.evaluate_all(
                "els => els.map(e => ({title: e.title, text: e.textContent,"
                " lines: Math.round(e.getBoundingClientRect().height"
                "   / parseFloat(getComputedStyle(e).lineHeight)),"
                " cut: e.scrollWidth > e.clientWidth}))")
            for ident in shown:
                assert ident["lines"] == 1, (path, ident)
                assert ident["title"] == ident["text"], (path, ident)
            titles = {ident["title"] for ident in shown}
            assert session in titles and user in titles, (path, titles)
            # The long session id is cut, not wrapped, in the requests list.
            if path == "/requests":
                assert any(i["cut"] for i in shown if i["title"] == session), shown
                _shot(page, "requests-long-ids")
        page.goto(console.url + "/requests")
        expect(page.locator(f"tr[data-request='{queued.id}'] td.id a")).to_have_attribute(
            "title", queued.id)
