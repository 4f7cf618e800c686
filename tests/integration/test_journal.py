"""The journal's replay semantics, against the real Postgres."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
from loomflow import Agent
from loomflow.core.types import Episode, ToolResult
from loomflow.memory.inmemory import InMemoryMemory
from loomflow.runtime import InMemoryJournalStore, JournaledRuntime
from loomflow.runtime.journal import journal_scope

from loomflow_worker import NoMemory
from loomflow_worker.runtime import Diverged, PostgresRuntime, run_options
from loomflow_worker.testing import DeterministicModel, EffectsLog, UnmatchedToolResult

from .helpers import Crash, calls, crash_on, crashes, epoch_of, make_agent

pytestmark = pytest.mark.anyio


async def test_completed_steps_replay_the_step_in_flight_reruns_new_steps_run(
    runtime: PostgresRuntime, dsn: str
) -> None:
    prompt = calls("a", "b", "c")
    crashing = EffectsLog(dsn, on_start=crash_on("b"))
    first = DeterministicModel()
    with crashes():
        await make_agent(runtime, crashing, model=first).run(prompt, session_id="s", user_id="u")
    assert await crashing.counts() == {"a": 1, "b": 1}

    effects = EffectsLog(dsn)
    second = DeterministicModel()
    result = await make_agent(runtime, effects, model=second).run(
        prompt, session_id="s", user_id="u"
    )
    assert result.output == "done: recorded a, recorded b, recorded c"
    # a completed: replayed. b was in flight: runs again. c is new.
    assert await effects.counts() == {"a": 1, "b": 2, "c": 1}
    # Model calls of turns 1 and 2 had completed: only turns 3 and 4 are sent.
    assert first.calls == 2
    assert second.calls == 2


async def test_a_finished_run_never_replays_into_the_next_identical_request(
    runtime: PostgresRuntime, dsn: str
) -> None:
    effects = EffectsLog(dsn)
    agent = make_agent(runtime, effects)
    for _ in range(3):
        await agent.run(calls("x"), session_id="s")
    assert await effects.counts() == {"x": 3}
    assert await epoch_of(dsn, "s") == 3


async def test_resume_without_a_checkpoint_continues_the_last_run(
    runtime: PostgresRuntime, dsn: str
) -> None:
    effects = EffectsLog(dsn)
    model = DeterministicModel()
    agent = make_agent(runtime, effects, model=model)
    first = await agent.run(calls("a", "b"), session_id="s")
    resumed = await agent.resume(calls("a", "b"), session_id="s")
    assert resumed.output == first.output
    assert await effects.counts() == {"a": 1, "b": 1}
    # The model is asked again (the recalled history is new input), but every
    # tool call replays from the last run's journal.
    assert await epoch_of(dsn, "s") == 1  # continuing a finished run advances nothing


async def test_resume_continues_a_crashed_run(runtime: PostgresRuntime, dsn: str) -> None:
    crashing = EffectsLog(dsn, on_start=crash_on("b"))
    with crashes():
        await make_agent(runtime, crashing).run(calls("a", "b"), session_id="s")
    effects = EffectsLog(dsn)
    result = await make_agent(runtime, effects).resume(calls("a", "b"), session_id="s")
    assert result.output == "done: recorded a, recorded b"
    assert await effects.counts() == {"a": 1, "b": 2}


async def test_a_different_prompt_runs_fresh(runtime: PostgresRuntime, dsn: str) -> None:
    crashing = EffectsLog(dsn, on_start=crash_on("b"))
    with crashes():
        await make_agent(runtime, crashing).run(calls("a", "b"), session_id="s")
    effects = EffectsLog(dsn)
    model = DeterministicModel()
    result = await make_agent(runtime, effects, model=model).run(
        calls("p", "q"), session_id="s"
    )
    assert result.output == "done: recorded p, recorded q"
    assert await effects.counts() == {"a": 1, "b": 1, "p": 1, "q": 1}
    assert model.calls == 3


async def test_a_second_identical_call_in_a_later_turn_runs(
    runtime: PostgresRuntime, dsn: str
) -> None:
    # Tool calls are keyed by position plus content: the same call in turn 2
    # is a new call, not a replay of turn 1's.
    effects = EffectsLog(dsn)
    result = await make_agent(runtime, effects).run(calls("same", "same"), session_id="s")
    assert result.output == "done: recorded same, recorded same"
    assert await effects.counts() == {"same": 2}


async def test_users_never_replay_each_others_steps(runtime: PostgresRuntime, dsn: str) -> None:
    crashing = EffectsLog(dsn, on_start=crash_on("b"))
    with crashes():
        await make_agent(runtime, crashing).run(calls("a", "b"), session_id="s", user_id="alice")
    effects = EffectsLog(dsn)
    model = DeterministicModel()
    await make_agent(runtime, effects, model=model).run(
        calls("a", "b"), session_id="s", user_id="bob"
    )
    # bob ran everything himself, on the same session id
    assert await effects.counts() == {"a": 2, "b": 2}
    assert model.calls == 3
    # and alice's crashed run still resumes from her own journal
    await make_agent(runtime, EffectsLog(dsn)).run(
        calls("a", "b"), session_id="s", user_id="alice"
    )
    assert await effects.counts() == {"a": 2, "b": 3}


async def test_sub_runs_replay_under_their_parent(runtime: PostgresRuntime, dsn: str) -> None:
    effects = EffectsLog(dsn)
    crash = {"armed": True}

    async def maybe_crash(tag: str) -> None:
        if tag == "after" and crash["armed"]:
            raise Crash("after the sub-agent")

    parent_effects = EffectsLog(dsn, on_start=maybe_crash)
    child = make_agent(runtime, effects)

    from loomflow import tool

    @tool
    async def delegate(task: str) -> str:
        """Hand a task to the sub-agent."""
        result = await child.run(calls("child1", "child2"), session_id="child-session")
        return result.output

    parent = Agent(
        "parent",
        model=DeterministicModel(),
        tools=[delegate, parent_effects.tool()],
        runtime=runtime,
        auto_extract=False,
    )
    prompt = 'call delegate {"task": "t"}\ncall record {"tag": "after"}'
    with crashes():
        await parent.run(prompt, session_id="s")
    assert await effects.counts() == {"child1": 1, "child2": 1, "after": 1}
    crash["armed"] = False
    result = await parent.run(prompt, session_id="s")
    assert result.output == "done: done: recorded child1, recorded child2, recorded after"
    assert await effects.counts() == {"child1": 1, "child2": 1, "after": 2}


async def test_a_nested_run_on_the_parents_own_scope_takes_no_lock(dsn: str) -> None:
    runtime = await PostgresRuntime.connect(dsn, lock_wait_timeout=0)
    try:
        effects = EffectsLog(dsn)
        child = make_agent(runtime, effects)

        from loomflow import tool

        @tool
        async def delegate(task: str) -> str:
            """Run the sub-agent on the parent's own session."""
            return (await child.run(calls("inner"), session_id="s-sub", user_id="u")).output

        parent = Agent(
            "p", model=DeterministicModel(), tools=[delegate], runtime=runtime,
            auto_extract=False,
        )
        # With lock_wait_timeout=0 a sub-run that tried to lock would fail at once.
        result = await parent.run('call delegate {"task": "t"}', session_id="s", user_id="u")
        assert result.output == "done: done: recorded inner"
    finally:
        await runtime.aclose()


class CountingMemory(InMemoryMemory):
    def __init__(self) -> None:
        super().__init__()
        self.remembered: list[Episode] = []

    async def remember(self, episode: Episode) -> None:  # type: ignore[override]
        self.remembered.append(episode)
        await super().remember(episode)


async def test_a_resumed_run_replays_its_episode_instead_of_writing_another(
    runtime: PostgresRuntime, dsn: str
) -> None:
    memory = CountingMemory()
    effects = EffectsLog(dsn)
    agent = make_agent(runtime, effects, memory=memory)

    async def die_at_the_finish(conn: Any, epoch: int) -> None:
        raise Crash("died while finishing")

    with run_options(on_finish=die_at_the_finish), pytest.raises(Crash):
        await agent.run(calls("a"), session_id="s")
    assert len(memory.remembered) == 1
    # the finishing transaction rolled back: the epoch did not advance
    assert await epoch_of(dsn, "s") is None
    await agent.run(calls("a"), session_id="s")
    assert len(memory.remembered) == 1
    assert await effects.counts() == {"a": 1}
    assert await epoch_of(dsn, "s") == 1


async def _rerun_with_new_instructions(runtime: Any, effects: EffectsLog) -> str:
    crashing = EffectsLog(effects.dsn, on_start=crash_on("b"))
    with crashes():
        await make_agent(runtime, crashing, instructions="v1").run(calls("a", "b"), session_id="s")
    # A deploy changed the instructions: the model is asked again and mints new
    # tool-call ids, while tool a's result replays.
    result = await make_agent(runtime, effects, instructions="v2").run(
        calls("a", "b"), session_id="s"
    )
    return result.output


async def test_a_replayed_tool_result_answers_under_the_new_call_id(
    runtime: PostgresRuntime, dsn: str
) -> None:
    effects = EffectsLog(dsn)
    assert await _rerun_with_new_instructions(runtime, effects) == (
        "done: recorded a, recorded b"
    )
    assert await effects.counts() == {"a": 1, "b": 2}


class CentsModel(DeterministicModel):
    """A deploy's model: each tool call it asks for carries other arguments."""

    def reply(self, messages: list[Any]) -> tuple[str, list[Any]]:
        text, tool_calls = super().reply(messages)
        return text, [c.model_copy(update={"args": {**c.args, "tag": f"{c.args['tag']}-cents"}})
                      for c in tool_calls]


async def test_a_resumed_run_calling_a_completed_position_with_other_arguments_diverges(
    runtime: PostgresRuntime, dsn: str
) -> None:
    # A deploy changed the instructions and the model: asked again, it calls the
    # tool of the journal's first position with other arguments. The call is not
    # executed: the run stops there, saying what was journaled and what it called.
    crashing = EffectsLog(dsn, on_start=crash_on("b"))
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO runs (request_id, scope, session_id, agent, prompt, status, attempts)"
            " VALUES ('req', %s, 's', 'default', 'p', 'running', 1)", (journal_scope("s", None),))
        await conn.execute("INSERT INTO run_attempts (request_id, attempt, worker, pid, epoch)"
                           " VALUES ('req', 1, 'w@h', 1, 0)")
    lease = await runtime.journal.acquire(journal_scope("s", None), 0)
    # A worker's request: its attempt's runs own their namespace.
    lease.request_id, lease.attempt = "req", 1
    with crashes(), run_options(lease=lease, epoch=0):
        await make_agent(runtime, crashing, instructions="v1").run(calls("a", "b"), session_id="s")
    effects = EffectsLog(dsn)
    with pytest.raises(BaseException) as info, run_options(lease=lease, epoch=0):
        await make_agent(runtime, effects, instructions="v2", model=CentsModel()).run(
            calls("a", "b"), session_id="s")
    exc = info.value
    diverged = exc.subgroup(Diverged) if isinstance(exc, BaseExceptionGroup) else exc
    while isinstance(diverged, BaseExceptionGroup):
        diverged = diverged.exceptions[0]
    assert isinstance(diverged, Diverged), repr(exc)
    assert diverged.step == "idem:tool_call_1_0"
    assert "'recorded a'" in diverged.journaled and "a-cents" in diverged.attempted
    assert await effects.counts() == {"a": 1, "b": 1}
    # The diverged attempt journaled its model call: asked the same, it calls the
    # same again. Another change, whose calls keep their arguments, replays tool a.
    with run_options(lease=lease, epoch=0):
        result = await make_agent(runtime, EffectsLog(dsn), instructions="v3").run(
            calls("a", "b"), session_id="s")
    await runtime.journal.release(lease)
    assert result.output == "done: recorded a, recorded b"
    assert await effects.counts() == {"a": 1, "b": 2}


async def test_loomflows_own_runtime_sends_the_stale_call_id(dsn: str) -> None:
    # The same scenario on loomflow's JournaledRuntime: the replayed result keeps
    # its old call id and the model refuses it. This is what the test above guards.
    effects = EffectsLog(dsn)
    runtime = JournaledRuntime(InMemoryJournalStore())
    with pytest.raises(UnmatchedToolResult):
        await _rerun_with_new_instructions(runtime, effects)


async def test_direct_steps_restamp_only_tool_results(runtime: PostgresRuntime) -> None:
    async def produce(call_id: str) -> ToolResult:
        return ToolResult.success(call_id, "out")

    class Stop(BaseException):
        pass

    with pytest.raises(Stop):
        async with runtime.session("direct"):
            first = await runtime.step("t", produce, call_id="old", idempotency_key="k")
            raise Stop
    async with runtime.session("direct"):
        again = await runtime.step("t", produce, call_id="new", idempotency_key="k")
    assert first.call_id == "old"
    assert again.call_id == "new"
    assert again.output == "out"
    assert runtime.stats.steps_replayed == 1


async def test_no_step_is_journaled_twice_across_a_crash_and_the_log_would_show_it(
    runtime: PostgresRuntime, dsn: str
) -> None:
    from .helpers import steps_journaled_twice

    crashing = EffectsLog(dsn, on_start=crash_on("b"))
    with crashes():
        await make_agent(runtime, crashing).run(calls("a", "b"), session_id="s")
    await make_agent(runtime, EffectsLog(dsn)).run(calls("a", "b"), session_id="s")
    assert steps_journaled_twice(dsn) == []
    # the check itself: a step written again shows up
    await runtime.journal.put_step("s", "idem:tool_call_1_0:x", 1)
    await runtime.journal.put_step("s", "idem:tool_call_1_0:x", 2)
    assert steps_journaled_twice(dsn) == [("s", "idem:tool_call_1_0:x", 2)]


async def test_journal_entries_carry_the_databases_clock_not_the_workers(
    runtime: PostgresRuntime, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Attempts are stamped by Postgres; so are journal entries, or `show`
    # would credit a step to the wrong attempt whenever a worker's clock is off.
    fast = time.time() + 3600
    monkeypatch.setattr(time, "time", lambda: fast)  # this worker's clock: an hour ahead
    await make_agent(runtime, EffectsLog(dsn)).run(calls("a", "b"), session_id="s", user_id="u")
    monkeypatch.undo()
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT count(*), max(abs(created_at - extract(epoch FROM now()))) FROM ("
            " SELECT created_at FROM journal_steps UNION ALL"
            " SELECT created_at FROM journal_streams) j"
        )
        row = await cur.fetchone()
    assert row is not None
    entries, off_by = row
    assert entries >= 5  # model calls, tool calls, the run marks
    assert off_by < 60, f"an entry is {off_by:.0f}s off the database's clock"


@pytest.mark.parametrize("memory", ["in-process", "none"])
async def test_a_run_resumed_by_a_worker_with_another_history(
    runtime: PostgresRuntime, dsn: str, memory: str
) -> None:
    # Worker 1 ran another request of this user, then crashed mid-run; worker
    # 2 resumes it. With loomflow's in-process memory worker 2 recalls a
    # different history, so the model inputs differ and the completed model
    # calls are sent again; with NoMemory they replay.
    def new_memory() -> InMemoryMemory:
        return NoMemory() if memory == "none" else InMemoryMemory()

    worker1 = new_memory()
    await make_agent(runtime, EffectsLog(dsn), memory=worker1).run(
        calls("x"), session_id="earlier", user_id="u"
    )
    first = DeterministicModel()
    with crashes():
        await make_agent(
            runtime, EffectsLog(dsn, on_start=crash_on("b")), model=first, memory=worker1
        ).run(calls("a", "b", "c"), session_id="s", user_id="u")
    assert first.calls == 2
    second = DeterministicModel()
    result = await make_agent(runtime, EffectsLog(dsn), model=second, memory=new_memory()).run(
        calls("a", "b", "c"), session_id="s", user_id="u"
    )
    assert result.output == "done: recorded a, recorded b, recorded c"
    assert second.calls == (2 if memory == "none" else 4)
