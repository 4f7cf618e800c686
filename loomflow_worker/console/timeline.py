"""A run's timeline picture: one lane per attempt, one mark per journal step.

Pure layout (no I/O): :func:`layout` turns a run's attempts and attributed
journal entries into coordinates, which ``run.html`` draws as inline SVG.
Time runs left to right. A lane spans its attempt, from its start to its end
(or to now while it runs; for an attempt whose worker died, ended only when
the next began, a solid bar to its last journal write and a dashed one to the
next attempt's start). A step executed by an attempt is a mark where its journal
entry was written; a step an attempt replayed from the journal is a mark of
the other colour in that attempt's lane, at its start, where the replay
happens (in order, a few pixels apart).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from .. import admin

# Geometry, in SVG user units.
LABEL_WIDTH = 190.0
PLOT_WIDTH = 760.0
RIGHT_PAD = 110.0
AXIS_HEIGHT = 28.0
LANE_HEIGHT = 46.0
MARK_WIDTH = 4.0
MARK_HEIGHT = 20.0
REPLAY_SPACING = 6.0


@dataclass(frozen=True)
class Mark:
    x: float
    kind: str  # "executed" or "replayed"
    name: str
    title: str


@dataclass
class Lane:
    attempt: int
    worker: str
    outcome: str  # the attempt's outcome, "running", or "worker died"
    y: float
    x_start: float
    x_end: float  # the end of the solid bar
    x_dashed_end: float | None  # a died attempt: until the next attempt started
    started_at: datetime
    ended_at: datetime | None
    marks: list[Mark] = field(default_factory=list)
    # The version of its agent the attempt ran (None: not recorded).
    version: str | None = None
    # What its outcome means for the request (admin.AttemptInfo.explained).
    why: str | None = None

    @property
    def executed(self) -> int:
        return sum(1 for m in self.marks if m.kind == "executed")

    @property
    def replayed(self) -> int:
        return sum(1 for m in self.marks if m.kind == "replayed")

    @property
    def died(self) -> bool:
        return self.outcome == "worker died"


@dataclass(frozen=True)
class Tick:
    x: float
    label: str


@dataclass
class Timeline:
    width: float
    height: float
    lanes: list[Lane]
    ticks: list[Tick]
    origin: datetime | None

    @property
    def plot_left(self) -> float:
        return LABEL_WIDTH

    @property
    def plot_right(self) -> float:
        return LABEL_WIDTH + PLOT_WIDTH


def _clock(value: datetime) -> str:
    return value.strftime("%H:%M:%S.") + f"{value.microsecond // 1000:03d}"


def _span(seconds: float) -> str:
    return f"+{seconds * 1000:.0f}ms" if seconds < 1 else f"+{seconds:.1f}s"


def layout(
    attempts: Sequence[admin.AttemptInfo],
    steps: Sequence[admin.StepInfo],
    *,
    now: datetime,
    running: bool,
) -> Timeline:
    """The picture of a run (``running``: its status is ``running``)."""
    if not attempts:
        return Timeline(LABEL_WIDTH + PLOT_WIDTH + RIGHT_PAD, AXIS_HEIGHT, [], [], None)
    executed: dict[int, list[admin.StepInfo]] = {}
    replayed: dict[int, list[admin.StepInfo]] = {}
    for step in steps:
        if step.executed_in is not None:
            executed.setdefault(step.executed_in, []).append(step)
        for number in step.replayed_in:
            replayed.setdefault(number, []).append(step)

    # Each attempt's span in seconds from the first start.
    origin = attempts[0].started_at
    spans: list[tuple[float, float, float | None]] = []
    for i, attempt in enumerate(attempts):
        start = (attempt.started_at - origin).total_seconds()
        own = executed.get(attempt.attempt, [])
        writes = [(s.written_at - origin).total_seconds() for s in own]
        last_write = max(writes, default=start)
        dashed: float | None = None
        if attempt.ended_at is not None and attempt.outcome != "died":
            end = (attempt.ended_at - origin).total_seconds()
        elif i == len(attempts) - 1 and running:
            end = (now - origin).total_seconds()
        else:
            end = last_write
            if attempt.next_started_at is not None:
                dashed = (attempt.next_started_at - origin).total_seconds()
        spans.append((start, max(end, last_write, start), dashed))
    total = max([end for _, end, _ in spans] + [d for _, _, d in spans if d is not None])
    total = max(total, 1e-3)

    def x(seconds: float) -> float:
        return LABEL_WIDTH + max(0.0, min(seconds, total)) / total * PLOT_WIDTH

    lanes = []
    for i, (attempt, (start, end, dashed)) in enumerate(zip(attempts, spans, strict=True)):
        lane = Lane(
            attempt=attempt.attempt,
            worker=attempt.worker,
            version=attempt.agent_version,
            outcome=attempt.said(last=i == len(attempts) - 1, running=running),
            why=attempt.explained(last=i == len(attempts) - 1, running=running),
            y=AXIS_HEIGHT + i * LANE_HEIGHT,
            x_start=x(start),
            x_end=max(x(end), x(start) + 1.0),
            x_dashed_end=None if dashed is None else x(dashed),
            started_at=attempt.started_at,
            ended_at=attempt.ended_at,
        )
        again = replayed.get(attempt.attempt, [])
        room = max(lane.x_end - lane.x_start, PLOT_WIDTH / 4)
        spacing = min(REPLAY_SPACING, max(1.0, (room - MARK_WIDTH) / max(len(again), 1)))
        for n, step in enumerate(again):
            lane.marks.append(Mark(
                lane.x_start + 2 + n * spacing, "replayed", step.name,
                f"{step.label or step.name}: replayed from the journal at the start of attempt "
                f"{attempt.attempt} (executed in attempt {step.executed_in}); {step.summary}",
            ))
        for step in executed.get(attempt.attempt, []):
            at = (step.written_at - origin).total_seconds()
            lane.marks.append(Mark(
                x(at) - MARK_WIDTH / 2, "executed", step.name,
                f"{step.label or step.name}: executed in attempt {attempt.attempt}, journaled at "
                f"{_clock(step.written_at)} ({_span(at - start)} into the attempt); "
                f"{step.summary}",
            ))
        lanes.append(lane)
    ticks = [Tick(x(total * k / 4), _span(total * k / 4) if k else _clock(origin))
             for k in range(5)]
    height = AXIS_HEIGHT + len(lanes) * LANE_HEIGHT + 8
    return Timeline(LABEL_WIDTH + PLOT_WIDTH + RIGHT_PAD, height, lanes, ticks, origin)
