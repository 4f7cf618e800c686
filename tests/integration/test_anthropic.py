"""Crash and resume through the real ``anthropic`` SDK and loomflow's ``AnthropicModel``,
against a local stand-in for the Messages API (``messages_api``) that records
every request, so the tests count the model calls actually sent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import pytest
from loomflow import Agent, Event, RunResult
from loomflow.core.errors import InvalidRequestError
from loomflow.core.types import EventKind
from loomflow.model.anthropic import AnthropicModel
from loomflow.runtime import InMemoryJournalStore, JournaledRuntime

from loomflow_worker.runtime import PostgresRuntime
from loomflow_worker.testing import EffectsLog

from .helpers import crash_on, crashes
from .messages_api import ANSWER, API_KEY, MODEL, PROMPT, MessagesAPI

pytestmark = pytest.mark.anyio


# ---- fixtures and helpers ---------------------------------------------------------------------


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Iterator[MessagesAPI]:
    server = MessagesAPI()
    server.start()
    # AnthropicModel builds its own AsyncAnthropic client (SDK retries off);
    # the SDK takes the server from ANTHROPIC_BASE_URL.
    monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def models() -> AsyncIterator[list[AnthropicModel]]:
    """Every AnthropicModel a test makes; their HTTP clients are closed afterwards."""
    made: list[AnthropicModel] = []
    try:
        yield made
    finally:
        for model in made:
            await model._client.close()


def claude_agent(
    runtime: Any, effects: EffectsLog, models: list[AnthropicModel], instructions: str = "v1"
) -> Agent:
    model = AnthropicModel(MODEL, api_key=API_KEY, request_timeout_s=10)
    models.append(model)
    # auto_extract would send extra model calls of its own after each run.
    return Agent(
        instructions, model=model, tools=[effects.tool()], runtime=runtime, auto_extract=False
    )


async def run(agent: Agent, *, streamed: bool, events: list[Event] | None = None) -> RunResult:
    if not streamed:
        return await agent.run(PROMPT, session_id="s", user_id="u")
    seen = [] if events is None else events

    async def emit(event: Event) -> None:
        seen.append(event)

    return await agent.run(PROMPT, session_id="s", user_id="u", emit=emit)


async def crash_then_resume(
    runtime: Any,
    dsn: str,
    models: list[AnthropicModel],
    *,
    streamed: bool,
    resume_instructions: str,
    events: list[Event] | None = None,
) -> RunResult:
    """Run 1 dies in tool b; run 2 (a fresh agent and model) repeats the request."""
    crashing = EffectsLog(dsn, on_start=crash_on("b"))
    with crashes():
        await run(claude_agent(runtime, crashing, models, "v1"), streamed=streamed)
    agent = claude_agent(runtime, EffectsLog(dsn), models, resume_instructions)
    return await run(agent, streamed=streamed, events=events)


PATHS = pytest.mark.parametrize("streamed", [False, True], ids=["complete", "stream"])


# ---- tests -------------------------------------------------------------------------------------


@PATHS
async def test_a_resumed_run_sends_no_completed_model_call_again(
    runtime: PostgresRuntime,
    dsn: str,
    api: MessagesAPI,
    models: list[AnthropicModel],
    streamed: bool,
) -> None:
    events: list[Event] = []
    result = await crash_then_resume(
        runtime, dsn, models, streamed=streamed, resume_instructions="v1", events=events
    )
    assert result.output == ANSWER
    # Turns 0 and 1 completed in run 1 and replay; only turn 2 is sent by run 2.
    assert api.turns() == [0, 1, 2]
    assert api.statuses() == [200, 200, 200]
    assert {r.path for r in api.received} == {"/v1/messages"}
    assert {r.api_key for r in api.received} == {API_KEY}
    assert {r.streamed for r in api.received} == {streamed}
    # a completed before the crash; b was in flight and runs again.
    assert await EffectsLog(dsn).counts() == {"a": 1, "b": 2}
    # The final request answers the ids the server minted in run 1, verbatim.
    first, second, last = api.received
    assert last.tool_result_ids() == [*first.minted, *second.minted]
    if streamed:
        text = "".join(
            e.payload["chunk"]["text"] or ""
            for e in events
            if e.kind == EventKind.MODEL_CHUNK and e.payload["chunk"]["kind"] == "text"
        )
        assert text.endswith(ANSWER)


@PATHS
async def test_a_replayed_tool_result_answers_under_the_new_tool_use_id(
    runtime: PostgresRuntime,
    dsn: str,
    api: MessagesAPI,
    models: list[AnthropicModel],
    streamed: bool,
) -> None:
    # A deploy changed the instructions between the crash and the resume: the
    # model is asked again and mints new ids, while tool a's result replays.
    result = await crash_then_resume(
        runtime, dsn, models, streamed=streamed, resume_instructions="v2"
    )
    assert result.output == ANSWER
    assert api.turns() == [0, 1, 0, 1, 2]
    assert api.statuses() == [200] * 5
    assert [r.system for r in api.received] == ["v1", "v1", "v2", "v2", "v2"]
    assert await EffectsLog(dsn).counts() == {"a": 1, "b": 2}
    old_a, _, new_a, new_b, last = api.received
    assert new_a.minted != old_a.minted
    # a's replayed result was re-stamped with the id the server minted in run 2.
    assert new_b.tool_result_ids() == list(new_a.minted)
    assert last.tool_result_ids() == [*new_a.minted, *new_b.minted]


@PATHS
async def test_loomflows_own_runtime_sends_the_stale_tool_use_id(
    dsn: str, api: MessagesAPI, models: list[AnthropicModel], streamed: bool
) -> None:
    # The scenario above on loomflow's JournaledRuntime: the replayed result keeps
    # run 1's id and the API refuses the request. The test above guards this.
    runtime = JournaledRuntime(InMemoryJournalStore())
    with pytest.raises(InvalidRequestError) as info:
        await crash_then_resume(runtime, dsn, models, streamed=streamed, resume_instructions="v2")
    cause = info.value.__cause__
    assert isinstance(cause, anthropic.BadRequestError)
    assert cause.status_code == 400
    assert isinstance(cause.body, dict)
    assert cause.body["type"] == "error"
    error = cause.body["error"]
    assert error["type"] == "invalid_request_error"
    old_a, _, new_a, refused = api.received
    assert error["message"].startswith(
        f"messages.2: unexpected `tool_use_id` found in `tool_result` blocks: {old_a.minted[0]}."
    )
    # Sent once: neither the SDK nor loomflow's retry policy retries a 400.
    assert api.turns() == [0, 1, 0, 1]
    assert api.statuses() == [200, 200, 200, 400]
    assert refused.tool_result_ids() == list(old_a.minted) != list(new_a.minted)
    # b never ran again.
    assert await EffectsLog(dsn).counts() == {"a": 1, "b": 1}
