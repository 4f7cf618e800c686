"""The sweeper's choice of what to dispatch again (pure logic, no services)."""

from __future__ import annotations

import time

from pydantic import SecretStr

from loomflow_worker.execution.pending import Pending
from loomflow_worker.settings import Settings
from loomflow_worker.sweeper.leader import MIN_PAUSE, Sweeper
from loomflow_worker.sweeper.recovery import confirm_lost


def pending(request_id: str) -> Pending:
    return Pending(request_id, "run", "s", None, "default", "p", {})


def test_a_running_orphan_goes_at_once() -> None:
    chosen, suspects = confirm_lost([(pending("r"), "running")], {}, now=10.0, confirm=1.0)
    assert [p.request_id for p, _ in chosen] == ["r"] and suspects == {}


def test_a_queued_orphan_goes_only_once_it_looked_lost_for_a_while() -> None:
    orphans = [(pending("q"), "queued")]
    chosen, suspects = confirm_lost(orphans, {}, now=10.0, confirm=1.0)
    assert chosen == [] and suspects == {"q": 10.0}
    chosen, suspects = confirm_lost(orphans, suspects, now=10.5, confirm=1.0)
    assert chosen == [] and suspects == {"q": 10.0}
    chosen, suspects = confirm_lost(orphans, suspects, now=11.0, confirm=1.0)
    assert [p.request_id for p, _ in chosen] == ["q"] and suspects == {}


def test_a_suspect_that_turned_up_is_forgotten() -> None:
    _, suspects = confirm_lost([(pending("q"), "queued")], {}, now=10.0, confirm=1.0)
    # Its attempt started: it is no orphan on the next sweep ...
    _, suspects = confirm_lost([], suspects, now=10.5, confirm=1.0)
    assert suspects == {}
    # ... and if it looks lost again later, the wait starts over.
    chosen, suspects = confirm_lost([(pending("q"), "queued")], suspects, now=20.0, confirm=1.0)
    assert chosen == [] and suspects == {"q": 20.0}


def test_the_leader_sweeps_when_the_next_orphan_is_due() -> None:
    made = Sweeper(Settings(database_url=SecretStr("postgresql://h/db")), lambda _: None)
    assert made._pause(1.0) == 1.0
    made._next_orphan = time.monotonic() + 0.3
    assert 0.2 < made._pause(1.0) <= 0.3
    # Once: the sweep after it computes the next one.
    assert made._pause(1.0) == 1.0
    made._next_orphan = time.monotonic() + 5.0
    assert made._pause(1.0) == 1.0
    made._next_orphan = time.monotonic() - 1.0
    assert made._pause(1.0) == MIN_PAUSE
