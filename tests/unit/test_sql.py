"""The query files: every query described and named once across the files,
every name the code asks for defined, every query defined used (no services)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from loomflow_worker.runtime.errors import QueryError
from loomflow_worker.runtime.sql import folder, folders, gather, parse, queries, query

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "loomflow_worker"


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


def test_a_file_parses_to_its_statements_each_named_without_its_comments() -> None:
    text = "-- The file's preamble.\n\n-- name: a\n-- What a does.\nSELECT 1;\n"
    assert parse(text) == {"a": "-- a\nSELECT 1"}


def test_an_unknown_name_is_refused_naming_it() -> None:
    misspelt = "put_stpe"  # not a literal argument: the scan below skips it
    with pytest.raises(QueryError, match="no query is named 'put_stpe'"):
        query(misspelt)


def _trees(*folders: str) -> list[ast.Module]:
    return [ast.parse(path.read_text()) for folder in folders
            for path in sorted((ROOT / folder).rglob("*.py"))]


def test_every_query_defined_is_used_by_the_package() -> None:
    """A query no code of the package names is dead: delete it."""
    named = {node.value for tree in _trees("loomflow_worker") for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert sorted(set(queries()) - named) == []


Takers = dict[tuple[bool, str], set[int]]


def _places(call: ast.Call, takers: Takers) -> set[int]:
    """Where ``call``'s callee takes a query's name: a method's (called on an
    object) when there is one of its name, else a function's."""
    func = call.func
    if isinstance(func, ast.Name):
        return takers.get((False, func.id), set())
    if isinstance(func, ast.Attribute):
        return takers.get((True, func.attr)) or takers.get((False, func.attr), set())
    return set()


def _query_takers(trees: list[ast.Module]) -> Takers:
    """Each function that passes one of its ``str`` parameters on as a query's
    name, to ``query`` or to another such function: ``(is a method, its
    name)`` and the parameter's positions (without ``self`` or ``cls``)."""
    takers: Takers = {(False, "query"): {0}}
    functions = [node for tree in trees for node in ast.walk(tree)
                 if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]
    grown = True
    while grown:
        grown = False
        for func in functions:
            params = func.args.posonlyargs + func.args.args
            method = [a.arg for a in params[:1]] in (["self"], ["cls"])
            named = {a.arg: i for i, a in enumerate(params[1:] if method else params)
                     if isinstance(a.annotation, ast.Name) and a.annotation.id == "str"}
            for call in (n for n in ast.walk(func) if isinstance(n, ast.Call)):
                for index in list(_places(call, takers)):
                    arg = call.args[index] if index < len(call.args) else None
                    if isinstance(arg, ast.Name) and arg.id in named:
                        places = takers.setdefault((method, func.name), set())
                        grown |= named[arg.id] not in places
                        places.add(named[arg.id])
    return takers


def _passed_names(trees: list[ast.Module], takers: Takers) -> set[str]:
    """The literal strings given where a query's name is taken."""
    found = set()
    for tree in trees:
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            for index in _places(call, takers):
                arg = call.args[index] if index < len(call.args) else None
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.add(arg.value)
    return found


def test_every_query_name_the_code_passes_is_defined() -> None:
    """A literal name given to ``query`` or to a function that hands it on
    (``_rows(conn, "scope_busy", ...)``, ``Statement.of("put_step", ...)``)
    names a query of the files. Names held in tables first (the sweeper's
    and the pruner's loops) are not followed here; ``query`` refuses them
    at their first use."""
    trees = _trees("loomflow_worker", "tests", "bench")
    passed = _passed_names(trees, _query_takers(trees))
    assert len(passed) > 80
    assert sorted(passed - set(queries())) == []


#: The driver's calls that send a statement, by their method's name.
SENDS = {"execute", "executemany", "copy", "stream"}


def _written_in_python(tree: ast.Module) -> list[int]:
    """The lines where ``tree`` sends a statement written in Python: a string,
    an f-string or a concatenation given to one of :data:`SENDS`, or a name the
    module binds to a string."""
    strings = {target.id for node in tree.body if isinstance(node, ast.Assign)
               and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
               for target in node.targets if isinstance(target, ast.Name)}
    found = []
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        if not (isinstance(call.func, ast.Attribute) and call.func.attr in SENDS and call.args):
            continue
        first = call.args[0]
        if (isinstance(first, ast.JoinedStr | ast.BinOp)
                or (isinstance(first, ast.Constant) and isinstance(first.value, str))
                or (isinstance(first, ast.Name) and first.id in strings)):
            found.append(call.lineno)
    return found


def test_the_package_sends_only_the_statements_of_the_files() -> None:
    """Every statement the package sends is a query of a layer's ``sql/*.sql`` files
    (``query(name)``), so each is described, and found with its owner's."""
    wrong = [f"{path.relative_to(ROOT)}:{line}"
             for path in sorted(PACKAGE.rglob("*.py"))
             for line in _written_in_python(ast.parse(path.read_text()))]
    assert wrong == [], "move these statements to their layer's sql/*.sql and send query(name)"


def test_the_rule_sees_literals_f_strings_and_module_strings() -> None:
    source = (
        'DDL = "CREATE TABLE t (x int)"\n'
        'async def f(conn, cur, name):\n'
        '    await conn.execute("SELECT 1")\n'
        '    await conn.execute(f"LISTEN {name}")\n'
        '    cur.execute("SELECT " + name)\n'
        '    await conn.execute(DDL)\n'
        '    await conn.execute(query("get_step"), {})\n'
        '    await conn.execute(sql.SQL(query("drop_database")).format(name))\n'
    )
    assert sorted(_written_in_python(ast.parse(source))) == [3, 4, 5, 6]


def test_every_sql_file_of_the_package_is_read() -> None:
    """A query file placed anywhere but a layer's ``sql/`` folder would be
    read by no one: every ``*.sql`` file outside the migrations is one the
    loader reads."""
    read = {source for path in folders() for source, _ in folder(path)}
    files = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.sql")
             if "migrations" not in path.parts}
    assert files - read == set()
    assert read <= files


#: psycopg parses a query's placeholders once and caches it only up to this many
#: bytes (psycopg/_queries.py, MAX_CACHED_STATEMENT_LENGTH); a longer one is parsed
#: again at every execute.
PSYCOPG_CACHED_LENGTH = 4096


def test_every_query_run_often_is_short_enough_for_psycopg_to_parse_it_once() -> None:
    """As sent (comment lines dropped), each query is within what psycopg caches,
    but two: ``orphans`` runs once a sweep, and ``start_request`` is prepared once
    by fastpath. With its comments, ``insert_run`` (every enqueue) was 4,574 bytes
    and was parsed again each time."""
    long = {name for name, sql in queries().items()
            if len(sql.encode()) > PSYCOPG_CACHED_LENGTH}
    assert long == {"orphans", "start_request"}, long
    assert queries()["insert_run"].startswith("-- insert_run\nINSERT INTO runs")
