"""The README and the documentation site, without services: every Python block compiles
and is run by a test (or is one of the few fragments), the settings reference names every
setting, the guarantees page names tests that exist, and the site's navigation lists
every page."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from loomflow_worker.settings import Settings
from tests.doc_blocks import DOCS, ROOT, Block, all_blocks, blocks, needs_worker

#: At most this many blocks may be fragments, compiled and not run.
MAX_FRAGMENTS = 3


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "settings_reference", DOCS / "hooks" / "settings_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("block", all_blocks(), ids=str)
def test_every_python_block_compiles(block: Block) -> None:
    ast.parse(block.code, filename=str(block))


def test_fragments_stay_few_and_every_other_block_is_run() -> None:
    found = all_blocks()
    assert len(found) >= 20, "the pages lost their examples"
    fragments = [str(b) for b in found if b.kind == "fragment"]
    assert len(fragments) <= MAX_FRAGMENTS, fragments
    # A file block is a module of the example's folder: a name Python can import.
    for block in found:
        if block.kind == "file":
            assert re.fullmatch(r"[a-z_]+\.py", block.title or ""), f"{block}: {block.title}"


def test_the_readme_is_short_and_its_example_is_whole() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 160, "the README is read in five minutes: ~150 lines"
    titles = [b.title for b in blocks(ROOT / "README.md") if b.kind == "file"]
    assert titles == ["myagents.py", "enqueue.py"]
    agents = blocks(ROOT / "README.md")[0].code
    assert "DeterministicModel()" in agents and "memory=NoMemory()" in agents
    assert "@tool(" in agents, "the README's agent has a tool"
    assert "python -m tests" in readme


def test_pages_with_requests_have_an_agent_to_run_them() -> None:
    for page in {b.page for b in all_blocks()}:
        shown = blocks(page)
        if needs_worker(shown) and page.name != "README.md":
            assert any(b.kind == "file" and "register_agent" in b.code for b in shown), (
                f"{page.relative_to(ROOT)} sends requests but registers no agent")


def test_the_settings_reference_names_every_setting_with_its_meaning() -> None:
    table = _hook().table()
    rows = table.splitlines()[2:]
    assert len(rows) == len(Settings.model_fields)
    for name, field in Settings.model_fields.items():
        variable = field.validation_alias if isinstance(field.validation_alias, str) \
            else f"LOOMFLOW_WORKER_{name.upper()}"
        row = next((r for r in rows if r.startswith(f"| `{variable}` |")), None)
        assert row is not None, f"{variable} is missing from the settings reference"
        assert len(row.rsplit("|", 2)[1].strip()) > 10, f"{variable} has no meaning: {row}"
    assert "| `LOOMFLOW_WORKER_LEASE` | float (> 0) | `30.0` |" in table
    page = (DOCS / "reference" / "settings.md").read_text()
    assert _hook().MARKER in page


def test_a_setting_without_words_fails_the_build() -> None:
    hook = _hook()

    class Bare(Settings):
        undocumented: int = 1

    with pytest.raises(ValueError, match=r"Bare\.undocumented has no docstring"):
        hook.table(Bare)


def test_the_guarantees_page_names_tests_that_exist() -> None:
    page = (DOCS / "guarantees.md").read_text()
    named = set(re.findall(r"`(test_[a-z0-9_]+)`", page))
    assert len(named) >= 30
    source = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    defined = set(re.findall(r"def (test_[a-z0-9_]+)", source))
    assert named <= defined, sorted(named - defined)
    files = set(re.findall(r"`(tests/[a-z_/]+\.py)`", page))
    assert files and all((ROOT / f).exists() for f in files), files
    for g in range(1, 8):
        assert f"| G{g} |" in page


def test_the_navigation_lists_every_page() -> None:
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)

    def listed(nav: object) -> set[str]:
        if isinstance(nav, str):
            return {nav}
        if isinstance(nav, list):
            return set().union(*(listed(item) for item in nav))
        if isinstance(nav, dict):
            return set().union(*(listed(item) for item in nav.values()))
        return set()

    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert listed(config["nav"]) == pages


def test_the_benchmarks_page_names_no_commit() -> None:
    page = (DOCS / "benchmarks.md").read_text()
    assert not re.search(r"`[0-9a-f]{7,40}`", page)
    for section in page.split("\n## ")[1:]:
        assert "python bench/" in section or section.startswith("Where the CPU goes"), (
            section.splitlines()[0])


def test_the_deploy_page_is_operations_md_itself() -> None:
    page = (DOCS / "operating" / "deploy-files.md").read_text()
    assert '--8<-- "deploy/OPERATIONS.md"' in page
    assert Path(ROOT / "deploy" / "OPERATIONS.md").exists()
