"""The Python examples of the README and the documentation, as the tests run them.

A fenced block's info string says what it is:

- ```` ```python title="name.py" ````: a file the reader saves under that name (an agents
  module, a script run by name). The example's folder gets it.
- ```` ```python ````: a script, run in that folder after the files are written, in the
  order the page shows them; its ``assert`` lines are what the page promises.
- ```` ```{.python .fragment} ````: part of a larger program, shown for its shape; it is
  compiled, not run. Keep these few.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
#: The command the pages run, from the interpreter's own environment.
COMMAND = Path(sys.executable).parent / "loomflow-worker"
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^`\n]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                    re.M | re.S)
_TITLE = re.compile(r'title="(?P<title>[^"]+)"')


@dataclass(frozen=True)
class Block:
    """One fenced Python block of a page."""

    page: Path
    line: int
    kind: str  # "file", "script" or "fragment"
    title: str | None
    code: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    """The README and every page of the documentation."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """The Python blocks of ``page``, in order."""
    text = page.read_text()
    found = []
    for match in _FENCE.finditer(text):
        words = [word.lstrip(".") for word in match["info"].strip().strip("{}").split()]
        if not words or words[0] not in ("python", "py"):
            continue
        indent = len(match["indent"])
        code = "\n".join(line[indent:] for line in match["body"].splitlines()) + "\n"
        title = _TITLE.search(match["info"])
        kind = ("fragment" if "fragment" in words[1:]
                else "file" if title else "script")
        found.append(Block(page, text.count("\n", 0, match.start()) + 1, kind,
                           title["title"] if title else None, code))
    return found


def all_blocks() -> list[Block]:
    return [block for page in pages() for block in blocks(page)]


def needs_worker(page_blocks: list[Block]) -> bool:
    """Whether a page registers agents or its scripts send requests: a worker must then
    import its agents and run its requests."""
    return bool(agent_modules(page_blocks)) or any(
        "loomflow_worker.tasks" in block.code for block in page_blocks
        if block.kind == "script")


def agent_modules(page_blocks: list[Block]) -> list[str]:
    """The page's files that register agents, as module names."""
    return [block.title.removesuffix(".py") for block in page_blocks
            if block.kind == "file" and block.title and "register_agent" in block.code]


def write_files(page_blocks: list[Block], folder: Path) -> None:
    for block in page_blocks:
        if block.kind == "file" and block.title:
            path = folder / block.title
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block.code)


@contextlib.contextmanager
def worker(folder: Path, env: dict[str, str], log: Path,
           agents: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    """``LOOMFLOW_WORKER_AGENTS=<agents> loomflow-worker worker``, run in ``folder`` as a
    reader runs it; SIGKILLed on the way out."""
    proc = subprocess.Popen(
        [str(COMMAND), "worker", "--concurrency", "4"], cwd=folder,
        env={**env, "LOOMFLOW_WORKER_AGENTS": ",".join(agents)},
        stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: "ready." in log.read_text(errors="replace") or proc.poll() is not None,
                   "the worker started", 60, every=0.05,
                   detail=lambda: log.read_text(errors="replace")[-3000:])
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
