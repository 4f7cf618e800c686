"""The console's web application (Starlette, Jinja2 templates, no build step).

Read only, but for one action: cancelling a request from its page, which
calls :func:`loomflow_worker.cancel_request` and always needs the console token,
sent in the form (a cross-site page cannot know it; a cookie would not do).
Who may look at all (the hosts it answers, loopback, the token, the login
cookie and its logout) is :mod:`.access`. Every text a page shows passes
through the template environment's finalizer, which masks the configured
passwords and the token wherever they turn up.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

import psycopg
from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.convertors import Convertor, register_url_convertor
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from .. import admin
from ..admin.usage_report import GROUPS, format_cost, format_tokens, parse_since, usage_said
from ..events import aiter_events, describe_event, events_url
from ..runtime.errors import InvalidInput, describe_dsn, driver_error
from ..runtime.validate import check_id
from ..settings import Settings
from . import data
from .access import COOKIE, Gate, HostAllowed, TokenRequired
from .timeline import layout

log = logging.getLogger(__name__)

#: The most a form may hold (a token, a redirect target).
MAX_FORM_BYTES = 4096
_STREAM_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")


def _stream_id(text: str) -> bool:
    """Whether ``text`` is a Redis stream id (two 64-bit numbers), as a
    Last-Event-ID header gives one back."""
    return _STREAM_ID.fullmatch(text) is not None and all(
        int(part) < 2**64 for part in text.split("-"))


# ---- pages ------------------------------------------------------------------------------------


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _clock(value: datetime | float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        value = datetime.fromtimestamp(value, tz=UTC)
    value = value.astimezone(UTC)
    return value.strftime("%H:%M:%S.") + f"{value.microsecond // 1000:03d}"


def _ago(value: datetime | None, now: datetime | None = None) -> str:
    if value is None:
        return "-"
    seconds = ((now or datetime.now(UTC)) - value).total_seconds()
    return admin.format_duration(max(seconds, 0.0)) + " ago"


def _id_path(value: str) -> str:
    """A request id as a path segment of a link: every reserved character
    escaped, "/" too (the route takes it back, see :class:`RunId`)."""
    return quote(value, safe="")


class RunId(Convertor[str]):
    """A request id in a path: any characters, "/" included, but not ending in
    "/events" or "/cancel", which are a run's own routes (an id that does is
    listed, and its page is out of reach)."""

    regex = r"(?:(?!/(?:events|cancel)$).)+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return _id_path(value)


register_url_convertor("run_id", RunId())


def _json(value: Any, width: int = 400) -> str:
    return admin.shorten(json.dumps(value, sort_keys=True, default=str), width)


class Pages:
    """The templates, with every shown text masked of the configured secrets."""

    def __init__(self, settings: Settings, secrets: list[str]) -> None:
        self.secrets = secrets
        self.env = Environment(
            loader=PackageLoader("loomflow_worker.console", "templates"),
            autoescape=select_autoescape(["html", "svg"]),
            finalize=self.mask,
        )
        self.env.filters.update(
            id_path=_id_path, when=_when, clock=_clock, ago=_ago, shorten=admin.shorten,
            as_json=_json, duration=admin.format_duration, cost=format_cost,
            tokens=format_tokens, usage_said=usage_said,
        )
        self.env.globals.update(
            database=describe_dsn(settings.database_url.get_secret_value()),
            statuses=admin.STATUSES,
            cancel_enabled=settings.console_token is not None,
        )

    def mask(self, value: Any) -> Any:
        return admin.redact(value, self.secrets) if isinstance(value, str) else value

    def render(self, template: str, *, status_code: int = 200, **context: Any) -> HTMLResponse:
        html = self.env.get_template(template).render(**context)
        return HTMLResponse(html, status_code=status_code,
                            headers={"Cache-Control": "no-store",
                                     "Content-Security-Policy": CSP,
                                     "X-Frame-Options": "DENY",
                                     "Referrer-Policy": "same-origin"})

    def error(self, status_code: int, message: str) -> HTMLResponse:
        return self.render("error.html", status_code=status_code, message=message)

    def refusal(self, status_code: int, template: str = "error.html",
                **context: Any) -> HTMLResponse:
        """A page for a client not let in: it names no database."""
        return self.render(template, status_code=status_code, database=None, **context)


# Scripts and styles from the console itself only; no inline script.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "frame-ancestors 'none'; form-action 'self'; base-uri 'none'")


async def _form(request: Request) -> dict[str, str]:
    """A small url-encoded form (the only kind the console's pages send)."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise InvalidInput(f"the form is over {MAX_FORM_BYTES} bytes")
    fields = parse_qs(body.decode("utf-8", "replace"), max_num_fields=8)
    return {key: values[0] for key, values in fields.items()}


def _safe_next(target: str) -> str:
    """A redirect target on this console only."""
    if target.startswith("/") and not target.startswith("//") and "\\" not in target:
        return target
    return "/requests"


# ---- the application --------------------------------------------------------------------------


def create_app(
    settings: Settings,
    *,
    host: str = "127.0.0.1",
    cancel: Callable[[str], str] | None = None,
    broker_depth: Callable[[], int] | None = None,
) -> Starlette:
    """The console over ``settings``' database and events, answering to
    loopback names, ``host`` (the address it listens on) and
    ``settings.console_hosts``. ``cancel`` (default
    :func:`loomflow_worker.cancel_request`) and ``broker_depth`` (default: the
    Celery app's count of the queue's messages) run in a thread."""
    token = settings.console_token.get_secret_value() if settings.console_token else None
    gate = Gate(token, settings)
    pages = Pages(settings, admin.secrets_of(settings) + ([token] if token else []))
    db = _Database(settings)
    has_events = events_url(settings) is not None

    if cancel is None:
        def cancel(request_id: str) -> str:
            from .. import cancel_request

            result: str = cancel_request(request_id)
            return result

    if broker_depth is None:
        def broker_depth() -> int:
            from ..tasks.queues import queue_length

            return queue_length()

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        await db.open()
        try:
            yield
        finally:
            await db.close()

    async def home(_request: Request) -> Response:
        return RedirectResponse("/requests", status_code=303)

    async def requests_page(request: Request) -> Response:
        filters = data.Filters.parse(dict(request.query_params))
        rows = await data.list_requests(db.pool, filters)
        more = len(rows) > data.PAGE_SIZE
        rows = rows[: data.PAGE_SIZE]
        older = (urlencode(filters.query_string(before=rows[-1].seq)) if more and rows
                 else None)
        direct = await data.direct_runs(db.pool, filters) if filters.before is None else []
        return pages.render("requests.html", rows=rows, filters=filters, older=older,
                            first=filters.before is None, direct=direct,
                            newest=urlencode(filters.query_string(before=None)))

    async def usage_page(request: Request) -> Response:
        by = request.query_params.get("by") or "agent"
        since_text = request.query_params.get("since") or "30d"
        view = await data.usage(db.pool, by, parse_since(since_text))
        return pages.render("usage.html", view=view, groups=GROUPS, since_text=since_text)

    async def session_page(request: Request) -> Response:
        session_id = request.path_params["session_id"]
        scopes = await data.session_scopes(db.pool, session_id)
        return pages.render("session.html", session_id=session_id, scopes=scopes)

    async def run_page(request: Request) -> Response:
        request_id = request.path_params["request_id"]
        full = request.query_params.get("prompt") == "full"
        run = await data.get_request(db.pool, request_id, full_prompt=full)
        timeline = layout(run.attempts, run.journal, now=run.now,
                          running=run.status == "running")
        return pages.render(
            "run.html", run=run, timeline=timeline, full_prompt=full,
            has_events=has_events, cancelled=request.query_params.get("cancel"),
        )

    async def cancel_page(request: Request) -> Response:
        request_id = check_id("request", request.path_params["request_id"])
        if token is None:
            return pages.error(403, "Cancelling from the console needs a token: set "
                               "LOOMFLOW_WORKER_CONSOLE_TOKEN and restart the console.")
        form = await _form(request)
        presented = request.headers.get("x-console-token") or form.get("token")
        if not gate.accepts(presented):
            return pages.error(403, "Wrong or missing console token: nothing was cancelled.")
        await data.get_request(db.pool, request_id)  # a 404 for an unknown request
        status = await run_in_threadpool(cancel, request_id)
        log.info("console: cancel of request %s: %s", request_id, status,
                 extra={"action": "console_cancel", "request": request_id})
        return RedirectResponse(
            f"/runs/{_id_path(request_id)}?{urlencode({'cancel': status})}", status_code=303)

    async def events_stream(request: Request) -> Response:
        request_id = check_id("request", request.path_params["request_id"])
        if not has_events:
            return PlainTextResponse("live events are off (LOOMFLOW_WORKER_EVENTS)", 404)
        after = request.headers.get("last-event-id", "0-0")
        if not _stream_id(after):
            after = "0-0"
        run = await data.request_status(db.pool, request_id)

        async def stream() -> AsyncIterator[str]:
            last, follow = after, not run.finished
            while True:
                async for event in aiter_events(request_id, settings=settings, follow=follow,
                                                idle_timeout=5.0, after=last):
                    last = event.id
                    yield _sse("end" if event.is_end else "message", event.id, {
                        "attempt": event.attempt, "replayed": event.replayed,
                        "kind": event.kind, "at": _clock(event.at),
                        "summary": admin.shorten(describe_event(event.kind, event.data), 200),
                    }, pages.mask)
                    if event.is_end:
                        return
                now = await data.request_status(db.pool, request_id)
                if not follow or now.finished:
                    # No end event (the stream expired, or Redis dropped it):
                    # the ledger has the word.
                    yield _sse("end", last, {
                        "attempt": now.attempts_count, "replayed": False, "kind": "end",
                        "at": _clock(now.finished_at),
                        "summary": f"{now.status} (from the ledger; the live events hold "
                                   "no end)",
                    }, pages.mask)
                    return

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store",
                                          "X-Accel-Buffering": "no"})

    async def fleet_page(_request: Request) -> Response:
        view = await data.fleet(db.pool)
        try:
            depth: int | str = await run_in_threadpool(broker_depth)
        except Exception as exc:
            depth = f"unknown (the broker did not answer: {type(exc).__name__})"
        return pages.render("fleet.html", view=view, broker_depth=depth,
                            queue=settings.queue,
                            workers_window=admin.format_duration(data.WORKERS_WINDOW))

    async def login_page(request: Request) -> Response:
        if request.method == "GET":
            return pages.refusal(200, "login.html", next=_safe_next(
                request.query_params.get("next", "/requests")))
        form = await _form(request)
        target = _safe_next(form.get("next", "/requests"))
        if not gate.accepts(form.get("token")):
            return pages.refusal(401, "login.html", next=target, message="Wrong token.")
        response = RedirectResponse(target, status_code=303)
        gate.set_login(response, request)
        log.info("console: login from %s", request.client.host if request.client else "?",
                 extra={"action": "console_login"})
        return response

    async def logout_page(request: Request) -> Response:
        login = request.cookies.get(COOKIE, "")
        valid = gate.login_valid(login)
        if request.method == "GET":
            return pages.refusal(200, "logout.html",
                                 key=gate.logout_key(login) if valid else None,
                                 stale=bool(login) and not valid)
        form = await _form(request)
        # As for a cancel: a value a page of another site cannot know, here the
        # login's own logout key (or the token itself). A login no longer valid
        # opens nothing: it goes without one.
        presented = request.headers.get("x-console-token") or form.get("token")
        if valid and not (hmac.compare_digest(form.get("key", "").encode(),
                                              gate.logout_key(login).encode())
                          or gate.accepts(presented)):
            return pages.error(403, "The logout form's key is missing or wrong: still "
                               "logged in. Log out from the console's own page, /logout.")
        response = RedirectResponse("/login", status_code=303)
        gate.clear_login(response, request)
        return response

    async def not_found(_request: Request, exc: Exception) -> Response:
        return pages.error(404, str(exc))

    async def bad_input(_request: Request, exc: Exception) -> Response:
        return pages.error(400, str(exc))

    async def database(_request: Request, exc: Exception) -> Response:
        ours = driver_error(exc, "read from", settings.database_url.get_secret_value())
        if ours is None:
            raise exc
        return pages.error(503, f"{ours}. The page works again once it answers.")

    routes = [
        Route("/", home),
        Route("/requests", requests_page),
        Route("/sessions/{session_id:path}", session_page),
        Route("/runs/{request_id:path}/events", events_stream),
        Route("/runs/{request_id:path}/cancel", cancel_page, methods=["POST"]),
        Route("/runs/{request_id:run_id}", run_page),
        Route("/fleet", fleet_page),
        Route("/usage", usage_page),
        Route("/login", login_page, methods=["GET", "POST"]),
        Route("/logout", logout_page, methods=["GET", "POST"]),
        Mount("/static", StaticFiles(packages=[("loomflow_worker.console", "static")]),
              name="static"),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            admin.RequestNotFound: not_found,
            InvalidInput: bad_input,
            psycopg.Error: database,
        },
    )
    app.add_middleware(TokenRequired, gate=gate, pages=pages)
    # Outermost: a request for another host gets nothing, not even the login form.
    app.add_middleware(HostAllowed, listen=host, settings=settings, pages=pages)
    return app


class _Database:
    """The app's pool, made and opened by its lifespan (each server start)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._pool: data.Pool | None = None

    @property
    def pool(self) -> data.Pool:
        if self._pool is None:
            raise RuntimeError("the console's pool is not open (the app's lifespan opens it)")
        return self._pool

    async def open(self) -> None:
        self._pool = data.make_pool(self.settings)
        await self._pool.open(wait=False)

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()


def _sse(kind: str, event_id: str, payload: dict[str, Any], mask: Callable[[Any], Any]) -> str:
    text = mask(json.dumps(payload, separators=(",", ":")))
    return f"id: {event_id}\nevent: {kind}\ndata: {text}\n\n"
