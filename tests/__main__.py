"""The whole suite in two phases: ``python -m tests [pytest options and paths]``.

1. every test not marked ``serial``, spread over several pytest processes
   (pytest-xdist, ``-n``): most of the suite waits (workers starting, sweeps,
   leases running out), so it runs side by side even on two CPUs;
2. the tests marked ``serial`` (those that load the machine on purpose or hold
   a wall-clock bound a busy machine would break), one at a time in one
   process, with nothing beside them.

Both phases get the options and paths given here; a ``-m`` expression is
combined with each phase's own. Both phases run, and a last line adds up
their counts (``tests: N passed, N failed``). The exit status is the first
failing phase's (pytest's 5, no test collected, only when neither phase ran a
test). ``LOOMFLOW_WORKER_TEST_PROCESSES`` sets how many processes run phase 1
(default 4; a ``-n`` given here wins). Where no Postgres or Redis answers,
both phases share private ones started here (``tests/stand_ins.py``)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence

from tests import stand_ins

PROCESSES = os.environ.get("LOOMFLOW_WORKER_TEST_PROCESSES", "4")
NO_TESTS = 5  # pytest's exit status when it collected no test

# pytest's closing line, e.g. "1 failed, 693 passed, 7 deselected in 445.73s (0:07:25)".
_SUMMARY = re.compile(r"=* *((?:\d+ [a-z]+(?:, )?)+) in [\d.]+s(?: \([\d:]+\))? *=*")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def split_marker(args: Sequence[str]) -> tuple[list[str], str | None]:
    """``args`` without their ``-m`` expression, and that expression (the last one)."""
    rest: list[str] = []
    marker: str | None = None
    items = iter(args)
    for arg in items:
        if arg == "-m":
            marker = next(items, None)
        elif arg.startswith("-m") and not arg.startswith("--"):
            marker = arg[2:].removeprefix("=")
        else:
            rest.append(arg)
    return rest, marker


def phase_args(args: Sequence[str], serial: bool) -> list[str]:
    """The pytest arguments of one phase."""
    rest, marker = split_marker(args)
    own = "serial" if serial else "not serial"
    combined = own if marker is None else f"({marker}) and {own}"
    given_n = any(a in ("-n", "--numprocesses") or a.startswith(("-n", "--numprocesses="))
                  for a in rest)
    parallel = [] if serial or given_n else ["-n", PROCESSES]
    color = [] if any(a.startswith("--color") for a in rest) or not sys.stdout.isatty() \
        else ["--color=yes"]
    return [*parallel, *color, *rest, "-m", combined]


def counts(line: str) -> Counter[str] | None:
    """The counts of pytest's closing line, or None for any other line."""
    found = _SUMMARY.fullmatch(_ANSI.sub("", line).strip())
    if found is None:
        return None
    return Counter({word: int(n) for n, word in
                    (part.split(" ") for part in found.group(1).split(", "))})


def run_phase(args: Sequence[str]) -> tuple[int, Counter[str]]:
    """Run pytest with ``args``, passing its output on; its exit status and counts."""
    found: Counter[str] = Counter()
    with subprocess.Popen([sys.executable, "-m", "pytest", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                          text=True, errors="replace") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            found = counts(line) or found
    return proc.returncode, found


def main(argv: Sequence[str]) -> int:
    codes: list[int] = []
    total: Counter[str] = Counter()
    started = stand_ins.start_missing()  # once, for both phases
    try:
        if started.notice is not None:
            print(started.notice, flush=True)
        for serial in (False, True):
            args = phase_args(argv, serial)
            print(f"--- {'serial' if serial else 'parallel'} phase: pytest {shlex.join(args)}",
                  flush=True)
            code, found = run_phase(args)
            codes.append(code)
            total.update(found)
    finally:
        started.stop()
    bad = [code for code in codes if code not in (0, NO_TESTS)]
    # A phase that failed without a test failing (a usage or internal error) counts once.
    failed = max(total["failed"] + total["error"] + total["errors"], len(bad))
    print(f"tests: {total['passed']} passed, {failed} failed, {total['skipped']} skipped")
    if bad:
        return bad[0]
    return NO_TESTS if all(code == NO_TESTS for code in codes) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
