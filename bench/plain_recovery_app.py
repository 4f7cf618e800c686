"""The plain Celery app of ``bench_celery.py``, running the slow agent of ``bench_recovery.py``.

``celery -A bench.plain_recovery_app worker`` is ``bench/plain_celery_app.py`` (same task, same
``BENCH_PLAIN_*`` configuration, Celery's default delivery settings) with the agent its pool
children build swapped for :func:`bench.agents_recovery.build_agent`.
"""

from __future__ import annotations

from bench import plain_celery_app
from bench.agents_recovery import build_agent

vars(plain_celery_app)["build_agent"] = build_agent  # what _open() builds in a pool child
app = plain_celery_app.app
run_agent = plain_celery_app.run_agent

__all__ = ["app", "run_agent"]
