"""A worker process holds a few connections to Redis and Postgres, whatever its concurrency.

Counted from the OS (the process's sockets in /proc), while a ``-c 200``
threads-pool worker carries a few hundred requests, and as its metrics
report them."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from loomflow_worker import sockets
from loomflow_worker.settings import Settings
from loomflow_worker.tasks import run_agent
from tests.needs import POSTGRES_PORT, REDIS_PORT

from .celery_harness import Fleet
from .helpers import scrape
from .services import free_port

pytestmark = pytest.mark.slow

CONCURRENCY = 200
SESSIONS = 150
REQUESTS = 2 * SESSIONS  # the second of each session is handed it: a publish
PEERS = {REDIS_PORT: "redis", POSTGRES_PORT: "postgres"}

#: Celery's own (the task consumer's channel, the control channel, the worker
#: heartbeat: 6), the run events (1), the result backend (2) and the
#: producers the threads publish with (2 broker connections, 2 sockets each):
#: 13, and one for a connection being replaced.
REDIS_MOST = 14
#: The lock connections and the pool, the sweeper's, and a few for the
#: ledger's rare writes outside a run.
POSTGRES_MOST = Settings().lock_connections + Settings().pool_max_size + 3


@dataclass
class Peaks:
    """The most connections to each peer seen by :func:`sampling`."""

    seen: dict[str, int] = field(default_factory=dict)
    samples: int = 0


@contextmanager
def sampling(pid: int) -> Iterator[Peaks]:
    """Count process ``pid``'s connections every 50 ms until the block ends."""
    peaks = Peaks()
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            for peer, count in sockets.connections_by_peer(PEERS, pid).items():
                peaks.seen[peer] = max(peaks.seen.get(peer, 0), count)
            peaks.samples += 1

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peaks
    finally:
        done.set()
        thread.join(timeout=10)


@pytest.mark.slow
def test_a_worker_at_concurrency_200_holds_a_few_connections(fleet: Fleet) -> None:
    port = free_port()
    # Model calls of 3 s: runs pile up to about a session's worth at once even
    # when a busy machine enqueues slowly.
    worker = fleet.start("w1", CONCURRENCY, cli=True, pool="threads", TEST_MODEL_LATENCY="3.0",
                         LOOMFLOW_WORKER_METRICS_PORT=str(port))
    with sampling(worker.pid) as peaks:
        sent = [run_agent.delay(f"hello {i}", f"s{i % SESSIONS}", agent="slow-model")
                for i in range(REQUESTS)]
        outputs = [result.get(timeout=180) for result in sent]
        threads = len(os.listdir(f"/proc/{worker.pid}/task"))
    assert all(output["output"] == "done: " for output in outputs), outputs[:3]
    # The threads pool really carried about a session's worth of runs at once.
    assert threads >= SESSIONS / 2, f"only {threads} threads: the pool was never busy"
    print(f"peak connections {peaks.seen} over {peaks.samples} samples, {threads} threads")
    assert peaks.samples > 10
    assert peaks.seen["redis"] <= REDIS_MOST, peaks.seen
    assert 0 < peaks.seen["postgres"] <= POSTGRES_MOST, peaks.seen
    metric = {name.split("peer=")[1][1:].split('"')[0]: value
              for name, value in scrape(port).items()
              if name.startswith("loomflow_worker_connections{")}
    print(f"the metric says {metric}")
    assert 0 < metric["redis"] <= REDIS_MOST, metric
    assert 0 < metric["postgres"] <= POSTGRES_MOST, metric
