"""The worker's first look at a task message, in its main process.

Celery's consumer hands each message to the task's strategy, which unpacks
its body as ``[args, kwargs, embed]``. A body of another shape (a string,
``null``, a list of one) raises there, outside any handler: the worker's
main process stops, the message goes back to the queue, and the next worker
that takes it stops too. A message is untrusted input: the tasks' strategy
(:func:`strategy`, ``AgentTask.Strategy``) looks at its shape first, and
one it can't run is acked (it never comes back), logged and counted; the
worker goes on with the next message."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from celery.worker.strategy import default

from ..execution.request import refuse_message
from ..runtime.errors import InvalidInput
from ..runtime.validate import check_id

log = logging.getLogger(__name__)

#: How much of a refused message's id a log line shows.
SHOWN_ID_CHARS = 100

Handler = Callable[..., Any]

# The parts of a message's embed that hold lists of signatures (objects).
_SIGNATURE_LISTS = ("callbacks", "errbacks", "chain")


def strategy(task: Any, app: Any, consumer: Any, **options: Any) -> Handler:
    """Celery's default strategy for ``task``, behind a check of each message's shape."""
    handle: Handler = default(task, app, consumer, **options)
    errors = consumer.connection_errors

    def on_message(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any,
                   **more: Any) -> Any:
        try:
            problem = message_problem(message, body)
        except Exception:
            # Not decodable (or not JSON): Celery's own handler raises the
            # same error, which its consumer logs and rejects.
            return handle(message, body, ack, reject, callbacks, **more)
        if problem is None:
            return handle(message, body, ack, reject, callbacks, **more)
        refuse_message(shown_id(message, body), problem, "malformed")
        ack(log, errors)
        return None

    return on_message


def message_problem(message: Any, body: Any) -> str | None:
    """What makes a task message unrunnable, or ``None``. ``body`` is the
    decoded body of a protocol 1 message (``None``: protocol 2, whose body
    the message decodes)."""
    payload = body if body is not None else message.payload
    headers = message.headers if isinstance(message.headers, dict) else {}
    if isinstance(payload, dict) and (body is not None or "args" in payload):
        # Protocol 1 (its headers in the body), or a hybrid (the message's
        # headers over the body's, as Celery reads them).
        fields = payload if body is not None else {**payload, **headers}
        return (_arguments_problem(payload.get("args", ()), payload.get("kwargs", {}), None,
                                   fields.get("id"))
                or _headers_problem(fields))
    if not isinstance(payload, list | tuple) or len(payload) != 3:
        return f"its body is {_kind(payload)}, not [args, kwargs, embed]"
    args, kwargs, embed = payload
    return (_arguments_problem(args, kwargs, embed, headers.get("id"))
            or _headers_problem(headers))


def _headers_problem(headers: dict[str, Any]) -> str | None:
    """What is wrong with the headers Celery's consumer itself uses (the rest it
    checks, or only the task reads)."""
    limits = headers.get("timelimit")
    if limits is not None and not (
        isinstance(limits, list | tuple) and len(limits) == 2
        and all(limit is None or _seconds(limit) for limit in limits)
    ):
        return (f"its timelimit header is {_kind(limits)}, not [soft, hard] "
                "(each a number of seconds or null)")
    retries = headers.get("retries", 0)
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        return f"its retries header is {_kind(retries)}, not a count"
    return None


def _seconds(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, int | float)
            and math.isfinite(value) and value >= 0)


def _arguments_problem(args: Any, kwargs: Any, embed: Any, task_id: Any) -> str | None:
    if not isinstance(args, list | tuple):
        return f"its args are {_kind(args)}, not a list"
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        return f"its kwargs are {_kind(kwargs)}, not an object with string keys"
    if embed is not None and not isinstance(embed, dict):
        return f"its embed is {_kind(embed)}, not an object"
    for name, value in (embed or {}).items():
        if name in _SIGNATURE_LISTS and value is not None and not (
            isinstance(value, list) and all(isinstance(item, dict) for item in value)
        ):
            return f"its embed's {name} is {_kind(value)}, not a list of signatures"
        if name == "chord" and value is not None and not isinstance(value, dict):
            return f"its embed's chord is {_kind(value)}, not a signature"
    try:
        check_id("its id", task_id)
    except InvalidInput as exc:
        return str(exc)
    return None


def _kind(value: Any) -> str:
    """How a refusal names a JSON value it did not expect."""
    if isinstance(value, list | tuple):
        return f"a list of {len(value)}"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value)
    return "null" if value is None else f"a {type(value).__name__}"


def shown_id(message: Any, body: Any) -> str:
    """The message's id as a log line shows it (cut short)."""
    headers = message.headers if isinstance(message.headers, dict) else {}
    found = headers.get("id")
    if found is None and isinstance(body, dict):
        found = body.get("id")
    text = found if isinstance(found, str) else repr(found)
    return text if len(text) <= SHOWN_ID_CHARS else f"{text[:SHOWN_ID_CHARS]}..."
