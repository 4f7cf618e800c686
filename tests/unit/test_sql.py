"""The query files: every query described and named once across the files
(no services)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loomflow_worker.runtime.errors import QueryError
from loomflow_worker.runtime.sql import gather, parse, query


def test_a_query_without_a_description_is_refused() -> None:
    with pytest.raises(QueryError, match=r"ledger\.sql: query 'bare' has no description"):
        parse("-- name: described\n-- Says why.\nSELECT 1;\n\n-- name: bare\nSELECT 2;\n",
              "ledger.sql")


def test_a_name_defined_in_two_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "journal.sql").write_text("-- name: twice\n-- The journal's.\nSELECT 1;\n")
    (tmp_path / "ledger.sql").write_text("-- name: twice\n-- The ledger's.\nSELECT 2;\n")
    files = [(p.name, p.read_text()) for p in sorted(tmp_path.iterdir())]
    with pytest.raises(QueryError, match=r"'twice' is defined in both journal\.sql and ledger"):
        gather(files)


@pytest.mark.parametrize(("text", "said"), [
    ("-- name: a\n-- One.\nSELECT 1;\n-- name: a\n-- Two.\nSELECT 2;\n", "defined twice"),
    ("SELECT 0;\n-- name: a\n-- One.\nSELECT 1;\n", "before the first"),
    ("-- name:a\n-- One.\nSELECT 1;\n", "is not a header"),
    ("-- name: a\n-- Only words.\n", "no statement"),
    ("-- name: a\n-- At 50% of the rows.\nSELECT 1;\n", "holds '%'"),
    ("-- name: a\n-- One.\nSELECT 1\n  -- a {} field\n  FROM t;\n", "holds '%' or a brace"),
])
def test_a_malformed_file_is_refused_saying_what_is_wrong(text: str, said: str) -> None:
    with pytest.raises(QueryError, match=said.replace("(", r"\(")):
        parse(text, "x.sql")


def test_a_file_parses_to_its_statements_with_their_descriptions() -> None:
    text = "-- The file's preamble.\n\n-- name: a\n-- What a does.\nSELECT 1;\n"
    assert parse(text) == {"a": "-- What a does.\nSELECT 1"}


def test_an_unknown_name_is_refused_naming_it() -> None:
    misspelt = "put_stpe"
    with pytest.raises(QueryError, match="no query is named 'put_stpe'"):
        query(misspelt)
