"""The package's layers import one way, with no circles (no services).

runtime (journal, locks, SQL, migrations, prune) <- execution (the ledger and
one attempt of a request, no Celery; what it needs of its worker process it
declares in execution.host) <- sweeper (what the fleet's leader does, no
Celery) and worker (what a worker process is: its context and parts, its
loop, admission, pool and connections, quarantine's processes) <- tasks (the
Celery binding); execution <- admin (operator tools, no Celery) <- faces
(the CLI, the demo, the console). Settings, events and metrics are leaves
anyone may use; the live events, sockets and the loop watch are the
worker's, not execution's."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from loomflow_worker.runtime.sql import folder, folders, parse, queries

PACKAGE = Path(__file__).resolve().parents[2] / "loomflow_worker"
NAME = "loomflow_worker"


@pytest.mark.slow
@pytest.mark.parametrize(
    "module", ["loomflow_worker", "loomflow_worker.runtime", "loomflow_worker.execution.execute",
               "loomflow_worker.sweeper.leader", "loomflow_worker.worker.context",
               "loomflow_worker.worker.quarantine.child"]
)
def test_the_runtime_and_execution_load_no_celery(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('celery', 'kombu', "
        "'billiard', 'click'))\n"
        "print(','.join(loaded))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)
    assert done.stdout.strip() == "", f"importing {module} loaded {done.stdout.strip()}"


def _modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _imports(module: str, path: Path, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules ``module`` imports, anywhere in it: in a function,
    and under ``if TYPE_CHECKING:`` too (a circle a type checker must follow
    is one all the same)."""
    tree = ast.parse(path.read_text())
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - (node.level - is_package)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets.update(
                f"{target}.{a.name}" if f"{target}.{a.name}" in known else target
                for a in node.names
            )
    out = set()
    for target in targets:
        while target not in known and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in known and target != module:
            out.add(target)
    return out


def test_imports_for_type_checking_count(tmp_path: Path) -> None:
    path = tmp_path / "mod.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from .store import Lease\n"
        "def later() -> None:\n"
        "    from . import codec\n"
    )
    known = {f"{NAME}.runtime.{m}" for m in ("mod", "store", "codec")}
    assert _imports(f"{NAME}.runtime.mod", path, False, known) == {
        f"{NAME}.runtime.store", f"{NAME}.runtime.codec"
    }


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, pkg, set(modules)) for m, (p, pkg) in modules.items()}


def test_no_import_circles() -> None:
    graph = _graph()
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                circles.append([*path[path.index(dep):], dep])
            elif dep not in state:
                visit(dep)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert circles == []


CONSOLE = f"{NAME}.console"


def _layers(*names: str) -> set[str]:
    return {f"{NAME}.{name}" for name in names}


LAYERS = {
    f"{NAME}.runtime": _layers("execution", "sweeper", "worker", "tasks", "cli", "admin", "demo",
                               "events", "metrics", "console", "durations"),
    # The worker process's concerns (its live events, sockets, loop watch)
    # reach an attempt only through execution.host.
    f"{NAME}.execution": _layers("sweeper", "worker", "tasks", "cli", "admin", "demo", "console",
                                 "events", "sockets", "runtime.loopwatch"),
    # The sweeper is the leader's jobs; the Celery binding starts it, and gives
    # it how to publish and reach the result backend.
    f"{NAME}.sweeper": _layers("worker", "tasks", "cli", "admin", "demo", "console"),
    # A worker process, with Celery's pieces but not the binding's tasks.
    f"{NAME}.worker": _layers("sweeper", "tasks", "cli", "admin", "demo", "console"),
    # The Celery binding uses the runtime's prune, not the operator tools.
    f"{NAME}.tasks": _layers("cli", "demo", "admin", "console"),
    # Operator tools (one module per job) serve the faces; they use no Celery.
    # The console is a face: the CLI and the demo start it, nothing else imports it.
    f"{NAME}.admin": _layers("sweeper", "worker", "tasks", "cli", "demo", "console"),
    f"{NAME}.durations": _layers("execution", "sweeper", "worker", "tasks", "admin", "cli",
                                 "console"),
    f"{NAME}.pricing": _layers("runtime", "execution", "sweeper", "worker", "tasks", "admin",
                               "cli", "metrics", "console"),
    f"{NAME}.settings": _layers("runtime", "execution", "sweeper", "worker", "tasks", "admin",
                                "cli", "events", "console"),
    f"{NAME}.events": _layers("execution", "sweeper", "worker", "tasks", "admin", "cli", "console"),
    # Traces are a leaf every layer may use; its SDK half only the worker's hooks.
    **{f"{NAME}.{leaf}": _layers("runtime", "execution", "sweeper", "worker", "tasks", "admin",
                                 "cli", "demo", "console", "settings", "events", "metrics")
       for leaf in ("tracing", "tracing_export")},
}


def test_each_layer_imports_only_those_below_it() -> None:
    graph = _graph()
    wrong = []
    for module, deps in graph.items():
        for layer, forbidden in LAYERS.items():
            if module == layer or module.startswith(layer + "."):
                wrong += [f"{module} imports {dep}" for dep in deps
                          if any(dep == f or dep.startswith(f + ".") for f in forbidden)]
    assert wrong == []


@pytest.mark.parametrize(
    "module", [f"{NAME}.defaults", f"{NAME}.execution.statuses", f"{NAME}.lazy"]
)
def test_what_the_command_reads_before_parsing_imports_none_of_the_package(module: str) -> None:
    assert _graph()[module] == set()


@pytest.mark.slow
@pytest.mark.parametrize("package", [NAME, f"{NAME}.runtime"])
def test_every_name_a_package_exports_on_first_use_is_there(package: str) -> None:
    code = (
        f"import {package} as p\n"
        "missing = [n for n in p.__all__ if getattr(p, n, None) is None]\n"
        "print(','.join(missing))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)
    assert done.stdout.strip() == ""


#: Where each layer defines its errors: the runtime's (and the base class) in
#: errors.py, execution's (how a request ended) in request_errors.py; the
#: others define none.
ERRORS = {"runtime": "errors.py", "execution": "request_errors.py"}


def test_each_layer_defines_its_errors_in_its_errors_module() -> None:
    wrong = []
    for layer in ("runtime", "execution", "sweeper", "worker", "tasks", "admin"):
        for path in (PACKAGE / layer).rglob("*.py"):
            if path.name == ERRORS.get(layer):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and any(
                    (base.id if isinstance(base, ast.Name) else getattr(base, "attr", ""))
                    .endswith(("Error", "Exception")) for base in node.bases
                ):
                    wrong.append(f"{path.relative_to(PACKAGE)}: {node.name}")
    assert wrong == []


#: A statement on the ``runs`` ledger: it names one of the ledger's tables.
LEDGER_TABLES = re.compile(r"\b(?:FROM|JOIN|UPDATE|INTO)\s+(?:runs|run_attempts)\b", re.IGNORECASE)


#: The ledger's gateways: execution's modules, and the sweeper's two.
GATEWAYS = (f"{NAME}.execution.", f"{NAME}.sweeper.ledger_recovery",
            f"{NAME}.sweeper.ledger_results")


def test_the_ledger_is_reached_only_through_its_gateways() -> None:
    """Every statement on the ``runs`` ledger is run by an ``execution``
    module or one of the sweeper's two ledger gateways (a query is run by the
    module that names it, in a call or in a table of names). The runtime's
    prune reaches the ledger only through the two views the ledger's schema
    defines for it (migration 0030)."""
    ledger = {name for name, text in queries().items() if LEDGER_TABLES.search(text)}
    wrong = []
    for module, (path, _) in sorted(_modules().items()):
        if module.startswith(GATEWAYS):
            continue
        named = _named_queries(path, ledger)
        wrong += [f"{module} runs {name}" for name in sorted(named)]
    assert wrong == []


def _named_queries(path: Path, names: set[str]) -> set[str]:
    """The queries of ``names`` a module names (in a call or a table of names),
    leaving out the names it exports (``__all__``, a package's lazy map)."""
    tree = ast.parse(path.read_text())
    exported = {
        id(const) for node in ast.walk(tree)
        for const in (
            node.keys if isinstance(node, ast.Dict) and path.name == "__init__.py"
            else node.value.elts if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            and isinstance(node.value, ast.List | ast.Tuple)
            else []
        )
    }
    return {
        node.value for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in names and id(node) not in exported
    }


def test_each_query_lives_with_the_lowest_layer_that_runs_it() -> None:
    """A query lives in its owner's ``sql/`` folder (``execution/sql``: the
    ledger's, ``sweeper/sql``: the sweeper's...) and is run by its owner or by
    a layer above it, never by one below: a query two layers run lives with
    the lower one, and no layer runs SQL that lives above it."""
    owner = {name: f"{NAME}.{path.split('/')[0]}"
             for path in folders() for source, text in folder(path)
             for name in parse(text, source)}
    assert set(owner) == set(queries())
    wrong = []
    for module, (path, _) in sorted(_modules().items()):
        for layer, forbidden in LAYERS.items():
            if module == layer or module.startswith(layer + "."):
                wrong += [f"{module} runs {name}, which lives in {owner[name]}"
                          for name in sorted(_named_queries(path, set(owner)))
                          if owner[name] in forbidden]
    assert wrong == []


def test_the_sweeper_imports_no_celery_even_in_a_function() -> None:
    """The Celery binding gives the sweeper all it needs of Celery (how to
    publish, count queues, learn of revokes, reach the result backend)."""
    wrong = []
    for path in sorted((PACKAGE / "sweeper").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            wrong += [f"{path.relative_to(PACKAGE)}: {name}" for name in names
                      if name.split(".")[0] in ("celery", "kombu", "billiard")]
    assert wrong == []
