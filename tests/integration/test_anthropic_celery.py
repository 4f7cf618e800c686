"""The Anthropic crash/resume tests again, on real Celery workers.

The local Messages API of ``messages_api`` runs in this process; the
workers' "claude" agent (``agents_fixture``) drives loomflow's real
``AnthropicModel`` against it through ``ANTHROPIC_BASE_URL``. The worker
always passes ``emit`` to ``agent.run``, so every model call is an SSE
stream. A pool child (or a whole worker) is SIGKILLed while tool ``b``
runs, and the request must finish on its next attempt without sending a
completed model call again and without a request the API refuses.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import psycopg
import pytest

from loomflow_worker.pricing import Prices, Tokens
from loomflow_worker.tasks import run_agent

from .celery_harness import Fleet, ledger
from .helpers import cli, steps_journaled_twice, tool_counts, wait_until
from .messages_api import ANSWER, API_KEY, MODEL, PROMPT, MessagesAPI, serving

pytestmark = pytest.mark.slow

# Tool b sleeps this long in the workers: the window in which it is killed.
TOOL_SLEEP = "1.0"


@pytest.fixture
def api() -> Iterator[MessagesAPI]:
    with serving() as server:
        yield server


def _start_worker(
    fleet: Fleet, name: str, api: MessagesAPI, instructions: str, **env: str
) -> None:
    """A one-slot worker whose "claude" agent talks to ``api`` under ``instructions``."""
    fleet.start(
        name,
        concurrency=1,
        **env,
        ANTHROPIC_BASE_URL=api.url,
        ANTHROPIC_API_KEY=API_KEY,
        TEST_CLAUDE_INSTRUCTIONS=instructions,
        TEST_TOOL_SLEEP=TOOL_SLEEP,
        LOOMFLOW_WORKER_SWEEP_INTERVAL="0.5",
        LOOMFLOW_WORKER_HEARTBEAT_INTERVAL="0.5",
    )



def _pid_running(dsn: str, tag: str, timeout: float = 30) -> int:
    """The pid of the process running tool ``tag`` right now (started, not finished)."""
    def running() -> int | None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT pid FROM loomflow_worker_effects "
                "WHERE tag = %s AND finished_at IS NULL ORDER BY id DESC LIMIT 1",
                (tag,),
            ).fetchone()
        return None if row is None else int(row[0])

    pid = wait_until(running, f"tool {tag} running", timeout)
    assert pid is not None
    return pid


def _assert_ran_once_after_crash(fleet: Fleet, request_id: str) -> None:
    assert tool_counts(fleet.dsn) == {"a": 1, "b": 2}  # b once interrupted, once to the end
    row = ledger(fleet.dsn, request_id)
    assert (row["status"], row["attempts"], row["crashes"]) == ("succeeded", 2, 1), row
    assert steps_journaled_twice(fleet.dsn) == []


def test_a_pool_child_killed_mid_tool_sends_no_completed_model_call_again(
    fleet: Fleet, api: MessagesAPI
) -> None:
    _start_worker(fleet, "w1", api, "v1")
    result = run_agent.delay(PROMPT, "s", user_id="u", agent="claude")
    pid = _pid_running(fleet.dsn, "b")
    assert fleet.worker_of(pid) == "w1"
    assert api.turns() == [0, 1]  # both calls finished before b started
    os.kill(pid, signal.SIGKILL)

    # The pool starts a new child (it builds the agent again) before the
    # redelivered request can run: allow a loaded machine its time.
    value = result.get(timeout=90)
    assert value["output"] == ANSWER
    assert value["request_id"] == result.id
    # Turns 0 and 1 replay from the journal on attempt 2; only turn 2 is sent then.
    assert api.turns() == [0, 1, 2]
    assert api.statuses() == [200, 200, 200]
    assert {r.path for r in api.received} == {"/v1/messages"}
    assert {r.api_key for r in api.received} == {API_KEY}
    assert {r.streamed for r in api.received} == {True}  # the worker always streams
    assert [r.system for r in api.received] == ["v1", "v1", "v1"]
    # The last request answers, verbatim, the ids the server minted before the crash.
    first, second, last = api.received
    assert last.tool_result_ids() == [*first.minted, *second.minted]
    _assert_ran_once_after_crash(fleet, result.id)
    _assert_usage_counted_once(fleet, result.id, api)


def _tokens(reported: dict[str, int]) -> Tokens:
    return Tokens(1, reported["input_tokens"], reported["output_tokens"],
                  reported["cache_read_input_tokens"], reported["cache_creation_input_tokens"])


def _assert_usage_counted_once(fleet: Fleet, request_id: str, api: MessagesAPI) -> None:
    """The usage the API reported is the request's, each call counted once:
    attempt 1 (killed) recorded none, attempt 2 replayed the first two calls
    (not billed again) and executed the third; the request's executed totals
    are all three calls, priced by genai-prices' table for the model."""
    calls = [_tokens(r.usage) for r in api.received]
    assert calls[0].cache_write > 0 and calls[1].cache_read > 0  # the stand-in reports both
    billed, replayed = calls[0] + calls[1] + calls[2], calls[0] + calls[1]
    price = Prices({})
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT model_calls, input_tokens, output_tokens, cache_read_tokens, "
            "cache_write_tokens, cost, price_unknown, replayed_calls, replayed_tokens, "
            "replayed_cost FROM runs WHERE request_id = %s", (request_id,)).fetchone()
        attempts = [r[0] for r in conn.execute(
            "SELECT usage FROM run_attempts WHERE request_id = %s ORDER BY attempt",
            (request_id,))]
    assert row == (3, billed.input, billed.output, billed.cache_read, billed.cache_write,
                   sum(price.cost("claude", MODEL, c) or 0 for c in calls), False,
                   2, replayed.total,
                   sum(price.cost("claude", MODEL, c) or 0 for c in calls[:2]))
    assert row[5] > 0
    assert attempts[0] is None
    assert Tokens.of_dict(attempts[1]["executed"]) == calls[2]
    assert Tokens.of_dict(attempts[1]["replayed"]) == replayed
    assert attempts[1]["keys"][MODEL]["model"] == MODEL
    shown = cli(fleet, "show", request_id)
    assert shown.returncode == 0, shown.stderr
    assert (f"tokens    {billed.input:,} in, {billed.output:,} out, {billed.cache_read:,} "
            f"cache read, {billed.cache_write:,} cache write (3 model calls executed)"
            ) in shown.stdout
    assert "replayed  2 model calls from the journal, not billed again" in shown.stdout
    assert "not recorded" in shown.stdout


def test_a_deploy_with_new_instructions_keeps_the_request_until_it_is_upgraded(
    fleet: Fleet, api: MessagesAPI
) -> None:
    _start_worker(fleet, "w1", api, "v1")
    result = run_agent.delay(PROMPT, "s", user_id="u", agent="claude")
    pid = _pid_running(fleet.dsn, "b")
    assert fleet.worker_of(pid) == "w1"
    # The whole worker dies mid-b; a deploy brings it back with new instructions
    # (another version of the agent): the request waits for its own version and
    # nothing of it is sent to the model meanwhile.
    fleet.kill("w1")
    _start_worker(fleet, "w2", api, "v2")
    _wait_for_version(fleet.dsn, result.id)
    assert api.turns() == [0, 1]

    moved = subprocess.run(
        [sys.executable, "-m", "loomflow_worker.cli", "upgrade", result.id],
        env=fleet.env, capture_output=True, text=True, timeout=60)
    assert moved.returncode == 0, moved.stderr
    value = result.get(timeout=60)
    assert value["output"] == ANSWER
    # Upgraded, the request replays turns 0 and 1 from its journal by position:
    # only turn 2 is sent, under the new instructions, answering the ids the
    # server minted before the crash.
    assert api.turns() == [0, 1, 2]
    assert api.statuses() == [200] * 3  # never a 400
    assert [r.system for r in api.received] == ["v1", "v1", "v2"]
    assert {r.streamed for r in api.received} == {True}
    first, second, last = api.received
    assert last.tool_result_ids() == [*first.minted, *second.minted]
    _assert_ran_once_after_crash(fleet, result.id)


def test_new_instructions_under_a_declared_version_restamp_the_replayed_tool_result(
    fleet: Fleet, api: MessagesAPI
) -> None:
    # The team declares the version by hand and leaves it unchanged across a
    # deploy that changed the instructions: the request resumes on the new code.
    _start_worker(fleet, "w1", api, "v1", TEST_CLAUDE_VERSION="1")
    result = run_agent.delay(PROMPT, "s", user_id="u", agent="claude")
    pid = _pid_running(fleet.dsn, "b")
    assert fleet.worker_of(pid) == "w1"
    fleet.kill("w1")
    _start_worker(fleet, "w2", api, "v2", TEST_CLAUDE_VERSION="1")

    value = result.get(timeout=30)
    assert value["output"] == ANSWER
    # The changed system prompt makes turns 0 and 1 new requests: the model is
    # asked again and mints new ids, while tool a's result replays (its call
    # matches the journal, so nothing diverges).
    assert api.turns() == [0, 1, 0, 1, 2]
    assert api.statuses() == [200] * 5  # never a 400
    assert [r.system for r in api.received] == ["v1", "v1", "v2", "v2", "v2"]
    assert {r.streamed for r in api.received} == {True}
    old_a, _, new_a, new_b, last = api.received
    assert new_a.minted != old_a.minted
    # a's replayed result answers the id minted after the restart, not the old one.
    assert new_b.tool_result_ids() == list(new_a.minted)
    assert last.tool_result_ids() == [*new_a.minted, *new_b.minted]
    _assert_ran_once_after_crash(fleet, result.id)


def _wait_for_version(dsn: str, request_id: str, timeout: float = 60) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        wait_until(lambda: conn.execute("SELECT version_wait_since FROM runs WHERE request_id"
                                        " = %s", (request_id,)).fetchone(),
                   f"{request_id} waiting for its version", timeout, every=0.1,
                   until=lambda row: row is not None and row[0] is not None)
