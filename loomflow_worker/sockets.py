"""A process's TCP connections, counted by the port of their peer, as the OS has them.

A worker process keeps a small fixed number of connections to Postgres and
Redis whatever its ``--concurrency``; this is how that is measured (by the
worker's metrics, the benchmarks and the tests): each of the process's
socket descriptors (``/proc/<pid>/fd``) looked up in the kernel's TCP tables
(``/proc/<pid>/net/tcp`` and ``tcp6``). Linux only: elsewhere it counts
nothing.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import psycopg.conninfo

if TYPE_CHECKING:
    from .settings import Settings

#: TCP states of the kernel's tables that are no connection: LISTEN (0A).
_NOT_CONNECTED = {"0A"}


def _socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets process ``pid`` holds open."""
    inodes = set()
    folder = Path(f"/proc/{pid}/fd")
    try:
        entries = list(folder.iterdir())
    except OSError:
        return set()
    for entry in entries:
        try:
            target = os.readlink(entry)
        except OSError:
            continue  # closed since the listing
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _peer_ports(pid: int, inodes: set[str]) -> dict[str, int]:
    """The peer port of each TCP connection among ``inodes``, by inode."""
    found = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            if len(fields) < 10 or fields[9] not in inodes or fields[3] in _NOT_CONNECTED:
                continue
            found[fields[9]] = int(fields[2].rsplit(":", 1)[1], 16)
    return found


def connections(pid: int | None = None) -> Counter[int]:
    """How many TCP connections process ``pid`` (default: this one) holds, by
    the port of their peer (6379: Redis, 5432: Postgres, 5672: RabbitMQ).

    The kernel lists its TCP table in pieces, so a socket opened or closed
    elsewhere meanwhile can make one listing skip a line: a second listing
    looks for what the first did not find, and a socket counts once."""
    pid = os.getpid() if pid is None else pid
    inodes = _socket_inodes(pid)
    found = _peer_ports(pid, inodes)
    if len(found) < len(inodes):  # some are not TCP, or a line was skipped
        found |= _peer_ports(pid, inodes - set(found))
    return Counter(found.values())


#: The port of each kind of peer when its URL names none.
DEFAULT_PORTS = {"postgresql": 5432, "postgres": 5432, "redis": 6379, "rediss": 6379,
                 "amqp": 5672, "amqps": 5671, "pyamqp": 5672}


def peer_ports(settings: Settings) -> dict[int, str]:
    """Which peer each port is, for a worker on ``settings``: ``postgres``,
    ``redis`` (result backend, events, and the broker when it is Redis) or
    ``broker`` (any other)."""
    ports: dict[int, str] = {}
    for url, name in ((settings.broker_url, "broker"), (settings.result_backend, "redis"),
                      (settings.events_url, "redis")):
        if url is not None:
            port = _port(url.get_secret_value())
            if port is not None:
                scheme = url.get_secret_value().split("://", 1)[0]
                ports[port] = "redis" if scheme.startswith("redis") else name
    conninfo = psycopg.conninfo.conninfo_to_dict(settings.database_url.get_secret_value())
    for listed in str(conninfo.get("port") or DEFAULT_PORTS["postgres"]).split(","):
        if listed.strip().isdigit():
            ports[int(listed)] = "postgres"
    return ports


def _port(url: str) -> int | None:
    try:
        parts = urlsplit(url)
        return parts.port or DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return None


def connections_by_peer(ports: dict[int, str], pid: int | None = None) -> dict[str, int]:
    """How many TCP connections process ``pid`` (default: this one) holds to
    each peer of ``ports`` (:func:`peer_ports`); every peer appears, with 0
    when it has none."""
    found = dict.fromkeys(ports.values(), 0)
    for port, count in connections(pid).items():
        if port in ports:
            found[ports[port]] += count
    return found
