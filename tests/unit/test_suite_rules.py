"""Rules of the test suite itself (no services): a test module imports shared
pieces from a helpers module (``tests/integration/helpers.py``, the harness,
``tests/chaos/checks.py``, ``tests/needs.py``), never from another test module
or a conftest, so that moving or
deleting a test never breaks another; and a test that starts a process is
marked ``slow`` (the hook in ``tests/conftest.py``), so that the fast tier,
``-m "not slow"``, runs in one process."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(TESTS.parent).with_suffix("").parts)


def _imported(source: str, package: str) -> set[str]:
    """The modules ``source`` (a module of ``package``) imports, relative
    imports resolved, and for ``from package import name`` also
    ``package.name`` (it may be a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")[: len(package.split(".")) + 1 - node.level]
            module = ".".join([*(parts if node.level else []), *filter(None, [node.module])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _is_test_module(name: str) -> bool:
    """A test module, or a conftest (pytest loads it; a module importing it
    would load it again under another name, or in another order)."""
    last = name.rsplit(".", 1)[-1]
    return name.startswith("tests.") and (last.startswith("test_") or last == "conftest")


def test_no_test_module_imports_another() -> None:
    offending = {
        _module_name(path): sorted(
            m for m in _imported(path.read_text(), _module_name(path).rsplit(".", 1)[0])
            if _is_test_module(m))
        for path in sorted(TESTS.rglob("*.py"))
    }
    offending = {name: found for name, found in offending.items() if found}
    assert offending == {}, (
        "test modules import other test modules; move what they share to "
        f"tests/integration/helpers.py: {offending}"
    )


def test_the_rule_sees_relative_absolute_and_nested_imports() -> None:
    source = (
        "from .test_celery import x\nfrom . import test_cli\nfrom .helpers import calls\n"
        "import tests.chaos.test_chaos\nfrom ..chaos.test_sharing import y\n"
        "def f():\n    from tests.integration.test_eta import z\n"
        "from tests.conftest import ADMIN_DSN\nfrom tests.needs import PGBOUNCER\n"
    )
    found = {m for m in _imported(source, "tests.integration") if _is_test_module(m)}
    assert found == {"tests.integration.test_celery", "tests.integration.test_cli",
                     "tests.chaos.test_chaos", "tests.chaos.test_sharing",
                     "tests.integration.test_eta", "tests.conftest"}


STARTING = """
import subprocess
import sys

import pytest


def test_in_process() -> None:
    assert True


def test_starts_a_process_unmarked() -> None:
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.slow
def test_starts_a_process_marked_slow() -> None:
    subprocess.run([sys.executable, "-c", "pass"], check=True)
"""


@pytest.mark.slow
def test_a_test_that_starts_a_process_fails_unless_marked_slow(tmp_path: Path) -> None:
    sample = tmp_path / "test_sample.py"
    sample.write_text(STARTING)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
         "--rootdir", str(tmp_path), str(sample)],
        cwd=TESTS.parent, env={**os.environ, "CI": ""}, capture_output=True, text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed, 2 passed" in done.stdout, done.stdout
    assert ("test_sample.py::test_starts_a_process_unmarked started a process "
            "(subprocess.Popen ") in done.stdout, done.stdout
    assert "but is not marked slow" in done.stdout
