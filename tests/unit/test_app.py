"""The Celery app is configured once; other settings get a new app, which
``app``, ``run_agent`` and ``resume_agent`` lead to (no services: nothing here
connects)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from celery.app.utils import find_app
from pydantic import SecretStr

from loomflow_worker import tasks
from loomflow_worker.tasks import application
from loomflow_worker.worker.connections import (
    PUBLISH_CONNECTIONS,
    PUBLISH_WAIT,
    RESULT_CONNECTIONS,
    WorkerRedisBackend,
    bound_worker_connections,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def restored() -> Iterator[None]:
    before = tasks.settings()
    try:
        yield
    finally:
        tasks.configure(before)


def test_new_settings_get_a_new_app_with_its_own_backend_and_tasks(restored: None) -> None:
    first = application.current_app()
    first_backend = first.backend
    current = tasks.settings()
    tasks.configure(current.model_copy(update={
        "queue": "elsewhere", "redis_key_prefix": "elsewhere:",
        "result_backend": SecretStr("redis://127.0.0.1:6399/7"),
    }))
    second = application.current_app()
    assert second is not first
    assert tasks.app.conf.task_default_queue == "elsewhere"
    assert tasks.run_agent.app is second and tasks.resume_agent.app is second
    # The result backend is the new settings', not one cached from the first.
    assert second.backend is not first_backend
    assert second.backend.connparams["port"] == 6399 and second.backend.connparams["db"] == 7
    assert second.conf.result_backend_transport_options["global_keyprefix"] == "elsewhere:"


def test_new_settings_forget_the_limits_read_from_the_fleet_before(restored: None) -> None:
    """An enqueue withholds requests on the per_key and fair_queue limits it
    read (for a few seconds) from its fleet's database: another fleet's are
    read again at its first enqueue, not taken from the one before."""
    from loomflow_worker.execution import ledger

    assert ledger.HOLD_LIMITS.get(lambda: (1, 10)) == (1, 10)
    assert ledger.HOLD_LIMITS.get(lambda: (None, None)) == (1, 10)  # kept
    tasks.configure(tasks.settings().model_copy(update={"queue": "elsewhere"}))
    assert ledger.HOLD_LIMITS.get(lambda: (None, None)) == (None, None)


def test_configuring_again_with_the_same_settings_keeps_the_app(restored: None) -> None:
    first = application.current_app()
    tasks.configure(tasks.settings().model_copy())
    assert application.current_app() is first


def _in_a_new_process(code: str, **env: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                          capture_output=True, text=True, check=True, timeout=60)
    return done.stdout.strip()


@pytest.mark.slow
def test_importing_the_package_makes_no_app_until_one_is_used() -> None:
    shown = _in_a_new_process(
        "import loomflow_worker.tasks as tasks\n"
        "from loomflow_worker.worker.state import PROCESS\n"
        "print(PROCESS.app is None and PROCESS.settings is None)\n"
        "print(tasks.run_agent.name, PROCESS.app is not None, PROCESS.settings is not None)"
    )
    assert shown.splitlines() == ["True", "loomflow_worker.run_agent True True"]


@pytest.mark.slow
def test_settings_the_environment_gets_wrong_fail_when_used_not_at_import() -> None:
    shown = _in_a_new_process(
        "import loomflow_worker.tasks as tasks\n"
        "from loomflow_worker.runtime.errors import InvalidInput\n"
        "print(tasks.app.conf.broker_url)\n"
        "try:\n    tasks.settings()\nexcept InvalidInput as exc:\n    print(exc)",
        LOOMFLOW_WORKER_CONCURRENCY="many",
    )
    defaults, error = shown.splitlines()
    assert defaults == "None"  # Celery's defaults: no broker of the package's
    assert error.startswith("the LOOMFLOW_WORKER_* settings are invalid: concurrency:")


def test_the_worker_finds_the_app_and_it_retries_storing_results_briefly() -> None:
    found = find_app("loomflow_worker.tasks")
    assert isinstance(found, Celery)
    assert found.tasks[application.RUN_AGENT].name == tasks.run_agent.name
    options = found.conf.result_backend_transport_options
    assert options["retry_policy"] == application.STORE_RETRY


def test_a_worker_process_shares_one_result_backend_on_a_few_connections() -> None:
    """What a worker sets at start: every thread gets the same backend, on a
    bounded pool that makes a thread wait, with the app's store retries;
    publishing goes through a bounded pool of producers."""
    worker_app = application.make_app(tasks.settings())
    per_thread: list[object] = []
    thread = threading.Thread(target=lambda: per_thread.append(worker_app.backend))
    thread.start()
    thread.join()
    assert per_thread[0] is not worker_app.backend  # Celery's own: one per thread

    bound_worker_connections(worker_app)
    seen: list[object] = []
    threads = [threading.Thread(target=lambda: seen.append(worker_app.backend))
               for _ in range(3)]
    for started in threads:
        started.start()
    for started in threads:
        started.join()
    backend = worker_app.backend
    assert isinstance(backend, WorkerRedisBackend)
    assert all(other is backend for other in seen)
    pool = backend.client.connection_pool  # made now, connected on first use
    assert isinstance(pool, redis.BlockingConnectionPool)
    assert pool.max_connections == RESULT_CONNECTIONS
    assert backend.retry_policy["max_retries"] == application.STORE_RETRY["max_retries"]
    assert worker_app.conf.broker_pool_limit == PUBLISH_CONNECTIONS
    assert worker_app.conf.broker_pool_acquire_timeout == PUBLISH_WAIT


@pytest.mark.slow
def test_a_worker_bounds_its_producers_before_any_thread_publishes() -> None:
    """Kombu's pools take the worker's limit at start, not on the first
    publish, when threads publishing at once may hold more producers than
    it (the resize then fails and the publish is lost). In a process of its
    own: kombu's pools are global."""
    script = (
        "import kombu\n"
        "from loomflow_worker import tasks\n"
        "from loomflow_worker.tasks import application\n"
        "from loomflow_worker.worker import connections\n"
        "app = application.make_app(tasks.settings())\n"
        "connections.bound_worker_connections(app)\n"
        "connections.bound_producers_now(app)\n"
        "print(kombu.pools.get_limit(), app.amqp._producer_pool.limit)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(PUBLISH_CONNECTIONS)] * 2, done.stdout


def test_a_worker_leaves_a_result_backend_other_than_redis_as_celery_makes_it() -> None:
    plain = application.make_app(None)  # Celery's defaults: results disabled
    bound_worker_connections(plain)
    assert type(plain.backend).__name__ == "DisabledBackend"


@pytest.mark.slow
def test_celery_config_module_options_apply_and_the_readme_names_those_that_never_do(
    tmp_path: Path,
) -> None:
    # A CELERY_CONFIG_MODULE's routes, annotations and schedule reach the app;
    # what the package sets from its own settings wins, and the README lists
    # exactly those.
    (tmp_path / "lfw_test_celeryconfig.py").write_text(
        'task_routes = {"loomflow_worker.run_agent": {"queue": "agents"}}\n'
        'task_annotations = {"loomflow_worker.run_agent": {"rate_limit": "7/m"}}\n'
        'beat_schedule = {"x": {"task": "loomflow_worker.run_agent", "schedule": 60}}\n'
        "task_acks_late = False\nworker_prefetch_multiplier = 8\n"
    )
    env = {**os.environ, "CELERY_CONFIG_MODULE": "lfw_test_celeryconfig",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    shown = subprocess.run(
        [sys.executable, "-c",
         "import json; from loomflow_worker.tasks import app, run_agent; c = app.conf; "
         "print(json.dumps([c.task_routes, sorted(c.beat_schedule), run_agent.rate_limit, "
         "c.task_acks_late, c.worker_prefetch_multiplier]))"],
        env=env, capture_output=True, text=True, check=True, timeout=60,
    ).stdout
    assert json.loads(shown) == [{"loomflow_worker.run_agent": {"queue": "agents"}}, ["x"],
                                 "7/m", True, 1]
    readme = (ROOT / "README.md").read_text()
    winning = re.search(r"which always\s+wins:(.*?)\. A route", readme, flags=re.S)
    assert winning, "the README does not say which Celery options the package's settings win"
    named = set(re.findall(r"`([a-z_]+)`", winning[1]))
    assert named == set(application._celery_settings(tasks.settings()))


def test_the_readme_names_the_queue_wherever_it_shows_send_task() -> None:
    readme = (ROOT / "README.md").read_text()
    shown = re.findall(r"send_task\(([^`\n]*)\)", readme)
    assert shown, "the README shows no send_task call"
    assert all("queue=" in call for call in shown), shown
    assert "`celery` queue" in readme
