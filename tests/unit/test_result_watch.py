"""How the sweeper's leader tells that the result backend lost results (pure
logic, no services)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from loomflow_worker.sweeper.result_watch import EPOCH, ROLLBACK_SLACK, BackendMark, lost_since

NOW = datetime(2030, 1, 2, tzinfo=UTC)
DAY = 86400.0


def test_the_first_look_tells_nothing() -> None:
    assert lost_since(None, None, BackendMark(None, 0), NOW, DAY) is None


def test_the_mark_found_as_left_tells_nothing() -> None:
    assert lost_since(100.0, 3, BackendMark(100.0, 3), NOW, DAY) is None
    # A mark the ledger did not get to record (it failed after the backend took it).
    assert lost_since(100.0, 3, BackendMark(101.0, 3), NOW, DAY) is None


def test_the_mark_gone_loses_every_result_still_alive() -> None:
    loss = lost_since(100.0, 3, BackendMark(None, 0), NOW, DAY)
    assert loss is not None and loss.since == NOW - timedelta(days=1) and not loss.eviction
    assert "gone" in loss.why
    forever = lost_since(100.0, 3, BackendMark(None, 0), NOW, None)
    assert forever is not None and forever.since == EPOCH


def test_an_older_mark_loses_what_was_stored_after_it() -> None:
    back_to = NOW - timedelta(hours=2)
    loss = lost_since(NOW.timestamp(), 0, BackendMark(back_to.timestamp(), 0), NOW, DAY)
    assert loss is not None and loss.since == back_to - timedelta(seconds=ROLLBACK_SLACK)
    assert "older copy" in loss.why
    # Never further back than a result lives.
    loss = lost_since(NOW.timestamp(), 0, BackendMark(0.0, 0), NOW, DAY)
    assert loss is not None and loss.since == NOW - timedelta(days=1)


def test_evictions_may_have_taken_any_result() -> None:
    loss = lost_since(100.0, 3, BackendMark(100.0, 5), NOW, DAY)
    assert loss is not None and loss.eviction and loss.since == NOW - timedelta(days=1)
    assert "evicted 2 key(s)" in loss.why
    # A server restarted with its data counts evictions from zero again.
    assert lost_since(100.0, 3, BackendMark(100.0, 0), NOW, DAY) is None
    assert lost_since(100.0, None, BackendMark(100.0, 5), NOW, DAY) is None
