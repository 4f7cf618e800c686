"""Serving the console with uvicorn: in the foreground (the CLI) or on a thread
(the demo, the tests), on a socket bound here so a taken port or a host
off loopback without a token is refused with a clear message."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from types import TracebackType
from typing import Any

import uvicorn
from pydantic import SecretStr

from ..defaults import CONSOLE_PORT
from ..runtime.errors import InvalidInput
from ..settings import MIN_TOKEN_LENGTH, Settings
from .app import create_app


def _addresses(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise InvalidInput(f"can't resolve the host {host!r} to bind the console to: {exc}; "
                           "give an address such as 127.0.0.1") from exc
    return [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]


def check_bind(host: str, token: SecretStr | None) -> None:
    """Refuse to listen off loopback without a token: anyone who can reach the
    port would read every request of the fleet."""
    if token is not None and token.get_secret_value():
        return
    off = [str(a) for a in _addresses(host) if not a.is_loopback]
    if off:
        raise InvalidInput(
            f"--host {host} ({', '.join(off)}) is not a loopback address, and the console has "
            f"no token: set LOOMFLOW_WORKER_CONSOLE_TOKEN ({MIN_TOKEN_LENGTH}+ characters; "
            "clients off this host then present it) or keep the default --host 127.0.0.1"
        )


def _bind(host: str, port: int) -> socket.socket:
    address = _addresses(host)[0]
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((str(address), port))
    except OSError as exc:
        sock.close()
        raise InvalidInput(f"can't listen on {host}:{port}: {exc.strerror or exc}; "
                           "choose another --port") from exc
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def _server(settings: Settings, host: str, log_level: str, **app_kwargs: Any) -> uvicorn.Server:
    config = uvicorn.Config(
        create_app(settings, host=host, **app_kwargs),
        log_level=log_level,
        # The console decides who is local itself; forwarded headers are never trusted.
        proxy_headers=False,
        server_header=False,
        timeout_graceful_shutdown=2,
    )
    return uvicorn.Server(config)


def serve(
    settings: Settings,
    *,
    host: str = "127.0.0.1",
    port: int = CONSOLE_PORT,
    announce: Any = print,
) -> None:
    """Serve the console until interrupted (Ctrl-C, SIGTERM)."""
    check_bind(host, settings.console_token)
    sock = _bind(host, port)
    server = _server(settings, host, "info")
    announce(f"loomflow-worker console on {_url(sock)} (Ctrl-C to stop)")
    server.run(sockets=[sock])


class BackgroundConsole:
    """The console on a thread of this process: ``with BackgroundConsole(settings)
    as console: ... console.url``. Port 0 takes a free port."""

    def __init__(
        self, settings: Settings, *, host: str = "127.0.0.1", port: int = 0, **app_kwargs: Any
    ) -> None:
        check_bind(host, settings.console_token)
        self._sock = _bind(host, port)
        self.url = _url(self._sock)
        self._server = _server(settings, host, "warning", **app_kwargs)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]},
            name="loomflow-worker console", daemon=True,
        )

    def start(self, timeout: float = 20) -> BackgroundConsole:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the console did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> BackgroundConsole:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
