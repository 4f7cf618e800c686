"""A package's exported names, each imported on first use (PEP 562).

Importing a package runs its ``__init__``; one that imported every module it
exports would make ``loomflow-worker --help`` load the agent framework, the
driver and Celery. A package lists its exports here instead (and again under
``TYPE_CHECKING``, for type checkers), and only what a caller uses is loaded.
A name must not be one of the package's submodules: importing the submodule
would bind it on the package first."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def exports(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: the name, imported from the
    module ``where`` maps it to (relative to ``package``), and kept."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
