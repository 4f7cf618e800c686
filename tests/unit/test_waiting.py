"""The suite's waiting helper (``tests/waiting.py``): what it returns, how it
fails, and the rule that no test writes a deadline loop of its own."""

from __future__ import annotations

import ast
import itertools
import time
from pathlib import Path

import anyio
import pytest

from tests.waiting import SHOWN, wait_until, wait_until_async

TESTS = Path(__file__).resolve().parents[1]


def test_it_returns_the_first_truthy_value_the_condition_returned() -> None:
    values = iter([None, 0, "", [], ["found"], ["later"]])
    assert wait_until(lambda: next(values), "a list", 5, every=0) == ["found"]
    assert next(values) == ["later"]  # not called again once it held


def test_until_decides_and_the_value_is_returned_as_it_was() -> None:
    counts = itertools.count()
    assert wait_until(lambda: next(counts), "three", 5, until=lambda n: n >= 3, every=0) == 3
    # A falsy value that meets ``until`` is returned too.
    assert wait_until(lambda: 0, "zero", 5, until=lambda n: n == 0) == 0


def test_on_timeout_it_names_what_and_the_last_value_seen() -> None:
    counts = itertools.count()
    started = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        wait_until(lambda: next(counts), "ten thousand", 0.2, until=lambda n: n >= 10_000,
                   every=0.05)
    took = time.monotonic() - started
    message = str(failed.value)
    assert message.startswith("ten thousand: not within 0.2s; last seen: "), message
    last = int(message.rsplit(" ", 1)[1])
    assert 2 <= last < 100, message  # polled every 0.05 s for 0.2 s: a handful of times
    assert next(counts) == last + 1  # the last value it got is the one it shows
    assert 0.2 <= took < 2, took


def test_the_detail_is_called_only_on_timeout_and_a_long_value_is_cut() -> None:
    asked: list[str] = []

    def detail() -> str:
        asked.append("log")
        return "--- w1.log\nready."

    assert wait_until(lambda: True, "at once", 1, detail=detail) is True
    assert asked == []
    with pytest.raises(AssertionError) as failed:
        wait_until(lambda: "x" * (SHOWN * 2), "never", 0, until=lambda _: False, detail=detail)
    assert asked == ["log"]
    assert str(failed.value).endswith(f"... ({SHOWN * 2 + 2} characters)\n--- w1.log\nready.")


def test_an_error_in_the_condition_ends_the_wait_as_it_is() -> None:
    def exited() -> bool:
        raise RuntimeError("worker w1 exited at start")

    with pytest.raises(RuntimeError, match="exited at start"):
        wait_until(exited, "w1 ready", 5)


def test_the_async_twin_keeps_the_contract() -> None:
    counts = itertools.count()

    async def count() -> int:
        return next(counts)

    async def main() -> None:
        assert await wait_until_async(count, "two", 5, until=lambda n: n >= 2, every=0) == 2
        with pytest.raises(AssertionError, match=r"^never: not within 0.1s; last seen: \d+$"):
            await wait_until_async(count, "never", 0.1, until=lambda _: False, every=0.01)

    anyio.run(main)


# ---- the rule: no deadline loop of its own ------------------------------------------------------

# A loop that says why it is not a wait carries this on its first line.
NOT_A_WAIT = "# not a wait:"
CLOCKS = {"monotonic", "time", "perf_counter", "current_time"}


def _called(node: ast.AST) -> set[str]:
    return {c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", "")
            for c in ast.walk(node) if isinstance(c, ast.Call)}


def deadline_loops(source: str) -> list[int]:
    """The lines of the loops in ``source`` that poll by hand: a loop that
    sleeps, and reads a clock or leaves early (a ``break`` or a ``return``:
    in a ``for`` over ``range``, a deadline counted in turns)."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.While | ast.For | ast.AsyncFor):
            continue
        called = _called(node)
        leaves = any(isinstance(n, ast.Break | ast.Return) for n in ast.walk(node))
        if "sleep" in called and (called & CLOCKS or leaves) \
                and NOT_A_WAIT not in lines[node.lineno - 1]:
            found.append(node.lineno)
    return found


def test_no_test_writes_a_deadline_loop_of_its_own() -> None:
    found = {
        str(path.relative_to(TESTS)): lines
        for path in sorted(TESTS.rglob("*.py"))
        if path != TESTS / "waiting.py" and (lines := deadline_loops(path.read_text()))
    }
    assert found == {}, (
        "wait with tests/waiting.py's wait_until (or wait_until_async): it says what it "
        f"waited for and what it last saw when it times out. Deadline loops at: {found}")


@pytest.mark.parametrize("loop", [
    "deadline = time.monotonic() + 30\nwhile not ready():\n"
    "    assert time.monotonic() < deadline\n    time.sleep(0.1)\n",
    "with anyio.fail_after(5):\n    while True:\n        if await ready():\n            break\n"
    "        await anyio.sleep(0.01)\n",
    "for _ in range(500):\n    if ready():\n        break\n    time.sleep(0.01)\n",
    "def f():\n    while True:\n        if ready():\n            return 1\n        sleep(1)\n",
])
def test_the_rule_sees_a_deadline_loop(loop: str) -> None:
    assert deadline_loops(loop) != []


@pytest.mark.parametrize("loop", [
    "while True:\n    seen.append(sample())\n    time.sleep(0.05)\n",  # a watcher, cancelled
    "while proc.poll() is None:\n    seen.update(children())\n    time.sleep(0.05)\n",
    "while sending():  # not a wait: paced\n    if time.monotonic() < t:\n"
    "        time.sleep(0.05)\n",
    "for i in range(3):\n    send(i)\n",
    "for _ in range(3):\n    poke()\n    await asyncio.sleep(0.2)\n",  # paced, whole
])
def test_the_rule_leaves_other_loops_alone(loop: str) -> None:
    assert deadline_loops(loop) == []
