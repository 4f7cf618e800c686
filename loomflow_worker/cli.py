"""The ``loomflow-worker`` command."""

from __future__ import annotations

import os
import sys

import anyio
import click
import psycopg

from . import metrics
from .runtime.errors import LoomflowWorkerError
from .runtime.migrate import latest_version, migrate
from .runtime.store import describe_dsn, probe
from .settings import Settings

# Exit codes scripts can rely on.
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_UNAVAILABLE = 3


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Durable loomflow agent runs on Postgres and Celery.

    Settings come from LOOMFLOW_WORKER_* environment variables (see the README)."""


@main.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@click.option("-c", "--concurrency", type=int, default=None, help="Pool children.")
@click.option("-n", "--hostname", default=None, help="Node name, e.g. worker1@%h.")
@click.option("-l", "--loglevel", default="INFO", show_default=True)
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
def worker(
    concurrency: int | None, hostname: str | None, loglevel: str, celery_args: tuple[str, ...]
) -> None:
    """Start a worker with the package's defaults.

    SIGTERM starts Celery's soft shutdown (REMAP_SIGTERM=SIGQUIT): runs go on
    for LOOMFLOW_WORKER_SOFT_SHUTDOWN_TIMEOUT seconds, then are stopped and
    requeued at once, to resume on another worker. Keep that timeout below
    the orchestrator's grace period. Extra arguments go to `celery worker`."""
    settings = Settings()
    args = [sys.executable, "-m", "celery", "-A", "loomflow_worker.tasks", "worker",
            "-l", loglevel, "-Q", settings.queue]
    if concurrency is not None:
        args += ["-c", str(concurrency)]
    if hostname is not None:
        args += ["-n", hostname]
    args += list(celery_args)
    # Set before the worker process starts: billiard reads it at import.
    os.environ["REMAP_SIGTERM"] = "SIGQUIT"
    if settings.metrics_port:
        metrics.prepare_multiprocess_dir()
    os.execv(sys.executable, args)


@main.command(name="migrate")
def migrate_command() -> None:
    """Apply the schema migrations the database lacks (safe to run concurrently)."""
    settings = Settings()
    dsn = settings.database_url.get_secret_value()

    async def run() -> list[int]:
        await probe(dsn, settings.connect_timeout)
        async with await psycopg.AsyncConnection.connect(
            dsn, connect_timeout=settings.connect_timeout
        ) as conn:
            return await migrate(conn)

    try:
        applied = anyio.run(run)
    except LoomflowWorkerError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_UNAVAILABLE)
    where = describe_dsn(dsn)
    if applied:
        click.echo(f"{where}: applied {', '.join(f'{v:04d}' for v in applied)}; "
                   f"schema at version {latest_version()}")
    else:
        click.echo(f"{where}: schema already at version {latest_version()}")


if __name__ == "__main__":
    main()
