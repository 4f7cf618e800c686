"""Admission's arithmetic on Celery's prefetch count (pure logic, no services)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from loomflow_worker.worker.admission import Admission


@dataclass
class QoS:
    """Celery's consumer QoS as admission uses it: a value under a mutex."""

    value: int
    _mutex: threading.RLock = field(default_factory=threading.RLock)


@dataclass
class Watch:
    late: float = 0.0

    def lag(self, within: float = 1.0) -> float:
        return self.late


def _admission(qos: QoS, depth: list[int]) -> Admission:
    return Admission(qos, ceiling=100, lag_limit=0.5, queue_limit=200,
                     queue_depth=lambda: depth[0], in_flight=lambda: 0)


def test_a_late_loop_stops_the_prefetch_and_recovery_gives_it_back_a_tenth_at_a_time() -> None:
    qos, depth, watch = QoS(100), [0], Watch()
    admission = _admission(qos, depth)
    admission.observe(watch)  # type: ignore[arg-type]
    assert (qos.value, admission.admitting) == (100, True)

    watch.late = 0.8
    admission.observe(watch)  # type: ignore[arg-type]
    assert (qos.value, admission.withheld, admission.admitting) == (1, 99, False)

    watch.late = 0.3  # under the limit, not yet under half of it: no change
    admission.observe(watch)  # type: ignore[arg-type]
    assert qos.value == 1 and not admission.admitting

    watch.late = 0.1
    values = []
    for _ in range(12):
        admission.observe(watch)  # type: ignore[arg-type]
        values.append(qos.value)
    assert admission.admitting
    assert values[:3] == [11, 21, 31] and values[-1] == 100 and admission.withheld == 0


def test_a_deep_lock_queue_pauses_too_and_slots_celery_adds_meanwhile_are_kept() -> None:
    qos, depth, watch = QoS(100), [250], Watch()
    admission = _admission(qos, depth)
    admission.observe(watch)  # type: ignore[arg-type]
    assert qos.value == 1 and not admission.admitting
    qos.value += 3  # Celery holds three eta messages meanwhile
    admission.observe(watch)  # type: ignore[arg-type]  # still over: withheld too
    assert qos.value == 1 and admission.withheld == 102
    depth[0] = 10
    for _ in range(20):
        admission.observe(watch)  # type: ignore[arg-type]
    assert qos.value == 103 and admission.withheld == 0


def test_a_consumer_with_prefetch_off_is_left_alone() -> None:
    qos, depth, watch = QoS(0), [0], Watch(late=2.0)
    admission = _admission(qos, depth)
    admission.observe(watch)  # type: ignore[arg-type]
    assert qos.value == 0 and admission.withheld == 0


def test_a_pause_with_nothing_to_withhold_still_ends_when_the_loop_recovers() -> None:
    # A prefetch of 1 (or none: unlimited) leaves nothing to take back; the
    # pause must end all the same (the gauge and the log say it takes requests).
    for value in (1, 0):
        qos, depth, watch = QoS(value), [0], Watch(late=2.0)
        admission = _admission(qos, depth)
        admission.observe(watch)  # type: ignore[arg-type]
        assert not admission.admitting and admission.withheld == 0
        watch.late = 0.1
        admission.observe(watch)  # type: ignore[arg-type]
        assert admission.admitting and (qos.value, admission.withheld) == (value, 0)


@dataclass
class AgedWatch:
    """A loop that was late ``age`` seconds ago, and on time since."""

    late: float
    age: float

    def lag(self, within: float = 1.0) -> float:
        return self.late if within >= self.age else 0.0


def test_lateness_from_before_admission_started_is_no_reason_to_pause() -> None:
    # The worker built its agents on the loop at start (1.3 s), then admission
    # started 0.1 s later: that lateness held no run, and pauses nothing.
    now = [100.0]
    qos = QoS(100)
    admission = Admission(qos, ceiling=100, lag_limit=0.5, queue_limit=200,
                          queue_depth=lambda: 0, in_flight=lambda: 0, clock=lambda: now[0])
    now[0] += 0.1
    admission.observe(AgedWatch(late=1.3, age=0.15))  # type: ignore[arg-type]
    assert admission.admitting and qos.value == 100
    # Lateness once it runs pauses it, as ever.
    now[0] += 2.0
    admission.observe(AgedWatch(late=1.3, age=0.15))  # type: ignore[arg-type]
    assert not admission.admitting and qos.value == 1
