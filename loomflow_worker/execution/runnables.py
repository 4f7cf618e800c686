"""What a registered factory may return, and how a request runs it: a
loomflow ``Agent`` (a ``Team`` builds one: a coordinator whose workers run
as its sub-agents) or a ``Workflow``.

An agent runs as itself: ``agent.run(prompt, ..., emit=...)`` opens the
request's run on the runtime. A workflow takes no ``emit`` and opens no run
of its own (loomflow groups its agent nodes as child runs of a container,
keyed by a new run id each time, so a workflow run alone replays nothing):
the worker opens the request's run around it, and the workflow's container
nests under that run. Its agent nodes then journal under the request's
namespace, so a resumed attempt replays the nodes that completed (and a
node cut short replays its own completed steps), and the scope's epoch
advances when the request ends."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from loomflow import Agent, Workflow
from loomflow.core.context import RunContext, set_run_context
from loomflow.core.types import Event
from pydantic_core import to_jsonable_python

from ..runtime import PostgresRuntime
from .request import RunRequest

Emit = Callable[[Event], Awaitable[None]]


def is_workflow(runnable: Any) -> bool:
    return isinstance(runnable, Workflow)


def agents_within(runnable: Any) -> Iterator[Agent]:
    """The agents a registered runnable runs: itself when an agent, each
    agent node of a workflow (nested workflows' too)."""
    if isinstance(runnable, Agent):
        yield runnable
    elif isinstance(runnable, Workflow):
        for node in runnable._raw_nodes.values():
            yield from agents_within(node)


async def run_request(
    runnable: Any, runtime: PostgresRuntime, request_id: str, req: RunRequest, emit: Emit
) -> dict[str, Any]:
    """Run ``runnable`` for the request; its result as JSON (with
    ``output``), as the result backend stores it."""
    metadata = {**req.metadata, "request_id": request_id}
    if not isinstance(runnable, Workflow):
        result = await runnable.run(
            req.prompt, session_id=req.session_id, user_id=req.user_id, metadata=metadata,
            # Always pass emit: model calls then always journal to the same table.
            emit=emit,
        )
        dumped: dict[str, Any] = result.model_dump(mode="json")
        return dumped
    context = RunContext(user_id=req.user_id, session_id=req.session_id, metadata=metadata)
    async with set_run_context(context), runtime.session(req.session_id):
        # A step of the request's own run: the run is used, so its epoch
        # advances when it ends (its nodes' steps journal in child runs,
        # which advance nothing), and no later request replays its nodes.
        await runtime.step(f"workflow_{runnable.name}", _started, runnable.name)
        ran = await runnable.run(req.prompt, session_id=req.session_id,
                                 user_id=req.user_id, metadata=metadata)
    return {
        "session_id": req.session_id,
        "output": to_jsonable_python(ran.output, fallback=repr),
        "visited": list(ran.visited),
        "per_step": to_jsonable_python(ran.per_step, fallback=repr),
        "interrupted": ran.interrupted,
        "interruption_reason": ran.interruption_reason,
    }


async def _started(name: str) -> str:
    return name
