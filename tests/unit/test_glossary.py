"""One word per idea (no services): a synonym once replaced does not come back.

The words are defined in docs/concepts.md. Each rule below names the word
to use; a line of the package, its SQL, its tests, benchmarks or docs that
uses a listed synonym fails, naming the file, the line and the word."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "loomflow_worker"

#: A synonym (a pattern, case-insensitive) -> the word to use instead.
SYNONYMS = {
    # An enqueue withholds a request (its fairness key's limit, its fair turn);
    # a worker holds a message unstarted. "Held" never means withheld.
    r"\bheld back\b": "withheld",
    r"\bholds? (?:(?:a |the )?requests? )?back\b": "withholds",
    r"\bheld requests?\b": "withheld request(s)",
    r"\bheld (?:in the ledger|for (?:its|their) fair turn)\b": "withheld",
    # What reaches the result backend is a ResultBackend; the leader's job that
    # stores results from the ledger is the ResultRepairer.
    r"\bResultRepair\b": "ResultBackend (or ResultRepairer, the job)",
    # An async connection is a Conn, a sync one a SyncConn (runtime/conns.py).
    r"\bAsyncConn\b": "Conn",
    # Quarantine is one word, its levels a QuarantineLevel (NONE, GROUP, ALONE).
    r"\bAloneRuns\b": "QuarantineRuns",
    r"\b(?:run|stop)_alone\b": "run_in_quarantine / stop_in_quarantine",
    r"\bmark_handed_alone\b": "mark_quarantined",
    # The ledger's twins: x (sync), x_async, x_batch or x_followup (a turn of
    # the lock connection), never a fifth spelling.
    r"\b(?:_hand_off_sync|send_hand_off|handoff_of|mark_lost_now|finishing)\(": (
        "hand_off / hand_off_async / hand_off_followup / hand_off_rows, mark_lost_async, "
        "finish_batch"),
}

#: Files whose words change with work under way elsewhere, and why; each
#: leaves this list when that work lands.
PENDING: set[str] = set()

#: The files read: code, SQL (the migrations are history, not read), templates,
#: tests, benchmarks and docs.
SUFFIXES = {".py", ".sql", ".md", ".html", ".js"}


def _files() -> list[Path]:
    found = []
    for folder in ("loomflow_worker", "tests", "bench", "docs", "deploy"):
        for path in sorted((ROOT / folder).rglob("*")):
            if (path.suffix in SUFFIXES and path.is_file()
                    and "migrations" not in path.parts and path != Path(__file__).resolve()):
                found.append(path)
    return [*found, ROOT / "README.md"]


def synonyms_in(text: str) -> list[tuple[int, str, str]]:
    """Each listed synonym in ``text``: its line number, the synonym, and the
    word to use."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern, word in SYNONYMS.items():
            flags = 0 if pattern.startswith(r"\bResult") else re.IGNORECASE
            for match in re.finditer(pattern, line, flags):
                found.append((number, match[0], word))
    return found


def test_the_rules_see_each_synonym_and_leave_the_words() -> None:
    text = ("the request is held back\nenqueues hold requests back on it\nEach held request\n"
            "results: ResultRepair\nconn: AsyncConn\na request held for its fair turn\n"
            "the request is withheld; a worker holds its message: held_at\n"
            "a ResultRepairer with its ResultBackend\nconn: Conn\n"
            "runs: AloneRuns\nrun_alone(job)\nledger.send_hand_off(scope)\n"
            "runs: QuarantineRuns\nrun_in_quarantine(job)\nledger.hand_off_followup(scope)\n")
    assert [(n, word) for n, _, word in synonyms_in(text)] == [
        (1, "withheld"), (2, "withholds"), (3, "withheld request(s)"),
        (4, "ResultBackend (or ResultRepairer, the job)"), (5, "Conn"), (6, "withheld"),
        (10, "QuarantineRuns"), (11, "run_in_quarantine / stop_in_quarantine"),
        (12, "hand_off / hand_off_async / hand_off_followup / hand_off_rows, "
             "mark_lost_async, finish_batch"),
    ]


def test_no_listed_synonym_comes_back() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{number}: {said!r}, say {word!r}"
        for path in _files() if str(path.relative_to(ROOT)) not in PENDING
        for number, said, word in synonyms_in(path.read_text())
    ]
    assert wrong == []


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_two_modules_share_a_name() -> None:
    names = Counter(path.name for path in _modules() if path.name != "__init__.py")
    assert [name for name, n in names.items() if n > 1] == []


@pytest.mark.parametrize("name", ["Conn", "SyncConn"])
def test_each_connection_name_is_defined_once(name: str) -> None:
    where = [
        str(path.relative_to(ROOT)) for path in _modules()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign | ast.AnnAssign)
        and any(isinstance(t, ast.Name) and t.id == name
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))
    ]
    assert where == ["loomflow_worker/runtime/conns.py"]


#: Modules that still log under another name than their own, and why.
LOGGING_PENDING: set[str] = set()


def test_every_module_logs_under_its_own_name() -> None:
    """``logging.getLogger(__name__)``: a record says which module wrote it.
    Naming another library's logger (to set its level) is not logging."""
    wrong = []
    for path in _modules():
        relative = str(path.relative_to(ROOT))
        if relative in LOGGING_PENDING:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "getLogger" and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and str(node.args[0].value).startswith("loomflow_worker")):
                wrong.append(f"{relative}:{node.lineno}: getLogger({node.args[0].value!r})")
    assert wrong == []
