"""A mkdocs hook: the settings reference, built from ``Settings`` at each build.

A page that holds the line ``<!-- settings-reference -->`` gets, in its place, a
table of every field of :class:`loomflow_worker.settings.Settings`: its
variable, type, default and bounds as pydantic reads them, and its meaning as
the source states it (the field's docstring, else the comment right above it,
else the comment that opens its group). A field added to ``Settings`` appears
here at the next build; one with no words at all fails the build."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import annotated_types
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

from loomflow_worker.settings import Settings

MARKER = "<!-- settings-reference -->"
PREFIX = "LOOMFLOW_WORKER_"


def _comment_above(lines: list[str], index: int) -> str:
    """The comment lines right above line ``index``, joined."""
    found: list[str] = []
    while index > 0 and lines[index - 1].strip().startswith("#"):
        index -= 1
        found.insert(0, lines[index].strip().lstrip("#").strip())
    return " ".join(found)


def meanings(settings: type[BaseSettings] = Settings) -> dict[str, str]:
    """Each field's words in the source of ``settings`` and of the classes it
    derives from, by field name."""
    found: dict[str, str] = {}
    for cls in reversed(settings.__mro__):
        if issubclass(cls, BaseSettings) and cls.__module__.split(".")[0] != "pydantic_settings":
            found.update(_meanings_of(cls))
    return found


def _meanings_of(cls: type) -> dict[str, str]:
    """Each field's words in the source of ``cls`` itself."""
    lines = textwrap.dedent(inspect.getsource(cls)).splitlines()
    body = ast.parse("\n".join(lines)).body[0]
    assert isinstance(body, ast.ClassDef)
    found: dict[str, str] = {}
    group = ""
    for position, node in enumerate(body.body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        start = node.lineno - 1
        above = _comment_above(lines, start)
        opening = _block_start(lines, start)
        if opening == 0 or not lines[opening - 1].strip():
            group = above  # a blank line above: a new group, its comment (if any) its words
        after = body.body[position + 1] if position + 1 < len(body.body) else None
        docstring = (after.value.value if isinstance(after, ast.Expr)
                     and isinstance(after.value, ast.Constant)
                     and isinstance(after.value.value, str) else "")
        found[node.target.id] = " ".join(
            (inspect.cleandoc(docstring) if docstring else above or group).split())
    return found


def _block_start(lines: list[str], index: int) -> int:
    """The first line of the comment block right above line ``index``."""
    while index > 0 and lines[index - 1].strip().startswith("#"):
        index -= 1
    return index


def variable(name: str, field: FieldInfo) -> str:
    alias = field.validation_alias
    return alias if isinstance(alias, str) else PREFIX + name.upper()


def _default(field: FieldInfo) -> str:
    value: Any = (field.default_factory() if field.default_factory is not None  # type: ignore[call-arg]
                  else field.default)
    if value is PydanticUndefined or value is None or value == "" or value == [] or value == {}:
        return "(none)"
    if hasattr(value, "get_secret_value"):
        value = value.get_secret_value()
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value}`"


def _bounds(field: FieldInfo) -> str:
    signs = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
    shown = []
    for rule in field.metadata:
        if isinstance(rule, annotated_types.BaseMetadata):
            shown += [f"{sign} {getattr(rule, name)}" for name, sign in signs
                      if getattr(rule, name, None) is not None]
    return ", ".join(shown)


def _type(field: FieldInfo) -> str:
    annotation = field.annotation
    shown = getattr(annotation, "__name__", None) or str(annotation)
    return shown.replace("typing.", "").replace("pydantic.types.", "")


def table(settings: type[BaseSettings] = Settings) -> str:
    """The reference, as a Markdown table, one row a field."""
    words = meanings(settings)
    rows = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for name, field in settings.model_fields.items():
        meaning = words.get(name, "")
        if not meaning:
            raise ValueError(f"{settings.__name__}.{name} has no docstring or comment to show "
                             "in the settings reference: add one in loomflow_worker/settings.py")
        bounds = _bounds(field)
        kind = f"{_type(field)} ({bounds})" if bounds else _type(field)
        rows.append(f"| `{variable(name, field)}` | {kind.replace('|', 'or')} "
                    f"| {_default(field)} | {meaning.replace('|', '/')} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return markdown.replace(MARKER, table()) if MARKER in markdown else markdown
