"""How an attempt decides the end of its request (pure logic, no services)."""

from __future__ import annotations

import json

import pytest

from loomflow_worker.execution.ledger import Started
from loomflow_worker.execution.outcome import (
    Ending,
    Outcome,
    OutcomeKind,
    Retry,
    ended,
    ending_before_run,
    ending_of_error,
    time_limit_ending,
)
from loomflow_worker.execution.statuses import TERMINAL, QuarantineLevel, Status
from loomflow_worker.runtime import InvalidInput
from loomflow_worker.settings import Settings
from loomflow_worker.worker.quarantine.child import decode_outcome, encode_outcome

SETTINGS = Settings(max_crashes=3, max_retries=2)


def started(**fields: object) -> Started:
    base: dict[str, object] = {"status": "running", "seq": 1, "epoch": 0, "attempt": 1}
    return Started(**{**base, **fields})  # type: ignore[arg-type]


def test_a_request_whose_worker_died_too_often_ends_dead() -> None:
    ending = ending_before_run(started(crashes=3, attempt=4), SETTINGS, "w1@h:12")
    assert isinstance(ending, Ending) and ending.status == "dead"
    assert ending.error_type == "WorkerDied"
    assert ending.error is not None and "died 3 times" in ending.error and "w1@h:12" in ending.error
    assert ending_before_run(started(crashes=2), SETTINGS, "w") is None


def test_a_request_cancelled_while_it_waited_ends_cancelled_without_running() -> None:
    ending = ending_before_run(started(cancel_requested=True), SETTINGS, "w")
    assert ending == Ending("cancelled", error="cancelled before it started",
                            error_type="Cancelled", note=" before it started")


def test_death_counts_before_a_cancel() -> None:
    ending = ending_before_run(started(crashes=5, cancel_requested=True), SETTINGS, "w")
    assert ending is not None and ending.status == "dead"


def test_an_error_is_retried_with_backoff_until_the_retries_are_spent() -> None:
    waits: list[int] = []

    def backoff(failures: int) -> float:
        waits.append(failures)
        return 0.5 * failures

    first = ending_of_error(RuntimeError("model overloaded"), started(failures=0), SETTINGS,
                            backoff)
    assert isinstance(first, Retry) and (first.failures, first.countdown) == (1, 0.5)
    second = ending_of_error(RuntimeError("again"), started(failures=1), SETTINGS, backoff)
    assert isinstance(second, Retry) and second.failures == 2
    last = ending_of_error(RuntimeError("still"), started(failures=2, attempt=3), SETTINGS,
                           backoff)
    assert isinstance(last, Ending) and last.status == "failed"
    assert last.error == "RuntimeError: still" and last.error_type == "RuntimeError"
    assert last.note == " after 3 attempts: RuntimeError: still"
    assert waits == [1, 2]


def test_bad_input_fails_at_once() -> None:
    ending = ending_of_error(InvalidInput("no such agent"), started(), SETTINGS, lambda n: 1.0)
    assert isinstance(ending, Ending) and ending.status == "failed"
    assert ending.error_type == "InvalidInput"


def test_a_run_past_its_time_limit_fails_with_time_limit_exceeded() -> None:
    ending = time_limit_ending(2.5)
    assert ending.status == "failed" and ending.error_type == "TimeLimitExceeded"
    assert ending.error is not None and "2.5s time limit" in ending.error
    assert "LOOMFLOW_WORKER_RUN_TIME_LIMIT" in ending.error
    per_call = time_limit_ending(2.5, per_call=True).error
    assert per_call is not None and "apply_async's time_limit or soft_time_limit" in per_call


def test_only_the_outcomes_that_end_a_request_are_ended() -> None:
    assert {kind for kind in OutcomeKind if kind.ended} == {
        OutcomeKind.SUCCEEDED, OutcomeKind.FAILED, OutcomeKind.DEAD, OutcomeKind.CANCELLED}
    # Each is a terminal status of the ledger, by the same text.
    assert {str(kind) for kind in OutcomeKind if kind.ended} <= {str(s) for s in TERMINAL}


def test_an_ending_takes_its_kind_from_a_status() -> None:
    outcome = ended(Status.SUCCEEDED, None, result={"output": "x"})
    assert outcome.kind is OutcomeKind.SUCCEEDED and not outcome.handed


@pytest.mark.parametrize(("quarantine", "slots", "level"), [
    (0, 8, QuarantineLevel.NONE), (0, 1, QuarantineLevel.ALONE),
    (1, 8, QuarantineLevel.GROUP), (2, 8, QuarantineLevel.ALONE), (1, 1, QuarantineLevel.GROUP),
])
def test_the_quarantine_a_process_gives(quarantine: int, slots: int,
                                         level: QuarantineLevel) -> None:
    assert QuarantineLevel.given(quarantine, slots) is level


def test_an_outcome_crosses_the_quarantine_pipe_as_it_was() -> None:
    """A process of quarantine sends its attempt's outcome as JSON: its kind
    and level come back as the enums they were."""
    sent = Outcome(OutcomeKind.QUARANTINE, quarantine=QuarantineLevel.ALONE, dispatch=[])
    back = decode_outcome(json.loads(json.dumps(encode_outcome(sent))))
    assert back == sent
    assert back.kind is OutcomeKind.QUARANTINE and back.quarantine is QuarantineLevel.ALONE
