"""The agents module is found from the folder a command runs in, as the worker finds it."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

from loomflow_worker.execution.registry import import_agent_modules
from loomflow_worker.runtime.errors import InvalidInput


def _module_here(folder: Path, monkeypatch: pytest.MonkeyPatch, text: str,
                 path: list[str]) -> str:
    """A module of ``text`` in ``folder``, made the current folder, with
    ``sys.path`` set to ``path`` for the test; the module's name."""
    name = f"lfw_agents_{uuid.uuid4().hex[:8]}"
    (folder / f"{name}.py").write_text(text)
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", path)
    return name


def test_an_agents_module_in_the_current_folder_is_imported_as_celery_worker_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = _module_here(tmp_path, monkeypatch, "LOADED = True\n",
                        [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        import_agent_modules([name])
        assert sys.modules[name].LOADED is True
        assert sys.path[0] == str(tmp_path)
    finally:
        sys.modules.pop(name, None)


def test_a_module_found_nowhere_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(InvalidInput, match="can't import agents module 'lfw_no_such_agents'"):
        import_agent_modules(["lfw_no_such_agents"])


def test_a_module_that_fails_inside_is_not_retried_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The module is found, and what it imports is missing: that error is the answer.
    name = _module_here(tmp_path, monkeypatch, "import lfw_missing_dependency\n",
                        [str(tmp_path), *sys.path])
    with pytest.raises(InvalidInput, match="lfw_missing_dependency"):
        import_agent_modules([name])
    assert sys.path.count(str(tmp_path)) == 1
