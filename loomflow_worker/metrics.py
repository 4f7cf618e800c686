"""Prometheus metrics of a worker, served by its main process.

Pool children count in prometheus-client's multiprocess mode: each writes
to files under ``PROMETHEUS_MULTIPROC_DIR`` and the main process serves
the sum on ``LOOMFLOW_WORKER_METRICS_PORT``. prometheus-client is imported
only when metrics are on, after that directory is set, so an application
that merely enqueues keeps its own registry untouched.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from . import sockets

log = logging.getLogger(__name__)

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass
class Metrics:
    requests: Any
    attempts: Any
    parked: Any
    steps: Any
    journal_write: Any
    handoff: Any
    recovery: Any
    sweeper: Any
    loop_lag: Any
    loop_stalls: Any
    admitting: Any
    lock_queue: Any
    fenced: Any
    connections: Any
    refused: Any
    signals_dropped: Any
    backlog: Any
    version_waiting: Any
    model_waits: Any
    model_wait_seconds: Any
    model_tokens: Any
    model_cost: Any
    model_tokens_replayed: Any
    model_tokens_by_key: Any
    model_cost_by_key: Any


_metrics: Metrics | None = None


def enabled() -> bool:
    return _metrics is not None


def prepare_multiprocess_dir() -> str:
    """Make sure pool children (forked later) write their samples to one folder."""
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not folder:
        folder = tempfile.mkdtemp(prefix="loomflow-worker-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    return folder


def setup() -> Metrics:
    """Create the metrics (once per process)."""
    global _metrics
    if _metrics is None:
        from prometheus_client import Counter, Gauge, Histogram

        _metrics = Metrics(
            requests=Counter(
                "loomflow_worker_requests", "Requests that reached an outcome", ["status"]
            ),
            attempts=Counter("loomflow_worker_attempts", "Attempts started", ["kind"]),
            parked=Counter(
                "loomflow_worker_parked", "Deliveries parked to wait for their turn", ["reason"]
            ),
            steps=Counter("loomflow_worker_steps", "Journaled steps", ["how"]),
            journal_write=Histogram(
                "loomflow_worker_journal_write_seconds", "Journal write latency", buckets=_SECONDS
            ),
            handoff=Histogram(
                "loomflow_worker_handoff_seconds",
                "From a request's finish to the start of the next one of its session",
                buckets=_SECONDS,
            ),
            recovery=Histogram(
                "loomflow_worker_recovery_seconds",
                "From the last heartbeat of a crashed attempt to the start of the next",
                buckets=_SECONDS,
            ),
            sweeper=Counter("loomflow_worker_sweeper_actions", "Sweeper actions", ["action"]),
            loop_lag=Histogram(
                "loomflow_worker_loop_lag_seconds",
                "How late the event loop ran a ready callback (sampled every 0.1 s)",
                buckets=_SECONDS,
            ),
            loop_stalls=Counter(
                "loomflow_worker_loop_stalls", "Times the event loop was held for over a second"
            ),
            admitting=Gauge(
                "loomflow_worker_admitting",
                "1 while the process takes new requests from the broker, 0 while it is paused",
                multiprocess_mode="liveall",
            ),
            lock_queue=Gauge(
                "loomflow_worker_lock_queue_depth",
                "Work waiting for the process's lock connections",
                multiprocess_mode="liveall",
            ),
            fenced=Counter(
                "loomflow_worker_fenced_runs", "Runs fenced because their lock connection was lost"
            ),
            connections=Gauge(
                "loomflow_worker_connections",
                "TCP connections a worker process holds, by peer (postgres, redis, broker)",
                ["peer"], multiprocess_mode="liveall",
            ),
            refused=Counter(
                "loomflow_worker_messages_refused",
                "Task messages dropped unrun: a body of the wrong shape (malformed), or "
                "arguments that differ from their request's ledger row (mismatch)",
                ["reason"],
            ),
            signals_dropped=Counter(
                "loomflow_worker_signals_dropped",
                "Undelivered signals dropped at a send, past SIGNALS_PER_SCOPE of their scope",
            ),
            backlog=Gauge(
                "loomflow_worker_queued_requests",
                "Requests waiting to run, by queue, parked or not, from the runs ledger: "
                "set by the sweeper's leader each sweep, 0 on every other worker "
                "(sum or max it across workers)",
                ["queue"], multiprocess_mode="liveall",
            ),
            version_waiting=Gauge(
                "loomflow_worker_version_waiting",
                "Requests waiting for a worker of the version of their agent they are pinned "
                "to, by agent and version, from the runs ledger: set by the sweeper's leader, 0 "
                "on every other worker (sum or max it across workers)",
                ["agent", "version"], multiprocess_mode="liveall",
            ),
            model_waits=Counter(
                "loomflow_worker_model_waits",
                "Model calls that waited: for their key's budget (budget), or because the "
                "provider answered 429 or 529 (provider)",
                ["model_key", "reason"],
            ),
            model_wait_seconds=Counter(
                "loomflow_worker_model_wait_seconds",
                "Seconds model calls waited, by model key and reason",
                ["model_key", "reason"],
            ),
            model_tokens=Counter(
                "loomflow_worker_model_tokens",
                "Tokens of the model calls runs executed (billed), by agent, model key and "
                "kind (input, output, cache_read, cache_write); replayed calls are not counted",
                ["agent", "model_key", "kind"],
            ),
            model_cost=Counter(
                "loomflow_worker_model_cost_dollars",
                "What the model calls runs executed cost, in US dollars, by agent and model "
                "key (calls of a model with no known price count nothing here)",
                ["agent", "model_key"],
            ),
            model_tokens_replayed=Counter(
                "loomflow_worker_model_tokens_replayed",
                "Tokens of model calls answered from the journal instead of the provider "
                "(after a crash or a retry): not billed again",
                ["agent", "model_key"],
            ),
            model_tokens_by_key=Counter(
                "loomflow_worker_model_tokens_by_fairness_key",
                "loomflow_worker_model_tokens by fairness key (tenant) as well; only with "
                "LOOMFLOW_WORKER_USAGE_METRICS_BY_KEY",
                ["agent", "model_key", "kind", "fairness_key"],
            ),
            model_cost_by_key=Counter(
                "loomflow_worker_model_cost_dollars_by_fairness_key",
                "loomflow_worker_model_cost_dollars by fairness key (tenant) as well; only with "
                "LOOMFLOW_WORKER_USAGE_METRICS_BY_KEY",
                ["agent", "model_key", "fairness_key"],
            ),
        )
    return _metrics


#: The queues this process reported a backlog for (zeroed once it stops leading).
_backlog_queues: set[str] = set()


def report_backlog(queued: dict[str, int]) -> None:
    """Set the backlog gauge to ``queued`` (queue name -> queued requests),
    and to 0 for a queue reported before and absent now (emptied, or this
    process no longer leads the sweep), when metrics are on."""
    if _metrics is None:
        return
    for queue in _backlog_queues - set(queued):
        _metrics.backlog.labels(queue=queue).set(0)
    for queue, count in queued.items():
        _metrics.backlog.labels(queue=queue).set(count)
    _backlog_queues.update(queued)


#: The (agent, version) pairs this process reported waiting requests for.
_waiting_versions: set[tuple[str, str]] = set()


def report_version_waiting(waiting: dict[tuple[str, str], int]) -> None:
    """Set the gauge of requests waiting for a version to ``waiting`` ((agent,
    version) -> requests), and to 0 for a pair reported before and absent now,
    when metrics are on."""
    if _metrics is None:
        return
    for agent, version in _waiting_versions - set(waiting):
        _metrics.version_waiting.labels(agent=agent, version=version).set(0)
    for (agent, version), count in waiting.items():
        _metrics.version_waiting.labels(agent=agent, version=version).set(count)
    _waiting_versions.update(waiting)


def observe_connections(ports: dict[int, str]) -> None:
    """Count this process's connections to each peer of ``ports`` (from
    :func:`~loomflow_worker.sockets.peer_ports`) into its gauge, when metrics are on."""
    if _metrics is None:
        return
    for peer, count in sockets.connections_by_peer(ports).items():
        _metrics.connections.labels(peer=peer).set(count)


def get() -> Metrics | None:
    return _metrics


def count_refused(reason: str) -> None:
    """Count a task message dropped unrun (``reason``: malformed, mismatch)."""
    if _metrics is not None:
        _metrics.refused.labels(reason).inc()


def count_signals_dropped(dropped: int) -> None:
    """Count undelivered signals dropped past their scope's bound."""
    if _metrics is not None:
        _metrics.signals_dropped.inc(dropped)


def serve(port: int) -> None:
    """Serve the fleet member's metrics (all its processes) on ``port``."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    start_http_server(port, registry=registry)
    log.info("metrics on port %d", port, extra={"action": "metrics_serving"})


def process_exited(pid: int) -> None:
    if _metrics is not None:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]
