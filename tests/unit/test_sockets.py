"""A process's TCP connections counted by peer, from /proc (no services: a
listener of the test's own)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from pydantic import SecretStr

from loomflow_worker import sockets
from loomflow_worker.settings import Settings


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server


def test_connections_count_this_process_sockets_by_the_port_of_their_peer(
    listener: socket.socket,
) -> None:
    port = int(listener.getsockname()[1])
    assert sockets.connections()[port] == 0  # a listening socket is no connection
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    accepted = [listener.accept()[0] for _ in clients]
    try:
        assert sockets.connections()[port] == 3
        assert sockets.connections_by_peer({port: "service"}) == {"service": 3}
    finally:
        for sock in clients + accepted:
            sock.close()
    assert sockets.connections()[port] == 0
    assert sockets.connections_by_peer({port: "service"}) == {"service": 0}


def test_each_port_of_the_settings_is_named_for_its_peer() -> None:
    defaults = Settings(
        database_url=SecretStr("postgresql://app@db/app"),
        broker_url=SecretStr("redis://cache/0"),
        result_backend=SecretStr("redis://cache/1"),
    )
    assert sockets.peer_ports(defaults) == {6379: "redis", 5432: "postgres"}
    other = Settings(
        database_url=SecretStr("host=db port=6432 dbname=app user=app"),
        broker_url=SecretStr("amqp://guest:guest@mq//"),
        result_backend=SecretStr("redis://cache:6380/1"),
    )
    assert sockets.peer_ports(other) == {5672: "broker", 6380: "redis", 6432: "postgres"}
