"""The Celery app is configured once; other settings get a new app, which
``app``, ``run_agent`` and ``resume_agent`` lead to (no services: nothing here
connects)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery
from celery.app.utils import find_app
from pydantic import SecretStr

from loomflow_worker import tasks
from loomflow_worker.tasks import application


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


def test_the_worker_finds_the_app_and_it_retries_storing_results_briefly() -> None:
    found = find_app("loomflow_worker.tasks")
    assert isinstance(found, Celery)
    assert found.tasks[application.RUN_AGENT].name == tasks.run_agent.name
    options = found.conf.result_backend_transport_options
    assert options["retry_policy"] == application.STORE_RETRY
