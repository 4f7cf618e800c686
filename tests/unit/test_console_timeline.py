"""The timeline picture's layout and the console's filters (pure logic, no services)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from loomflow_worker.admin import AttemptInfo, StepInfo
from loomflow_worker.console.data import Filters, parse_when
from loomflow_worker.console.timeline import LABEL_WIDTH, PLOT_WIDTH, layout
from loomflow_worker.runtime.errors import InvalidInput

T0 = datetime(2025, 6, 1, 14, 2, tzinfo=UTC)


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _attempt(n: int, start: float, end: float | None, outcome: str | None,
             next_start: float | None = None) -> AttemptInfo:
    return AttemptInfo(n, f"w{n}@host:{100 + n}", 100 + n, 0, _at(start),
                       None if end is None else _at(end), outcome,
                       None if next_start is None else _at(next_start))


def _step(key: str, at: float, executed_in: int, replayed_in: list[int]) -> StepInfo:
    return StepInfo(key=key, stream=False, written_at=_at(at), took=None, summary="ok",
                    executed_in=executed_in, replayed_in=replayed_in)


def test_a_crash_and_its_resume_are_two_lanes_with_replays_at_the_resume() -> None:
    attempts = [_attempt(1, 0, None, None, next_start=6), _attempt(2, 6, 10, "succeeded")]
    steps = [_step("model_call_1", 1, 1, [2]), _step("idem:tool_call_1_0", 2, 1, [2]),
             _step("model_call_2", 8, 2, [])]
    picture = layout(attempts, steps, now=_at(30), running=False)
    first, second = picture.lanes
    assert (first.outcome, second.outcome) == ("worker died", "succeeded")
    assert (first.executed, first.replayed, second.executed, second.replayed) == (2, 0, 1, 2)
    # The died lane's bar ends at its last write; a dashed line runs to the resume.
    assert first.x_end == pytest.approx(LABEL_WIDTH + 0.2 * PLOT_WIDTH)
    assert first.x_dashed_end == pytest.approx(second.x_start)
    assert second.x_end == pytest.approx(LABEL_WIDTH + PLOT_WIDTH)
    # Replays sit at the start of the lane that replayed them, in journal order.
    replays = [m for m in second.marks if m.kind == "replayed"]
    assert [m.name for m in replays] == ["model_call_1", "idem:tool_call_1_0"]
    assert all(second.x_start <= m.x < second.x_start + 20 for m in replays)
    executed = [m for m in second.marks if m.kind == "executed"]
    assert executed[0].x == pytest.approx(LABEL_WIDTH + 0.8 * PLOT_WIDTH - 2)
    assert picture.ticks[0].label == "14:02:00.000" and picture.ticks[-1].label == "+10.0s"


def test_a_running_attempt_runs_to_now_and_no_attempt_draws_no_lane() -> None:
    picture = layout([_attempt(1, 0, None, None)], [_step("a", 1, 1, [])], now=_at(4),
                     running=True)
    (lane,) = picture.lanes
    assert lane.outcome == "running" and lane.x_dashed_end is None
    assert lane.x_end == pytest.approx(LABEL_WIDTH + PLOT_WIDTH)
    assert layout([], [], now=T0, running=False).lanes == []


def test_filters_are_checked_and_time_windows_read() -> None:
    assert Filters.parse({"status": " failed ", "user": ""}) == Filters(status="failed")
    with pytest.raises(InvalidInput, match="one of queued"):
        Filters.parse({"status": "done"})
    with pytest.raises(InvalidInput, match="control character"):
        Filters.parse({"session": "a\x01"})
    assert parse_when("since", "90m", T0) == T0 - timedelta(minutes=90)
    assert parse_when("until", "2025-06-01 13:00", T0) == datetime(2025, 6, 1, 13, tzinfo=UTC)
    assert parse_when("until", "2025-06-01T15:00+02:00", T0).astimezone(UTC).hour == 13
    with pytest.raises(InvalidInput, match="until: 'soon' is neither"):
        parse_when("until", "soon", T0)
    assert Filters(status="queued", before=7).query_string(before=3) == {
        "status": "queued", "before": "3"}
