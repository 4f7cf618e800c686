"""Which Celery pools a worker accepts, and what it makes of them (no services)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.concurrency.solo import TaskPool as SoloPool
from celery.concurrency.thread import TaskPool as ThreadPool
from click.testing import CliRunner

from loomflow_worker.cli import main
from loomflow_worker.tasks import hooks
from loomflow_worker.tasks.dispatch import dispatch_turns
from loomflow_worker.worker.pool import RunPool, pool_name
from loomflow_worker.worker.state import PROCESS


@pytest.fixture(autouse=True)
def process(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a worker's start sets in the process's state is undone after the test."""
    for name in ("node", "slots", "context", "publish_turns"):
        monkeypatch.setattr(PROCESS, name, getattr(PROCESS, name))


@pytest.mark.parametrize(
    ("pool", "name"),
    [(ThreadPool, "threads"), (RunPool, "threads"), (PreforkPool, "prefork"),
     (SoloPool, "solo"), ("gevent", "gevent"), ("eventlet", "eventlet"),
     ("celery.concurrency.gevent:TaskPool", "gevent")],
)
def test_pool_names(pool: object, name: str) -> None:
    assert pool_name(pool) == name


@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_a_worker_refuses_gevent_and_eventlet_and_says_what_to_use(pool: str) -> None:
    sender = SimpleNamespace(pool_cls=pool, concurrency=50)
    with pytest.raises(SystemExit) as refused:
        hooks._prepare_worker(sender=sender)
    message = str(refused.value)
    assert f"the {pool} pool is not supported" in message
    assert "loomflow-worker worker" in message and "-P threads" in message


@pytest.mark.parametrize(
    ("options", "attributes", "named"),
    [({"autoscale": "8,2"}, {}, "--autoscale"),
     ({}, {"max_tasks_per_child": 3}, "--max-tasks-per-child (worker_max_tasks_per_child)"),
     ({}, {"max_memory_per_child": 200000},
      "--max-memory-per-child (worker_max_memory_per_child)")],
)
def test_the_threads_pool_refuses_what_only_child_processes_can_do(
    options: dict[str, object], attributes: dict[str, object], named: str
) -> None:
    sender = SimpleNamespace(pool_cls=ThreadPool, concurrency=50, options=options,
                             max_tasks_per_child=None, max_memory_per_child=None)
    vars(sender).update(attributes)
    with pytest.raises(SystemExit) as refused:
        hooks._prepare_worker(sender=sender)
    message = str(refused.value)
    assert message.startswith(f"loomflow-worker: {named} is not supported on the threads pool")
    assert "\n" not in message
    assert sender.pool_cls is ThreadPool


def test_prefork_keeps_its_recycling_options() -> None:
    sender = SimpleNamespace(pool_cls=PreforkPool, concurrency=2, options={"autoscale": "4,1"},
                             max_tasks_per_child=3, max_memory_per_child=200000)
    hooks._prepare_worker(sender=sender)
    assert sender.pool_cls is PreforkPool


def test_the_threads_pool_carries_its_concurrency_in_runs() -> None:
    sender = SimpleNamespace(pool_cls=ThreadPool, concurrency=150)
    hooks._prepare_worker(sender=sender)
    assert issubclass(sender.pool_cls, RunPool)
    assert PROCESS.slots == 150
    assert PROCESS.worker_context().slots == 150


def test_a_worker_publishes_fair_turns_from_its_loop_once_it_boots() -> None:
    """Set once as the worker boots, not per attempt: every context the
    process makes publishes the requests whose fair turn came in batches."""
    made_before = PROCESS.worker_context()
    hooks._prepare_worker(sender=SimpleNamespace(pool_cls=ThreadPool, concurrency=2))
    assert PROCESS.publish_turns is dispatch_turns
    assert made_before.publish_turns is dispatch_turns
    PROCESS.context = None  # the settings changed: a new context
    assert PROCESS.worker_context().publish_turns is dispatch_turns


def test_prefork_runs_one_per_child() -> None:
    sender = SimpleNamespace(pool_cls=PreforkPool, concurrency=4)
    hooks._prepare_worker(sender=sender)
    assert sender.pool_cls is PreforkPool
    assert PROCESS.slots is None


def test_the_cli_offers_only_pools_that_work() -> None:
    result = CliRunner().invoke(main, ["worker", "-P", "gevent"])
    assert result.exit_code == 2
    assert "'gevent' is not one of 'threads', 'prefork', 'solo'" in result.output


def test_a_pool_stops_a_task_s_run_with_the_callback_it_was_made_with() -> None:
    stopped: list[str] = []
    pool_cls = RunPool.stopping_with(lambda request_id: stopped.append(request_id) or True)
    pool = pool_cls(2)
    pool.start()
    try:
        done = threading.Event()
        handle = pool.apply_async(done.wait, correlation_id="r1")
        handle.terminate()
        assert stopped == ["r1"]
        done.set()
    finally:
        pool.stop()
    # Without a callback, terminate does nothing, as in Celery's threads pool.
    plain = RunPool(1)
    plain.start()
    try:
        plain.apply_async(lambda: None, correlation_id="r2").terminate()
    finally:
        plain.stop()
    assert stopped == ["r1"]
