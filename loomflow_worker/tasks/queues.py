"""How many messages wait in the broker's queues, as the broker counts them
(for the sweeper, the backlog gauge and the console)."""

from __future__ import annotations

import logging

from ..execution.versions import queue_suffix
from .application import current_app, settings

log = logging.getLogger(__name__)


def queue_lengths(names: list[str]) -> dict[str, int | None]:
    """Messages waiting in each of these queues, as the broker counts them
    (``None``: the broker did not say)."""
    # Declared as the workers declare them (idempotent), not passively: kombu's
    # passive declare on Redis looks a queue up without the global key
    # prefix, so with REDIS_KEY_PREFIX it would always find it missing.
    counts: dict[str, int | None] = dict.fromkeys(names)
    app = current_app()
    with app.pool.acquire(block=True, timeout=5) as conn:
        for name in names:
            queue = app.amqp.queues[name]
            try:
                counts[name] = int(queue.bind(conn.default_channel).queue_declare().message_count)
            except Exception as exc:
                log.warning("sweeper: could not count the messages of queue %s: %s", name, exc,
                            extra={"action": "sweeper_count", "queue": name})
    return counts


def queue_length() -> int:
    """Messages waiting in the default queue, as the broker counts them."""
    name = settings().queue
    count = queue_lengths([name])[name]
    if count is None:
        raise ConnectionError(f"the broker did not count the messages of queue {name}")
    return count


def version_queues(versions: dict[str, str]) -> list[str]:
    """The queues of the agents' versions this worker serves (``versions``:
    each agent's, by name), one per agent and queue it takes messages from:
    a request pinned to a version waits in its queue's one (see
    :func:`~loomflow_worker.execution.versions.queue_suffix`)."""
    app = current_app()
    suffixes = [queue_suffix(agent, version) for agent, version in sorted(versions.items())]
    bases = [name for name in (app.amqp.queues.consume_from or {})
             if not any(name.endswith(suffix) for suffix in suffixes)] or [settings().queue]
    return [base + suffix for base in bases for suffix in suffixes]
