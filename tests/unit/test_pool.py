"""Which Celery pools a worker accepts, and what it makes of them (no services)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.concurrency.solo import TaskPool as SoloPool
from celery.concurrency.thread import TaskPool as ThreadPool
from click.testing import CliRunner

from loomflow_worker.cli import main
from loomflow_worker.tasks import application
from loomflow_worker.tasks.pool import RunPool, pool_name


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
        application._prepare_worker(sender=sender)
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
        application._prepare_worker(sender=sender)
    message = str(refused.value)
    assert message.startswith(f"loomflow-worker: {named} is not supported on the threads pool")
    assert "\n" not in message
    assert sender.pool_cls is ThreadPool


def test_prefork_keeps_its_recycling_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(application, "_state", dict(application._state))
    sender = SimpleNamespace(pool_cls=PreforkPool, concurrency=2, options={"autoscale": "4,1"},
                             max_tasks_per_child=3, max_memory_per_child=200000)
    application._prepare_worker(sender=sender)
    assert sender.pool_cls is PreforkPool


def test_the_threads_pool_carries_its_concurrency_in_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(application, "_state", dict(application._state))
    sender = SimpleNamespace(pool_cls=ThreadPool, concurrency=150)
    application._prepare_worker(sender=sender)
    assert sender.pool_cls is RunPool
    assert application._state["slots"] == 150
    assert application._context().slots == 150


def test_prefork_runs_one_per_child(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(application, "_state", dict(application._state))
    sender = SimpleNamespace(pool_cls=PreforkPool, concurrency=4)
    application._prepare_worker(sender=sender)
    assert sender.pool_cls is PreforkPool
    assert "slots" not in application._state


def test_the_cli_offers_only_pools_that_work() -> None:
    result = CliRunner().invoke(main, ["worker", "-P", "gevent"])
    assert result.exit_code == 2
    assert "'gevent' is not one of 'threads', 'prefork', 'solo'" in result.output
