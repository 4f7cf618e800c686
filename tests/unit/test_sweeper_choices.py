"""The sweeper's choice of what to dispatch again (pure logic, no services)."""

from __future__ import annotations

from loomflow_worker.execution.ledger import Pending
from loomflow_worker.tasks.recovery import confirm_lost


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
