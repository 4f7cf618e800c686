"""The modules earlier versions named in stored failures, and where their
classes live now: one table.

A failure stored in the result backend names its class's module
(``exc_module``), and Celery's backend looks the class up in that module only
if it is already imported (``sys.modules``): a failure naming a module that
no longer exists would read as a stand-in class, not ours. Each such module
is listed here as an alias of the module that holds its classes now, and
``loomflow_worker.tasks`` installs the aliases on import (a caller reading a
result imports it). ``docs/reference/names.md`` says what else keeps a name."""

from __future__ import annotations

import importlib
import sys

#: A module that stored failures of earlier versions name -> the one that
#: defines their classes now.
STORED_MODULES = {
    # Where the run errors lived before the execution layer had its own module.
    "loomflow_worker.tasks.execute": "loomflow_worker.execution.request_errors",
    # The execution layer's errors module before it was named for its job.
    "loomflow_worker.execution.errors": "loomflow_worker.execution.request_errors",
}


def install() -> None:
    """Make each old module name lead to the module that holds its classes
    now (a module of that name already loaded is left alone)."""
    for old, new in STORED_MODULES.items():
        sys.modules.setdefault(old, importlib.import_module(new))
