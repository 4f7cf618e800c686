"""Pure logic: identifiers, SQL loading, lock keys, the deterministic model."""

from __future__ import annotations

import anyio
import pytest
from loomflow.core.types import Message, Role, ToolCall

from loomflow_worker.runtime import InvalidInput, SessionBusy, scope_lock_key
from loomflow_worker.runtime.sql import migrations, queries
from loomflow_worker.runtime.validate import check_id
from loomflow_worker.testing import DeterministicModel, UnmatchedToolResult, plan


def test_every_query_loads_and_migrations_are_numbered_in_order() -> None:
    assert {"put_step", "load_namespace", "take_signal_into_journal"} <= set(queries())
    versions = [m.version for m in migrations()]
    # Each number once, from 1 up; a number may be held for a change made beside
    # this one (0037), so a gap is allowed.
    assert versions[0] == 1 and versions == sorted(set(versions))


def test_lock_keys_are_stable_signed_bigints() -> None:
    key = scope_lock_key("user:1:u:s")
    assert key == scope_lock_key("user:1:u:s")
    assert -(2**63) <= key < 2**63
    assert key != scope_lock_key("user:1:u:t")


@pytest.mark.parametrize("bad", ["", " ", "a\tb", "\x7f", "x" * 513, 5])
def test_bad_ids_are_refused(bad: object) -> None:
    with pytest.raises(InvalidInput):
        check_id("session_id", bad)


def test_good_ids_pass() -> None:
    assert check_id("session_id", "chat-42 été ✓") == "chat-42 été ✓"


def test_session_busy_says_what_to_do() -> None:
    assert "lock_wait_timeout" in str(SessionBusy("s", 2.0))
    assert "not allowed to wait" in str(SessionBusy("s", 0))


def test_plan_reads_turns_and_parallel_calls() -> None:
    prompt = 'hi\ncall a {"x": 1}\ncall b {} && c {"y": [2]}'
    assert plan(prompt) == [[("a", {"x": 1})], [("b", {}), ("c", {"y": [2]})]]


def _reply(model: DeterministicModel, messages: list[Message]) -> tuple[str, list[ToolCall]]:
    async def go() -> tuple[str, list[ToolCall]]:
        text, tool_calls, _usage, _finish = await model.complete(messages)
        return text, tool_calls

    return anyio.run(go)


def test_the_model_is_a_function_of_the_messages_with_fresh_ids() -> None:
    model = DeterministicModel()
    user = Message(role=Role.USER, content='call t {"k": 1}')
    text, first = _reply(model, [user])
    _, second = _reply(model, [user])
    assert text == "" and [c.tool for c in first] == ["t"] and first[0].args == {"k": 1}
    assert first[0].id != second[0].id  # a real call mints new ids
    answered = [
        user,
        Message(role=Role.ASSISTANT, content="", tool_calls=tuple(first)),
        Message(role=Role.TOOL, content="ok", tool_call_id=first[0].id),
    ]
    assert _reply(model, answered) == ("done: ok", [])
    assert model.calls == 3


def test_the_model_refuses_a_tool_result_with_a_stale_id() -> None:
    model = DeterministicModel()
    user = Message(role=Role.USER, content='call t {}')
    _, calls = _reply(model, [user])
    stale = [
        user,
        Message(role=Role.ASSISTANT, content="", tool_calls=tuple(calls)),
        Message(role=Role.TOOL, content="ok", tool_call_id="toolu_old"),
    ]
    with pytest.raises(UnmatchedToolResult, match="toolu_old"):
        _reply(model, stale)


def test_a_bad_setting_is_reported_without_its_value(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    from loomflow_worker.settings import Settings

    monkeypatch.setenv("LOOMFLOW_WORKER_DATABASE_URL", "postgresql://u:sekrit-pw@db/x")
    monkeypatch.setenv("LOOMFLOW_WORKER_MAX_RETRIES", "many")
    with pytest.raises(ValidationError) as info:
        Settings()
    assert "max_retries" in str(info.value)
    assert "sekrit-pw" not in str(info.value)


def test_a_tool_calls_position_is_its_namespace_turn_and_slot() -> None:
    from loomflow_worker.runtime.store import tool_position

    assert tool_position("idem:tool_call_1_0:ab12") == "idem:tool_call_1_0"
    assert tool_position("3/idem:tool_call_12_3:ab12") == "3/idem:tool_call_12_3"
    assert tool_position("0123456789abcdef/idem:tool_call_2_1:x:y") == (
        "0123456789abcdef/idem:tool_call_2_1")
    for key in ("model_call_1@ab", "3/model_call_2@cd", "persist_episode_1@x", "idem:other:x",
                "__run_epoch__"):
        assert tool_position(key) is None
