"""Who may look at the console: the hosts it answers, loopback, the token and
the login cookie.

A request must name the console by a host it serves (its Host header): a
loopback name or address, its ``--host``, or one of ``console_hosts``. A page
of another site whose name was rebound to the console's address names that
site, and gets 400 and no data.

A loopback client may look without the token (unless ``console_require_token``);
any other presents it, as a bearer header or once in the login form. The login
cookie holds no token: it is the login's time and a random nonce, signed with
the token (HMAC), good for ``console_login_lifetime`` seconds; a new token ends
every login.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re
import secrets
import time
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ..durations import shown
from ..settings import Settings

log = logging.getLogger(__name__)

COOKIE = "lfw_console"
_LOGIN = b"loomflow-worker console login\x00"
_LOGOUT = b"loomflow-worker console logout\x00"
#: How far ahead of this clock a login's time may be (another console of the fleet).
_SKEW = 60


class RefusalPages(Protocol):
    """What the gates show a client they do not let in (:class:`.app.Pages`,
    which uses the gates: a protocol here keeps the two modules apart)."""

    def refusal(self, status_code: int, template: str = ..., **context: Any) -> Response: ...


def is_loopback(scope: Scope) -> bool:
    """Whether the request came from this host, and not through a proxy (a
    proxy on this host would make every client look local)."""
    client = scope.get("client")
    if not client:
        return False
    try:
        address = ipaddress.ip_address(client[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if not address.is_loopback:
        return False
    headers = {name for name, _ in scope.get("headers", ())}
    return not headers & {b"forwarded", b"x-forwarded-for", b"x-real-ip"}


# ---- the hosts it answers ---------------------------------------------------------------------

_HOST_HEADER = re.compile(
    r"(?:\[(?P<v6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9_.-]+))(?::[0-9]{1,5})?", re.I | re.ASCII)
_WILDCARD = ("0.0.0.0", "::", "")


def host_of(header: str) -> str | None:
    """The host a Host header names (lower case, no port, no trailing dot, an
    IPv6 address without its brackets), or ``None`` for one that names none."""
    found = _HOST_HEADER.fullmatch(header.strip())
    if found is None:
        return None
    if found["v6"] is not None:
        try:
            return str(ipaddress.IPv6Address(found["v6"]))
        except ValueError:
            return None
    return found["name"].lower().rstrip(".") or None


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


class HostAllowed:
    """ASGI middleware: a request whose Host header names none of the hosts the
    console serves gets 400 and an error page. Served: ``localhost`` and
    loopback addresses, the ``--host`` it listens on (when that is 0.0.0.0 or
    ``::``, any address: an address can't be rebound, only a name), and
    ``settings.console_hosts``; any port."""

    def __init__(
        self, app: ASGIApp, *, listen: str, settings: Settings, pages: RefusalPages
    ) -> None:
        self.app = app
        self.pages = pages
        self.any_address = listen.strip("[]") in _WILDCARD
        named = [listen, *settings.console_hosts]
        self.names = {"localhost"} | {h for h in map(_bare, named) if h}

    def serves(self, host: str | None) -> bool:
        if host is None:
            return False
        address = _address(host)
        if address is not None and (address.is_loopback or self.any_address):
            return True
        return host in self.names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = Request(scope).headers.get("host", "")
        if self.serves(host_of(header)):
            await self.app(scope, receive, send)
            return
        log.warning("console: refused a request for the host %s", shown(header),
                    extra={"action": "console_host_refused"})
        response = self.pages.refusal(400, message=(
            f"This console does not answer to the host {shown(header)} (the request's "
            "Host header). It answers to localhost, its loopback addresses, the --host it "
            "listens on and the names in LOOMFLOW_WORKER_CONSOLE_HOSTS (comma-separated): "
            "add the name you reach it by there. A page of another site whose name points "
            "at this address is refused this way."))
        await response(scope, receive, send)


def _bare(host: str) -> str | None:
    """A configured host (``--host`` or a setting's entry) as :func:`host_of` gives it."""
    return host_of(f"[{host}]" if ":" in host and not host.startswith("[") else host)


# ---- the token and the login ------------------------------------------------------------------


class Gate:
    """The console token, the login cookie, and what they let in."""

    def __init__(self, token: str | None, settings: Settings) -> None:
        self.token = token
        self.lifetime = settings.console_login_lifetime
        self.require_token = settings.console_require_token
        self.trust_proxy = settings.console_trust_proxy

    def _sign(self, purpose: bytes, text: str) -> str:
        assert self.token is not None
        return hmac.new(self.token.encode(), purpose + text.encode(), hashlib.sha256).hexdigest()

    def new_login(self, now: float | None = None) -> str:
        """A login cookie's value: its time, a random nonce and their signature."""
        body = f"{int(time.time() if now is None else now)}.{secrets.token_urlsafe(16)}"
        return f"{body}.{self._sign(_LOGIN, body)}"

    def login_valid(self, value: str, now: float | None = None) -> bool:
        """Whether a login cookie was signed with this token and is younger than
        its lifetime."""
        if self.token is None:
            return False
        body, _, signature = value.rpartition(".")
        issued = body.partition(".")[0]
        if not issued.isascii() or not issued.isdigit() or len(issued) > 12:
            return False
        if not hmac.compare_digest(signature.encode(), self._sign(_LOGIN, body).encode()):
            return False
        age = (time.time() if now is None else now) - int(issued)
        return -_SKEW <= age < self.lifetime

    def logout_key(self, login: str) -> str:
        """What the logout form carries for ``login``: a value a page of another
        site cannot know (the cookie is HttpOnly, the key is signed with the token)."""
        return self._sign(_LOGOUT, login)

    def accepts(self, presented: str | None) -> bool:
        if self.token is None or not presented:
            return False
        return hmac.compare_digest(presented.encode(), self.token.encode())

    def lets_in(self, scope: Scope) -> bool:
        if is_loopback(scope) and not self.require_token:
            return True
        if self.token is None:
            return False
        request = Request(scope)
        bearer = request.headers.get("authorization", "")
        if bearer.lower().startswith("bearer ") and self.accepts(bearer[7:].strip()):
            return True
        return self.login_valid(request.cookies.get(COOKIE, ""))

    def over_tls(self, request: Request) -> bool:
        """Whether the client reached the console over TLS: its own, or a proxy's
        that says so in X-Forwarded-Proto (believed with ``console_trust_proxy``)."""
        if request.url.scheme == "https":
            return True
        forwarded = request.headers.get("x-forwarded-proto", "").split(",")[0]
        return self.trust_proxy and forwarded.strip().lower() == "https"

    def set_login(self, response: Response, request: Request) -> None:
        response.set_cookie(COOKIE, self.new_login(), max_age=max(1, int(self.lifetime)),
                            path="/", httponly=True, samesite="strict",
                            secure=self.over_tls(request))

    def clear_login(self, response: Response, request: Request) -> None:
        response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict",
                               secure=self.over_tls(request))


class TokenRequired:
    """ASGI middleware: a client the gate does not let in gets 401 and the login
    form (403 when no token is set: then only loopback may look)."""

    OPEN = ("/login", "/logout", "/static/")

    def __init__(self, app: ASGIApp, gate: Gate, pages: RefusalPages) -> None:
        self.app = app
        self.gate = gate
        self.pages = pages

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.gate.lets_in(scope) or (
            self.gate.token is not None and scope["path"].startswith(self.OPEN)
        ):
            await self.app(scope, receive, send)
            return
        if self.gate.token is None:
            response: Response = self.pages.refusal(
                403, message="This console answers loopback clients only: it has no token "
                "(LOOMFLOW_WORKER_CONSOLE_TOKEN) for others to present.")
        else:
            path = scope.get("raw_path") or scope["path"].encode()
            query = scope.get("query_string", b"")
            target = (path + (b"?" + query if query else b"")).decode("latin-1")
            stale = COOKIE in Request(scope).cookies
            response = self.pages.refusal(
                401, "login.html", next=target,
                message="Your login has expired (or the token changed): log in again."
                if stale else None)
        await response(scope, receive, send)
