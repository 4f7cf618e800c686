"""``loomflow-worker doctor``: every check of a fleet's settings and services,
each with what to do when it fails."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..runtime.errors import InvalidInput, LoomflowWorkerError, describe_dsn, translated
from ..runtime.migrate import latest_version
from ..runtime.sessions import probe
from ..runtime.sql import query
from ..settings import LEASE_HEARTBEATS, Settings, first_line, lease_covers_heartbeats
from .connect import connect, sanitize_url


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    hint: str = ""

    def line(self) -> str:
        text = f"{'OK  ' if self.ok else 'FAIL'} {self.name}: {self.detail}"
        return f"{text}; {self.hint}" if self.hint and not self.ok else text


def check_settings(settings: Settings, grace_period: float) -> list[Check]:
    """Settings that only go wrong together."""
    checks = []
    if settings.is_redis_broker:
        from ..execution.registry import agent_time_limit, registered_agents

        limits = [agent_time_limit(name) for name in registered_agents()]
        longest = max([settings.run_time_limit, *(t for t in limits if t is not None)])
        checks.append(Check(
            "visibility timeout",
            settings.visibility_timeout > longest,
            f"{settings.visibility_timeout}s vs the longest run time limit {longest:g}s",
            "the Redis broker hands a message still running after its visibility timeout to "
            "another worker: raise LOOMFLOW_WORKER_VISIBILITY_TIMEOUT above "
            "LOOMFLOW_WORKER_RUN_TIME_LIMIT (and every register_agent(time_limit=...))",
        ))
    checks.append(Check(
        "lease",
        lease_covers_heartbeats(settings.lease_timeout, settings.heartbeat_interval),
        f"lease timeout {settings.lease_timeout:g}s vs heartbeat interval "
        f"{settings.heartbeat_interval:g}s",
        f"raise LOOMFLOW_WORKER_LEASE to {LEASE_HEARTBEATS} x LOOMFLOW_WORKER_HEARTBEAT_INTERVAL "
        "or more, or live runs look frozen and are fenced",
    ))
    checks.append(Check(
        "soft shutdown",
        settings.soft_shutdown_timeout < grace_period,
        f"soft shutdown timeout {settings.soft_shutdown_timeout:g}s vs grace period "
        f"{grace_period:g}s",
        "keep LOOMFLOW_WORKER_SOFT_SHUTDOWN_TIMEOUT below the orchestrator's grace period "
        "(LOOMFLOW_WORKER_GRACE_PERIOD / --grace-period), or SIGKILL lands before runs are "
        "requeued",
    ))
    return checks


def doctor(settings: Settings, *, grace_period: float, timeout: float = 3.0) -> Iterator[Check]:
    """Every check, each a :class:`Check` with what to do when it fails, given as
    it is made (the database's first, before the broker's client is loaded)."""
    yield from _check_database(settings)
    yield _check_broker(settings, timeout)
    yield from _check_redis(settings, timeout)
    yield _check_agents(settings)
    yield _check_versions(settings)
    yield from check_settings(settings, grace_period)


def _check_versions(settings: Settings) -> Check:
    """The fleet's agents, each version with the live workers serving it; a
    version whose requests wait with no live worker of it fails."""
    from ..execution import ledger_reads
    from ..execution.versions import VersionInfo

    try:
        with connect(settings, application_name="loomflow-worker doctor") as conn, \
                translated("query"):
            found = [VersionInfo(**row) for row in ledger_reads.agent_versions(conn)]
    except LoomflowWorkerError as exc:
        return Check("versions", False, f"not read: {first_line(exc)}",
                     "fix the database and its schema first")
    if not found:
        return Check("versions", True, "no worker has recorded its agents yet")
    said = "; ".join(
        f"{v.agent} {v.version} on "
        + (", ".join(v.workers) if v.workers else "no live worker")
        + (f" ({v.waiting} waiting)" if v.waiting else "")
        for v in found)
    stranded = [v for v in found if v.waiting and not v.live]
    if stranded:
        first = stranded[0]
        return Check("versions", False, said,
                     f"start a worker of {first.agent} {first.version}, or move its requests: "
                     f"loomflow-worker upgrade --agent {first.agent} --from {first.version}")
    return Check("versions", True, said)


def _check_database(settings: Settings) -> list[Check]:
    where = describe_dsn(settings.database_url.get_secret_value())
    try:
        conn = connect(settings, application_name="loomflow-worker doctor")
    except LoomflowWorkerError as exc:
        return [
            Check("database", False, str(exc)),
            Check("schema", False, "not checked (no database)",
                  "fix the database connection first"),
        ]
    with conn:
        try:
            with translated("query"):
                version_row = conn.execute(query("admin_server_version")).fetchone()
                present = conn.execute(query("schema_present")).fetchone()
                applied = (
                    [r[0] for r in conn.execute(query("schema_versions"))]
                    if present and present[0] else []
                )
        except LoomflowWorkerError as exc:
            return [Check("database", False, f"{where}: {exc}")]
    server = version_row[0] if version_row else "?"
    database = Check("database", True, f"reachable at {where} (PostgreSQL {server})")
    try:
        asyncio.run(probe(settings.database_url.get_secret_value(), settings.connect_timeout))
    except LoomflowWorkerError as exc:
        database = Check("database", False, str(exc))
    latest = latest_version()
    current = max(applied, default=0)
    if current == latest:
        schema = Check("schema", True, f"at version {latest}")
    elif current < latest:
        schema = Check(
            "schema", False,
            f"at version {current or 'none'}, this loomflow-worker needs {latest}",
            "run `loomflow-worker migrate` (workers also migrate when they start)",
        )
    else:
        schema = Check(
            "schema", False, f"at version {current}, newer than this loomflow-worker's {latest}",
            "upgrade loomflow-worker on this host",
        )
    return [database, schema]


def _check_broker(settings: Settings, timeout: float) -> Check:
    import kombu.connection

    connection: Any = kombu.connection.Connection
    url = settings.broker_url.get_secret_value()
    options = dict(settings.broker_transport_options)
    # A broker that takes the connection and never answers fails the check
    # within the timeout instead of holding it up for ever.
    if settings.is_redis_broker:
        options["visibility_timeout"] = settings.visibility_timeout
        options["socket_timeout"] = timeout
    elif url.startswith(("amqp://", "amqps://", "pyamqp://")):
        options["read_timeout"] = options["write_timeout"] = timeout
    try:
        with connection(url, connect_timeout=timeout, transport_options=options) as conn:
            conn.ensure_connection(
                max_retries=1, interval_start=0, interval_step=0.5, timeout=timeout
            )
    except Exception as exc:
        return Check(
            "broker", False, f"{sanitize_url(url)} unreachable: {first_line(exc)}",
            "check that the broker is running and LOOMFLOW_WORKER_BROKER_URL is right",
        )
    return Check("broker", True, f"reachable at {sanitize_url(url)}")


def _check_redis(settings: Settings, timeout: float) -> list[Check]:
    import redis

    targets = [("result backend", settings.result_backend.get_secret_value(),
                "LOOMFLOW_WORKER_RESULT_BACKEND")]
    if settings.events_url is not None:
        targets.append(("events", settings.events_url.get_secret_value(),
                        "LOOMFLOW_WORKER_EVENTS_URL"))
    checks = []
    for name, url, variable in targets:
        if not url.startswith(("redis://", "rediss://")):
            checks.append(Check(name, True, f"{sanitize_url(url)} (not Redis: not probed)"))
            continue
        client: redis.Redis = redis.Redis.from_url(
            url, socket_connect_timeout=timeout, socket_timeout=timeout
        )
        try:
            client.ping()
        except (redis.RedisError, OSError) as exc:
            checks.append(Check(
                name, False, f"{sanitize_url(url)} unreachable: {first_line(exc)}",
                f"check that Redis is running and {variable} is right",
            ))
        else:
            checks.append(Check(name, True, f"reachable at {sanitize_url(url)}"))
        finally:
            client.close()
    return checks


def _check_agents(settings: Settings) -> Check:
    from ..execution.registry import import_agent_modules, registered_agents

    if not settings.agents:
        return Check(
            "agents", False, "no agents modules listed",
            "set LOOMFLOW_WORKER_AGENTS to the modules that call register_agent",
        )
    try:
        import_agent_modules(settings.agents)
    except InvalidInput as exc:
        return Check("agents", False, str(exc), "fix PYTHONPATH or LOOMFLOW_WORKER_AGENTS")
    except Exception as exc:
        return Check(
            "agents", False, f"importing {', '.join(settings.agents)} raised "
            f"{type(exc).__name__}: {first_line(exc)}", "fix the agents module",
        )
    agents = registered_agents()
    if not agents:
        return Check("agents", False, f"{', '.join(settings.agents)} registered no agent",
                     "decorate a factory with @loomflow_worker.register_agent")
    return Check("agents", True, f"{', '.join(settings.agents)} importable; registered: "
                 f"{', '.join(agents)}")
