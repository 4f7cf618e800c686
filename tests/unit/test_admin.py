"""The pure parts of loomflow_worker.admin: durations, secrets, which attempt did what."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from loomflow.core.types import ModelChunk, ToolCall, ToolResult
from loomflow.runtime import _codec
from pydantic import SecretStr, ValidationError

from loomflow_worker import admin
from loomflow_worker.runtime import InvalidInput
from loomflow_worker.runtime.prune import Pruner
from loomflow_worker.settings import Settings


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30d", 30 * 86400), ("12h", 43200), ("90m", 5400), ("45s", 45), ("1d12h", 129600),
     ("1d2h3m4s", 93784), (" 2H ", 7200), ("0s", 0)],
)
def test_durations(text: str, seconds: int) -> None:
    assert admin.parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("bad", ["", "30", "3x", "1h30d", "-5m", "1.5h", "d", "5 days", "5ms"])
def test_bad_durations_say_what_is_expected(bad: str) -> None:
    with pytest.raises(InvalidInput, match="is not a duration: use a number and a unit"):
        admin.parse_duration(bad)


def test_format_duration() -> None:
    assert admin.format_duration(0.0123) == "12ms"
    assert admin.format_duration(2.5) == "2.50s"
    assert admin.format_duration(30 * 86400) == "30d"
    assert admin.format_duration(129600) == "1d12h"


def test_secrets_are_found_and_scrubbed_in_every_form() -> None:
    settings = Settings(
        database_url=SecretStr("postgresql://app:p%40ss-w0rd@db:5432/x"),
        broker_url=SecretStr("redis://:brokerpw@r:6379/0"),
        result_backend=SecretStr("redis://r:6379/1"),
        events_url=SecretStr("host=db password=kvpass dbname=x"),
    )
    found = admin.secrets_of(settings)
    assert found == ["p%40ss-w0rd", "brokerpw", "kvpass"]
    text = "url postgresql://app:p%40ss-w0rd@db, decoded p@ss-w0rd, broker brokerpw, kv kvpass"
    assert admin.redact(text, found) == (
        "url postgresql://app:***@db, decoded ***, broker ***, kv ***")


def test_urls_are_shown_without_passwords() -> None:
    assert admin.sanitize_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert admin.sanitize_url("amqp://guest:guest@h:5672//") == "amqp://guest:***@h:5672//"
    assert admin.sanitize_url("redis://h:6379/0") == "redis://h:6379/0"
    assert admin.sanitize_url("redis://:p@ss@h:6379/0") == "redis://:***@h:6379/0"
    assert admin.sanitize_url("amqp://u:a@b@c@h//;redis://:x@y@h2/0") == (
        "amqp://u:***@h//;redis://:***@h2/0")
    assert (admin.sanitize_url("sentinel://:a@h1:26379;sentinel://:b@h2:26379")
            == "sentinel://:***@h1:26379;sentinel://:***@h2:26379")


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0?password=Qs3cret", "redis://127.0.0.1:6379/0?password=***"),
        ("rediss://h/1?ssl_cert_reqs=none&PASSWORD=Qs3cret&db=2",
         "rediss://h/1?ssl_cert_reqs=none&PASSWORD=***&db=2"),
        ("redis://h/0?pass=Qs3cret", "redis://h/0?pass=***"),
        ("sqs://h/?secret_key=Qs3cret&region=eu", "sqs://h/?secret_key=***&region=eu"),
        ("redis://h/0?auth_token=Qs3cret#frag", "redis://h/0?auth_token=***#frag"),
        ("amqp://h//?api_key=Qs3cret;amqp://h2//?access_token=Qs3cret",
         "amqp://h//?api_key=***;amqp://h2//?access_token=***"),
        ("redis://:pw@h/0?pass%77ord=Qs3cret&ssl_keyfile=/k.pem",
         "redis://:***@h/0?pass%77ord=***&ssl_keyfile=/k.pem"),
    ],
)
def test_credentials_in_a_query_string_are_masked(url: str, shown: str) -> None:
    assert admin.sanitize_url(url) == shown
    assert "Qs3cret" not in admin.sanitize_url(url)


def test_query_string_and_quoted_keyword_passwords_are_found_and_scrubbed() -> None:
    settings = Settings(
        database_url=SecretStr(r"host=db password='it\'s a b' dbname=x"),
        broker_url=SecretStr("redis://r:6379/0"),
        result_backend=SecretStr("redis://r:6379/1?password=q%20pw&db=1"),
        events_url=SecretStr("host=db password = 'x y z' dbname=x"),
    )
    found = admin.secrets_of(settings)
    assert found == ["it's a b", "q pw", "x y z"]
    text = (r"dsn host=db password='it\'s a b' dbname=x; url redis://r/1?password=q%20pw; "
            "kv password = 'x y z'")
    assert admin.redact(text, found) == (
        "dsn host=db password='***' dbname=x; url redis://r/1?password=***; "
        "kv password = '***'")


def test_a_settings_error_never_repeats_the_values_given() -> None:
    with pytest.raises(ValidationError) as info:
        Settings(database_url=SecretStr("postgresql://u:pw@h/x"), lease_timeout=1.0)
    assert "pw@h" not in admin.validation_message(info.value)
    assert ("lease_timeout (LOOMFLOW_WORKER_LEASE, 1.0s) must be at least three heartbeat "
            "intervals" in admin.validation_message(info.value))


def test_step_names_drop_the_namespace_and_the_fingerprint() -> None:
    assert admin.step_name("3/model_call_1@0123456789abcdef") == "model_call_1"
    assert admin.step_name("idem:tool_call_1_0:" + "a" * 64) == "idem:tool_call_1_0"
    assert admin.step_name("fetch") == "fetch"


def _attempt(n: int, started: float, ended: float | None, outcome: str | None) -> admin.AttemptInfo:
    def at(t: float | None) -> datetime | None:
        return None if t is None else datetime.fromtimestamp(t, tz=UTC)

    started_at = at(started)
    assert started_at is not None
    return admin.AttemptInfo(n, "w", 1, 0, started_at, at(ended), outcome)


def test_attribution_of_steps_to_the_attempts_that_executed_and_replayed_them() -> None:
    result = _codec.dumps(ToolResult(call_id="c", ok=True, output="recorded t1"))
    chunks = _codec.dumps([
        ModelChunk(kind="tool_call", tool_call=ToolCall(id="x", tool="record", args={"t": 1})),
        ModelChunk(kind="finish", finish_reason="tool_use"),
    ])
    attempts = [_attempt(1, 100.0, None, None), _attempt(2, 200.0, None, "dead"),
                _attempt(3, 300.0, 310.0, "succeeded")]
    entries = [
        (False, "idem:tool_call_1_0:" + "a" * 64, 101.0, result),  # attempt 1
        (True, "model_call_1@" + "1" * 16, 100.5, chunks),  # attempt 1
        (True, "model_call_2@" + "2" * 16, 102.0, chunks),  # attempt 1, run again in 3
        (True, "model_call_2@" + "3" * 16, 301.0, chunks),  # attempt 3
        (False, "fetch@" + "4" * 16, 102.5, _codec.dumps("a")),  # user steps: never "run again"
        (False, "fetch@" + "5" * 16, 302.0, _codec.dumps("b")),
        (False, "earlier@" + "6" * 16, 50.0, _codec.dumps(1)),  # before this request
    ]
    steps = admin.attribute_steps(entries, attempts)
    by_key = {s.key: s for s in steps}
    assert steps[0].key == "earlier@" + "6" * 16  # in write order
    tool = by_key["idem:tool_call_1_0:" + "a" * 64]
    assert (tool.executed_in, tool.replayed_in, tool.rerun_in) == (1, [3], [])
    assert tool.history() == "executed in attempt 1, replayed in 3"
    assert tool.summary == "ok: recorded t1"
    assert tool.took == pytest.approx(0.5)  # since the attempt's previous write
    assert by_key["model_call_1@" + "1" * 16].summary == 'model: calls record({"t": 1})'
    model_2 = by_key["model_call_2@" + "2" * 16]
    assert (model_2.replayed_in, model_2.rerun_in) == ([], [3])
    assert model_2.history() == "executed in attempt 1, run again (new inputs) in 3"
    assert by_key["model_call_2@" + "3" * 16].history() == "executed in attempt 3"
    assert by_key["fetch@" + "4" * 16].history() == "executed in attempt 1, replayed in 3"
    earlier = by_key["earlier@" + "6" * 16]
    assert (earlier.executed_in, earlier.replayed_in) == (None, [1, 3])
    assert earlier.history() == "written before this request, replayed in 1, 3"
    assert earlier.took is None


def test_a_value_that_is_not_loomflow_json_is_never_unpickled() -> None:
    import pickle

    assert admin.summarize_value(pickle.dumps({"x": 1}), "k").endswith("not JSON-encoded)")


def test_pruner_refuses_a_naive_cutoff_or_an_empty_batch() -> None:
    with pytest.raises(InvalidInput):
        Pruner(datetime.now(), batch_size=10)
    with pytest.raises(InvalidInput):
        Pruner(datetime.now(UTC), batch_size=0)


def test_an_attempts_outcome_says_what_it_counts_as_for_its_request() -> None:
    started = datetime.fromtimestamp(100.0, tz=UTC)
    later = datetime.fromtimestamp(200.0, tz=UTC)

    def died(**kwargs: Any) -> str | None:
        attempt = admin.AttemptInfo(1, "w", 1, 0, started, later, "died", later, **kwargs)
        assert attempt.said(last=False, running=False) == "worker died"
        return attempt.explained(last=False, running=False)

    assert "a crash of this request" in (died(isolation=2) or "")
    assert "ran alone" in (died(isolation=2) or "")
    shared = died(shared=True, died_with=3) or ""
    assert "died with 3 other requests' runs in it" in shared
    assert "not a crash of this request" in shared
    assert "a quarantine of a few suspected requests" in (died(shared=True, isolation=1) or "")
    interrupted = admin.AttemptInfo(1, "w", 1, 0, started, later, "interrupted")
    assert "not a crash" in (interrupted.explained(last=True, running=False) or "")
    done = admin.AttemptInfo(1, "w", 1, 0, started, later, "succeeded")
    assert done.explained(last=True, running=False) is None
    running = admin.AttemptInfo(1, "w", 1, 0, started, None, None)
    assert running.explained(last=True, running=True) is None


def test_journal_steps_are_named_as_a_person_reads_them() -> None:
    """A tool step by the call it ran, found in its model call's reply by call id
    (or, when the reply was asked again with new ids, by turn and slot)."""
    chunks = _codec.dumps([
        ModelChunk(kind="tool_call", tool_call=ToolCall(id="c1", tool="lookup", args={"q": "x"})),
        ModelChunk(kind="tool_call",
                   tool_call=ToolCall(id="c2", tool="charge", args={"order": 3, "note": "n"})),
        ModelChunk(kind="finish", finish_reason="tool_use"),
    ])

    def result(call_id: str) -> bytes:
        return _codec.dumps(ToolResult(call_id=call_id, ok=True, output="done"))

    entries = [
        (True, "2/model_call_1@" + "1" * 16, 100.1, chunks),
        (False, "2/idem:tool_call_1_1:" + "a" * 64, 100.2, result("c2")),
        (False, "2/idem:tool_call_1_0:" + "b" * 64, 100.3, result("old-id")),
        (False, "2/idem:tool_call_4_0:" + "c" * 64, 100.4, result("unknown")),
        (False, "2/persist_episode_2@" + "d" * 16, 100.5, _codec.dumps("e")),
        (False, "2/fetch@" + "e" * 16, 100.6, _codec.dumps("f")),
    ]
    steps = admin.attribute_steps(entries, [_attempt(1, 100.0, None, None)])
    assert [s.label for s in steps] == [
        "model call 1", 'tool charge(order=3, note="n")', 'tool lookup(q="x")',
        "tool call 4.0", "episode saved (turn 2)", "fetch"]
    assert steps[1].key == "2/idem:tool_call_1_1:" + "a" * 64
