"""The tasks' class: ``apply_async`` records a request in the ledger before it
publishes it; a worker's task stores its outcome through :class:`~.results.ResultStore`."""

from __future__ import annotations

import functools
import inspect
import uuid
from typing import Any

from celery import Task
from celery.exceptions import TimeLimitExceeded
from celery.result import AsyncResult

from .. import tracing
from ..execution import ledger
from ..execution.ledger import ON_BUSY, OnBusy, StartAt
from ..execution.pending import Pending
from ..execution.registry import import_agent_modules
from ..execution.request import Kind, RunRequest, check_request
from ..execution.request_errors import RunCancelled, RunDead, RunFailed
from ..runtime.errors import InvalidInput
from ..runtime.validate import check_id
from ..settings import check_key, check_weight
from ..worker.state import PROCESS
from .dispatch import (
    DISPATCH_RETRY,
    check_result_backend,
    dispatch_deferred,
    dispatch_errors,
    dispatch_recorded,
    options_json,
)
from .eta import start_at
from .results import ResultStore
from .revoke import end_revoked_soon

#: The ``apply_async`` options that say where a message goes.
ROUTING = ("queue", "exchange", "routing_key", "priority")
#: Queues bound to the channel a republish last sent them on, by name (see
#: ``AgentTask._bound_queue``): each is used only on that channel.
_BOUND: dict[str, Any] = {}
#: Broker URL schemes of Redis, whose priorities run from 0 (first) up.
REDIS_SCHEMES = ("redis", "rediss", "sentinel", "redis+socket")


#: The ``apply_async`` options a request withheld at enqueue keeps for the
#: message published later (what its message would have carried).
WITHHELD_OPTIONS = ("link", "link_error", "headers", "priority", "expires", "time_limit",
                "soft_time_limit", "chord", "chain", "group_id", "group_index", "root_id",
                "parent_id", "shadow", "reply_to")


def withheld_options(options: dict[str, Any]) -> dict[str, Any] | None:
    """``options`` as JSON for a request withheld at enqueue; ``None`` when
    one of them is not JSON (the request is then published at once)."""
    kept = {k: v for k, v in options.items() if k in WITHHELD_OPTIONS and v is not None}
    try:
        return options_json(kept)
    except (TypeError, ValueError):
        return None


def priority_rank(routing: dict[str, Any] | None, broker_url: str) -> int:
    """Where a request's Celery priority puts it among the requests waiting on
    a limit in the ledger, lowest first, as its broker orders messages: on
    Redis 0 goes first, on RabbitMQ (AMQP) the highest. :class:`InvalidInput`
    for a priority that is not an integer from 0 to 255 (AMQP's range), before
    anything is recorded."""
    priority = (routing or {}).get("priority")
    if priority is None:
        return 0
    if not isinstance(priority, int) or isinstance(priority, bool) or not 0 <= priority <= 255:
        shown = priority if isinstance(priority, int) else type(priority).__name__
        raise InvalidInput(f"priority must be an integer from 0 to 255, not {shown!r}")
    return priority if broker_url.split(":", 1)[0] in REDIS_SCHEMES else -priority


def _stated(name: str, given: Any, options: dict[str, Any]) -> Any:
    """What the call states as ``name``: its keyword (``delay``'s, or
    ``apply_async``'s, which arrives among the message's ``options`` and is
    taken out of them), else its message's header."""
    among_options = options.pop(name, None)
    if given is None:
        given = among_options
    headers = options.get("headers")
    if given is None and isinstance(headers, dict):
        given = headers.get(name)
    return given


def checked_fairness_key(given: Any, options: dict[str, Any]) -> str | None:
    """The request's fairness key: the ``fairness_key`` keyword, else its
    message's ``fairness_key`` header; :class:`InvalidInput` when it is not a
    name of 1 to 64 bytes."""
    given = _stated("fairness_key", given, options)
    if given is None:
        return None
    try:
        return check_key(given, "fairness key")
    except ValueError as exc:
        shown = given if isinstance(given, str) and len(given) <= 80 else type(given).__name__
        raise InvalidInput(f"fairness_key {shown!r}: {exc}") from None


def checked_fairness_weight(given: Any, options: dict[str, Any]) -> float | None:
    """The weight the request states for its fairness key: the
    ``fairness_weight`` keyword, else its message's ``fairness_weight``
    header; :class:`InvalidInput` when it is not a positive number."""
    given = _stated("fairness_weight", given, options)
    if given is None:
        return None
    try:
        return check_weight(given)
    except ValueError as exc:
        raise InvalidInput(f"fairness_weight: {exc}") from None


class AgentTask(Task):  # type: ignore[misc]
    """``apply_async`` records the request in the ledger before publishing it."""

    kind: Kind = "run"
    acks_late = True
    reject_on_worker_lost = True
    max_retries = None
    typing = False  # arguments are checked by check_request, with clearer errors
    # A message whose body Celery can't unpack is dropped, not left to stop the worker.
    Strategy = "loomflow_worker.tasks.wire:strategy"
    # A request's end as the ledger has it: its own log line says why (an
    # ERROR for a failed or dead run, a WARNING for a request refused as bad
    # input), so Celery logs "raised expected" at INFO, without a traceback
    # that would only point at the line raising it. The state is FAILURE all
    # the same; Sentry's Celery integration skips these (its logging
    # integration reports the ERROR line).
    throws = (RunFailed, RunDead, RunCancelled)

    def on_failure(
        self, exc: Exception, task_id: str, args: Any, kwargs: Any, einfo: Any
    ) -> None:
        """Celery's hard time limit killed the pool child running the request
        (this runs in the worker's main process): the ledger ends it ``failed``
        with ``TimeLimitExceeded`` as soon as its lock is free, and hands its
        session on, rather than the sweeper resuming it as a crash."""
        if isinstance(exc, TimeLimitExceeded):
            limit = exc.args[0] if exc.args and isinstance(exc.args[0], int | float) else 0
            end_revoked_soon(task_id, ledger.killed_at_time_limit(float(limit)))

    @property
    def backend(self) -> Any:
        """The app's result backend; while a worker runs the task, one that
        defers a result it can't store to the sweeper (:class:`~.results.ResultStore`)."""
        if self.request.called_directly:
            return self.app.backend
        return ResultStore(self.app.backend)

    @functools.cached_property
    def _signature(self) -> inspect.Signature:
        # The task's own function (bound: without ``self``) says what it takes.
        return inspect.signature(self.run)

    def bind_arguments(self, args: Any, kwargs: Any) -> dict[str, Any]:
        """The task's arguments by name, defaults included (a call it can't
        take raises :class:`InvalidInput`)."""
        try:
            bound = self._signature.bind(*(args or ()), **(kwargs or {}))
        except TypeError as exc:
            raise InvalidInput(f"{self.name}: {exc}") from exc
        bound.apply_defaults()
        return dict(bound.arguments)

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        on_busy: OnBusy = "enqueue",
        **options: Any,
    ) -> AsyncResult:
        """Check the request, record it in the ledger, then publish it.

        ``on_busy`` says what to do when the session already has an
        unfinished request: ``"enqueue"`` (wait for its turn), ``"reject"``
        (raise :class:`SessionBusy`, nothing recorded) or ``"interrupt"``
        (cancel the earlier requests, then run this one)."""
        if task_id is not None and task_id == self.request.id and options.get("retries"):
            return self._publish_retry(args, kwargs, task_id, options)
        kwargs = dict(kwargs or {})
        on_busy = kwargs.pop("on_busy", on_busy)
        fairness_key = checked_fairness_key(kwargs.pop("fairness_key", None), options)
        fairness_weight = checked_fairness_weight(kwargs.pop("fairness_weight", None), options)
        if on_busy not in ON_BUSY:
            raise InvalidInput(f"on_busy must be one of {', '.join(ON_BUSY)}, not {on_busy!r}")
        current = PROCESS.current_settings()
        import_agent_modules(current.agents)
        bound = self.bind_arguments(args, kwargs)
        request = check_request(current, kind=self.kind, **bound,
                                fleet_agents=PROCESS.learn_agent(bound.get("agent")))
        if task_id:  # Celery's rule: an empty one means "make one"
            check_id("task_id", task_id)
        task_id = task_id or str(uuid.uuid4())
        start = start_at(options.get("countdown"), options.get("eta"), self.app.conf.timezone)
        routing = self._routing(request.task_args(), options)
        PROCESS.declare_limits()
        with tracing.enqueue_span(self.name, task_id, request.agent,
                                  request.session_id) as trace:
            if trace:
                # Every message of the request carries its trace: this one in
                # its headers, those published again from the ledger from its row.
                routing = {**routing, tracing.ROUTING_KEY: trace}
                options = tracing.with_headers(options, trace)
            return self._record_and_publish(request, task_id, on_busy, start, routing, options,
                                            fairness_key, fairness_weight)

    def _record_and_publish(
        self, request: RunRequest, task_id: str, on_busy: OnBusy, start: StartAt | None,
        routing: dict[str, Any], options: dict[str, Any], fairness_key: str | None,
        fairness_weight: float | None,
    ) -> AsyncResult:
        """Record the checked request in the ledger, then publish it (unless
        the ledger had it already, or withholds it on its fairness key)."""
        current = PROCESS.current_settings()
        enqueued = PROCESS.enqueue.insert(
            *PROCESS.database(), task_id, request, on_busy, start,
            ignore_result=bool(options.get("ignore_result", self.ignore_result)),
            routing=routing,
            options=withheld_options(options), fairness_key=fairness_key,
            fairness_weight=fairness_weight,
            priority_rank=priority_rank(routing, current.broker_url.get_secret_value()),
        )
        if enqueued.duplicate or enqueued.held:
            # The same request sent again under its id: it is recorded and was
            # published already, so this publishes nothing. Or withheld on its
            # fairness key's limit: the run that frees a slot of it publishes it
            # (or the sweeper does), with the options recorded with it.
            for pending in enqueued.cancelled:
                dispatch_recorded(pending, "cancelled")
            return self.AsyncResult(task_id)
        # The request is accepted: its row is the record, and the sweeper
        # publishes a queued request whose message looks lost. A publish that
        # fails now is logged, not raised: the caller's handle is good, and a
        # caller retrying the enqueue under a new id would run it twice.
        task_args, task_kwargs = request.task_args()
        options.setdefault("retry_policy", DISPATCH_RETRY)
        if enqueued.not_before is not None:
            # The message's eta is the moment the ledger recorded, exactly.
            options.pop("countdown", None)
            options["eta"] = enqueued.not_before
        try:
            check_result_backend()
            result = super().apply_async(task_args, task_kwargs, task_id=task_id, **options)
        except dispatch_errors() as exc:
            dispatch_deferred(task_id, "accepted", exc)
            result = self.AsyncResult(task_id)
        except RuntimeError as exc:
            # Celery's result consumer gave up reconnecting (Redis went away
            # after the check above).
            if not isinstance(exc.__cause__, dispatch_errors()):
                raise
            dispatch_deferred(task_id, "accepted", exc.__cause__)
            result = self.AsyncResult(task_id)
        for pending in enqueued.cancelled:
            dispatch_recorded(pending, "cancelled")  # so its result is stored
        return result

    def _publish_retry(
        self, args: Any, kwargs: Any, task_id: str, options: dict[str, Any]
    ) -> AsyncResult:
        """Publish Celery's retry of the request this worker is running: the
        ledger rescheduled it already (queued, not before its countdown), so it
        is sent as it was received, not recorded again (which would find it a
        duplicate and publish nothing, leaving it to the sweeper)."""
        options = {"retry_policy": DISPATCH_RETRY, **options}
        try:
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        except dispatch_errors() as exc:
            dispatch_deferred(task_id, "queued for its retry", exc)
            return self.AsyncResult(task_id)

    def delay(self, *args: Any, **kwargs: Any) -> AsyncResult:
        return self.apply_async(args, kwargs)

    def _routing(
        self, task_args: tuple[tuple[Any, ...], dict[str, Any]], options: dict[str, Any]
    ) -> dict[str, Any]:
        """Where the request's messages go, as Celery's router sends its first
        (the call's ``queue``, else the app's ``task_routes``, else the default
        queue): the queue by name, and the exchange, routing key and priority
        the call or its route asked for."""
        asked = {k: v for k, v in options.items() if k in ROUTING and v is not None}
        routed = self.app.amqp.router.route(asked, self.name, *task_args)
        found: dict[str, Any] = {}
        for key in ROUTING:
            value = routed.get(key)
            if value is not None:
                found[key] = getattr(value, "name", value)  # a kombu Queue or Exchange
        return found

    def dispatch(self, pending: Pending, producer: Any = None) -> None:
        """Publish a request that already has its ledger row (a handoff, a
        redispatch) as its first message was: to its queue (its routing), with
        its eta, and with what that message carried once a worker took it (its
        chain, callbacks, chord and group, headers, priority, time limits), as
        Celery's retry would; with ``producer``, over its connection."""
        task_args, task_kwargs = pending.task_args()
        # Routing's other keys are the ledger's (a request sent to its version's
        # queue). There, the version's queue wins over the routing its message
        # carried.
        routing = {k: v for k, v in (pending.routing or {}).items() if k in ROUTING}
        carried = dict(pending.options or {})
        if "version" in (pending.routing or {}):
            for key in ("queue", "exchange", "routing_key"):
                carried.pop(key, None)
        options = {**routing, **carried, "retry_policy": DISPATCH_RETRY}
        options = tracing.with_headers(options, tracing.of_routing(pending.routing))
        if pending.not_before is not None:
            options["eta"] = pending.not_before
        declare = self._bound_queue(producer, options)
        if declare is not None:
            options["declare"] = [declare]
        super().apply_async(task_args, task_kwargs, task_id=pending.request_id,
                            producer=producer, **options)

    def _bound_queue(self, producer: Any, options: dict[str, Any]) -> Any:
        """The queue a message with ``options`` goes to, bound to ``producer``'s
        channel once for all its messages, for Celery to declare (None: Celery's
        own choice). Celery declares the queue of each message it sends, which
        kombu answers from its cache of what the connection declared, but only
        after copying the queue and binding the copy to the channel: a worker
        publishing its fair turns by the hundred paid that for each. A queue
        already bound is asked at once; after a reconnect kombu binds it to the
        new channel and declares it there (its cache starts empty)."""
        queue = options.get("queue")
        if not isinstance(queue, str):
            return None
        known = self.app.amqp.queues.get(queue)
        channel = getattr(producer, "channel", None)
        if known is None or channel is None or not known.can_cache_declaration:
            return None
        bound = _BOUND.get(queue)
        if bound is None or bound.channel is not channel:
            bound = _BOUND[queue] = known.bind(channel)
        return bound
