"""100 requests on 10 sessions while workers and pool children are SIGKILLed.

Every 1.5-3 s (seeded; set CHAOS_SEED to replay a schedule) either a whole
worker is SIGKILLed and started again under the same name, or one pool
child is (preferably one in the middle of a tool call; Celery replaces it).
Afterwards: nothing lost; no tool call ran again after its result was
journaled (G1, checked exactly by an audit trigger on journal_steps), so a
completed tool call ran twice only when a kill fell between its end and its
journal write; only killed processes left tool calls unfinished; every
session ran its requests in enqueue order without overlap; every output is
right, in the ledger and in the Celery result."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass

import pytest

from tests.chaos.checks import (
    Sent,
    alive,
    all_terminal,
    assert_sound,
    children,
    executions,
    install_journal_audit,
    problem_lines,
    send,
    slowest,
    timeline,
    verdict,
    wait_terminal,
)
from tests.integration.celery_harness import Fleet
from tests.integration.helpers import wait_until

pytestmark = pytest.mark.slow

REQUESTS = 100
SESSIONS = 10
WORKERS = ("w1", "w2", "w3")
CONCURRENCY = 2
MAX_KILLS = 8
BURST = 10
BURST_EVERY = (2.0, 3.0)
ENV = {
    "TEST_TOOL_SLEEP": "0.08",
    "LOOMFLOW_WORKER_SWEEP_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_MAX_CRASHES": "10",
    "LOOMFLOW_WORKER_HEARTBEAT_INTERVAL": "0.5",
    "LOOMFLOW_WORKER_LEASE": "5",
}


@dataclass(frozen=True)
class Kill:
    at: float  # seconds since the first request was sent
    kind: str  # "worker" or "child"
    worker: str
    pids: tuple[int, ...]  # every process the kill ended
    mid_tool: tuple[str, ...]  # tags in flight in those processes


def _in_flight(fleet: Fleet) -> dict[int, list[str]]:
    """Live processes of this fleet in the middle of a tool call, with their tags."""
    found: dict[int, list[str]] = {}
    for e in executions(fleet.dsn):
        if e.finished_at is None and alive(e.pid):
            found.setdefault(e.pid, []).append(e.tag)
    return found


def _busy(fleet: Fleet, wait: float) -> dict[int, tuple[str, list[str]]]:
    """Pool children running a tool call, with their worker; waits up to ``wait``
    seconds for one, so that most kills land mid-tool."""
    def busy() -> dict[int, tuple[str, list[str]]]:
        found: dict[int, tuple[str, list[str]]] = {}
        for pid, tags in _in_flight(fleet).items():
            try:
                found[pid] = (fleet.worker_of(pid), tags)
            except (LookupError, OSError):
                continue
        return found

    with contextlib.suppress(AssertionError):  # none busy: the kill lands between tools
        return wait_until(busy, "a pool child in a tool call", wait)
    return {}


def _kill_one(fleet: Fleet, rng: random.Random, t0: float) -> Kill:
    whole = rng.random() < 0.5
    busy = _busy(fleet, wait=2.0)
    if whole:
        workers = sorted({name for name, _ in busy.values()}) or sorted(fleet.workers)
        name = rng.choice(workers)
        main = fleet.workers[name].pid
        pids = (main, *children(main))
        in_flight = _in_flight(fleet)
        fleet.kill(name)
        kill = Kill(time.monotonic() - t0, "worker", name, pids,
                    tuple(t for p in pids for t in in_flight.get(p, [])))
        # Fleet.start deletes the worker's log: keep the killed one's beside it.
        log = fleet.logs / f"{name}.log"
        if log.exists():
            shutil.copyfile(log, fleet.logs / f"{name}-killed-{main}.log")
        fleet.start(name, CONCURRENCY, cli=False, **ENV)
        return kill
    if busy:
        pid = rng.choice(sorted(busy))
        name, tags = busy[pid]
    else:  # nothing in a tool call: any pool child (idle, parked or mid-model)
        name = rng.choice(sorted(fleet.workers))
        pool = children(fleet.workers[name].pid)
        if not pool:
            return Kill(time.monotonic() - t0, "none", name, (), ())
        pid, tags = rng.choice(sorted(pool)), []
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return Kill(time.monotonic() - t0, "none", name, (), ())
    return Kill(time.monotonic() - t0, "child", name, (pid,), tuple(tags))


def _send_bursts(
    sent: list[Sent], errors: list[BaseException], rng: random.Random, stop: threading.Event
) -> None:
    try:
        while len(sent) < REQUESTS and not stop.is_set():
            for i in range(len(sent), min(REQUESTS, len(sent) + BURST)):
                k = i % SESSIONS
                sent.append(send(i, f"s{k}", f"u{k}"))
            if len(sent) < REQUESTS:
                stop.wait(rng.uniform(*BURST_EVERY))
    except BaseException as exc:
        errors.append(exc)


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_sigkills_lose_nothing_and_run_nothing_twice(fleet: Fleet, broker: str) -> None:
    seed = int(os.environ.get("CHAOS_SEED") or random.randrange(1 << 32))
    rng = random.Random(seed)
    print(f"\n[{broker}] CHAOS_SEED={seed}")
    began = time.monotonic()
    install_journal_audit(fleet.dsn)
    for name in WORKERS:
        fleet.start(name, CONCURRENCY, cli=False, **ENV)
    started = time.monotonic()

    # The requests arrive in bursts from a thread of their own, so work stays in
    # flight while the kills go on, and every burst queues requests behind each
    # other on each session.
    sent: list[Sent] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    t0 = time.monotonic()
    sender = threading.Thread(
        target=_send_bursts, args=(sent, errors, random.Random(seed + 1), stop), daemon=True
    )
    sender.start()
    kills: list[Kill] = []
    try:
        next_kill = t0 + rng.uniform(1.5, 3.0)
        while sender.is_alive() or (  # not a wait: kills paced until the requests end
            len(kills) < MAX_KILLS and not all_terminal(fleet.dsn, list(sent))
        ):
            if time.monotonic() < next_kill or len(kills) >= MAX_KILLS:
                time.sleep(0.05)
                continue
            kill = _kill_one(fleet, rng, t0)
            if kill.kind != "none":
                kills.append(kill)
                print(f"[{broker}] kill {len(kills)} at {kill.at:5.1f}s: {kill.kind} of "
                      f"{kill.worker} pids {list(kill.pids)} mid-tool {list(kill.mid_tool)}")
            next_kill = time.monotonic() + rng.uniform(1.5, 3.0)
    finally:
        stop.set()
        sender.join(timeout=30)
    chaos_over = time.monotonic()
    assert not errors, errors
    assert len(sent) == REQUESTS

    final = wait_terminal(fleet.dsn, sent, timeout=150)
    settled = time.monotonic()
    v = verdict(fleet.dsn, sent)

    killed_pids = {p for k in kills for p in k.pids}
    worker_kills = sum(k.kind == "worker" for k in kills)
    child_kills = sum(k.kind == "child" for k in kills)
    bound = child_kills + CONCURRENCY * worker_kills
    strays = [e for e in v.interrupted if e.pid not in killed_pids]
    print(
        f"[{broker}] workers ready in {started - began:.1f}s; chaos {chaos_over - t0:.1f}s; "
        f"all terminal {settled - t0:.1f}s after the first request\n"
        f"[{broker}] kills={len(kills)} (worker {worker_kills}, child {child_kills}) "
        f"{v.summary()} interrupted_bound={bound} "
        f"statuses={sorted(set(final.values()))}"
    )
    for label, items in (
        ("lost", v.lost), ("completed twice", list(v.completed_twice.items())),
        ("G1 violation", v.g1_violations), ("re-run in window", v.reruns_in_window),
        ("several keys", v.keys_per_tag), ("concurrent runs", v.concurrent_runs),
        ("never completed", v.never_completed), ("order", v.order_violations),
        ("overlap", v.overlaps), ("wrong output", v.wrong_outputs),
        ("celery result", v.result_problems), ("unfinished in a live pid", strays),
    ):
        for item in items[:10]:
            print(f"[{broker}] {label}: {item}")
    if v.result_problems:
        bad = [s.request_id for s in sent if any(s.request_id in p for p in v.result_problems)]
        print(f"[{broker}] requests whose Celery result is missing or wrong:\n"
              f"{timeline(fleet.dsn, fleet, bad)}")
    if settled - chaos_over > 10:
        print(f"[{broker}] STALL: {settled - chaos_over:.1f}s from the last kill to the end; "
              f"the last requests:\n{slowest(fleet.dsn, sent, fleet)}")
    logs = problem_lines(fleet)
    context = f"seed {seed}; worker log lines:\n{logs}"
    assert_sound(v, context)
    assert strays == [], context
    assert len(v.interrupted) <= bound, context
