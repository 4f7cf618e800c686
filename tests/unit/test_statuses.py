"""A request's statuses are defined once in Python (``Status``) and once in SQL
(the ``runs`` CHECK constraint and the functions queries use); they agree,
and no query spells a status list out (no services)."""

from __future__ import annotations

import re

from loomflow_worker.execution.statuses import TERMINAL, UNFINISHED, Status
from loomflow_worker.runtime.sql import migrations, queries

_LIST = re.compile(r"status IN \(([^)]*)\)")


def _names(text: str) -> set[str]:
    return set(re.findall(r"'(\w+)'", text))


def _latest(pattern: str) -> str:
    """The text ``pattern`` matched in the newest migration that has it."""
    for migration in reversed(migrations()):
        found = re.search(pattern, migration.sql, re.DOTALL)
        if found:
            return found[1]
    raise AssertionError(f"no migration matches {pattern!r}")


def test_the_runs_check_constraint_holds_exactly_the_enum_statuses() -> None:
    check = _latest(r"CONSTRAINT runs_status_check CHECK \(\s*status IN \(([^)]*)\)")
    assert _names(check) == {s.value for s in Status}


def test_the_sql_functions_name_the_unfinished_and_finished_statuses() -> None:
    unfinished = _latest(r"FUNCTION loomflow_worker_unfinished.*?status IN \(([^)]*)\)")
    finished = _latest(r"FUNCTION loomflow_worker_finished.*?status IN \(([^)]*)\)")
    assert _names(unfinished) == {s.value for s in UNFINISHED}
    assert _names(finished) == {s.value for s in TERMINAL}


def test_the_partial_index_of_unfinished_requests_names_the_unfinished_statuses() -> None:
    """The index keeps the literal list it was created with: a query asking
    ``loomflow_worker_unfinished`` matches it only while the two lists agree."""
    predicate = _latest(r"INDEX[^;]*runs_scope_open[^;]*WHERE\s*status IN \(([^)]*)\)")
    assert _names(predicate) == {s.value for s in UNFINISHED}


def test_no_query_spells_out_a_list_of_statuses() -> None:
    spelled = {name: _LIST.findall(sql) for name, sql in queries().items()}
    assert {name: found for name, found in spelled.items() if found} == {}
