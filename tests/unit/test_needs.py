"""What a test does without a program it needs, and what CI makes of a skip
(tests/needs.py, the hooks in tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.needs import CHROMIUM, PGBOUNCER, Program, skip_reason, skips_fail

ROOT = Path(__file__).resolve().parents[2]


def _program_in(folder: Path, name: str) -> Path:
    path = folder / name
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_a_program_is_found_on_path_by_any_of_its_names(tmp_path: Path) -> None:
    found = _program_in(tmp_path, "chromium-browser")
    assert CHROMIUM.find(path=str(tmp_path)) == str(found)
    assert CHROMIUM.find(path=str(tmp_path / "nowhere")) is None


def test_a_missing_program_skips_saying_what_to_install(tmp_path: Path) -> None:
    program = Program(("no-such-program-lfw",), "apt-get install no-such-program-lfw",
                      "the example tests")
    with pytest.raises(pytest.skip.Exception) as skipped:
        program.require()
    assert str(skipped.value) == (
        "`no-such-program-lfw` not found on PATH, needed by the example tests: "
        "apt-get install no-such-program-lfw")
    assert "apt-get install pgbouncer" in PGBOUNCER.missing_reason()
    assert "apt-get install chromium" in CHROMIUM.missing_reason()


def test_pgbouncer_is_looked_for_in_sbin_too() -> None:
    assert PGBOUNCER.sbin and not CHROMIUM.sbin


@pytest.mark.parametrize("value, fails", [
    ("true", True), ("TRUE", True), ("1", True), (" true ", True),
    ("", False), ("false", False), ("0", False), (None, False),
])
def test_only_ci_true_turns_skips_into_failures(value: str | None, fails: bool) -> None:
    assert skips_fail({} if value is None else {"CI": value}) is fails


def test_the_reason_of_a_skip_report() -> None:
    assert skip_reason(("t.py", 3, "Skipped: need x")) == "need x"
    assert skip_reason("plain") == "plain"


SKIPPING = """
import pytest

def test_needs_something() -> None:
    pytest.skip("needs something: apt-get install something")
"""


@pytest.mark.slow
@pytest.mark.parametrize("ci, code, outcome", [("", 0, "1 skipped"), ("true", 1, "1 failed")])
def test_under_ci_true_a_skip_fails_the_run(
    tmp_path: Path, ci: str, code: int, outcome: str
) -> None:
    """The suite's conftest hooks, on a test that skips: a pass without CI,
    a failure naming the skip's reason with CI=true."""
    sample = tmp_path / "test_sample.py"
    sample.write_text(SKIPPING)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
         "--rootdir", str(tmp_path), str(sample)],
        cwd=ROOT, env={**os.environ, "CI": ci}, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == code, done.stdout + done.stderr
    assert outcome in done.stdout
    if ci:
        assert ("skipped under CI=true, where every test must run: needs something: "
                "apt-get install something") in done.stdout
