"""OpenTelemetry traces of a request, from its enqueue to its last attempt.

A request is one trace. ``apply_async`` opens a producer span inside the
caller's current span and records its W3C trace context (``traceparent``,
``tracestate``) twice: in the message's headers, which Celery carries through
its retries and which a parked request's recorded options keep, and in the
ledger row's routing (``routing["trace"]``), which every message published
again from the ledger (a handoff, the sweeper, an upgrade) reads back. Each
attempt on a worker is a consumer span under it; every journaled step is a
span under the attempt, a replayed one marked ``loomflow_worker.replayed``;
loomflow's own ``invoke_agent`` / ``chat`` / ``execute_tool`` spans (an agent
with ``telemetry="otel"``) nest inside.

Without the OpenTelemetry API installed nothing here does anything: the API
is imported once, lazily, and each hook answers at once. A worker with the
SDK and the OTLP/HTTP exporter installed and ``OTEL_EXPORTER_OTLP_ENDPOINT``
(or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) set exports without code
(:func:`export_from_environment`). A leaf module: it imports nothing of the
package."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

#: The W3C trace context headers a message carries.
TRACE_HEADERS = ("traceparent", "tracestate")
#: The key of a ledger row's routing that keeps the request's trace context.
ROUTING_KEY = "trace"
#: The instrumentation scope of the spans made here.
SCOPE = "loomflow_worker"
#: The attribute marking a step (and loomflow's span around it) as replayed.
REPLAYED = "loomflow_worker.replayed"
#: The names of loomflow's spans around one journaled step (a model call, a tool).
AROUND_STEPS = ("chat", "execute_tool")

# version-traceid-parentid-flags, lowercase hex (W3C Trace Context, level 1).
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
#: The longest tracestate kept (W3C: at most 32 members of 256 characters).
MAX_TRACESTATE = 8192

_api: ModuleType | bool | None = False  # False: not looked for yet


def _trace_api() -> ModuleType | None:
    """``opentelemetry.trace``, or ``None`` when the API is not installed
    (looked for once)."""
    global _api
    if _api is False:
        try:
            from opentelemetry import trace
        except ImportError:
            _api = None
        else:
            _api = trace
    return _api  # type: ignore[return-value]


def _tracer() -> Any:
    """This package's tracer: the provider's, made once when a provider is set
    (an SDK's ``get_tracer`` makes a new one each call, which costs more than
    the span); else the API's (its proxy's), or ``None`` without the API."""
    if _provider_set:
        return _scope_tracer
    api = _trace_api()
    return None if api is None else api.get_tracer(SCOPE)


_provider_set = False  # a tracer provider was found set (the API sets it once a process)
_scope_tracer: Any = None  # and its tracer for SCOPE


def _recording() -> bool:
    """Whether a tracer provider is set: without one, the API's proxy makes
    only spans that record nothing. Once found set, it is not looked for
    again (the API sets a process's provider once, for good), and its tracer
    is kept."""
    global _provider_set, _scope_tracer
    if _provider_set:
        return True
    api = _trace_api()
    if api is None:
        return False
    provider = api.get_tracer_provider()
    if isinstance(provider, api.ProxyTracerProvider):
        return False
    _scope_tracer = provider.get_tracer(SCOPE)
    _provider_set = True
    return True


def forget_provider() -> None:
    """Look for the tracer provider again at the next hook (a benchmark that
    swaps providers in one process)."""
    global _provider_set, _scope_tracer
    _provider_set, _scope_tracer = False, None


def malformed(carrier: Mapping[str, Any]) -> str | None:
    """What is wrong with ``carrier``'s ``traceparent`` (and ``tracestate``),
    or ``None`` when they are well formed or absent."""
    parent = carrier.get("traceparent")
    if parent is None:
        return None
    if not isinstance(parent, str):
        return f"its traceparent is of type {type(parent).__name__}, not a string"
    found = _TRACEPARENT.match(parent)
    shown = parent if len(parent) <= 80 else f"{parent[:80]}..."
    if found is None:
        return f"its traceparent {shown!r} is not version-traceid-spanid-flags in lowercase hex"
    version, trace_id, span_id, _ = found.groups()
    if version == "ff" or set(trace_id) == {"0"} or set(span_id) == {"0"}:
        return f"its traceparent {shown!r} has an invalid version or an all-zero id"
    state = carrier.get("tracestate")
    if state is not None and (not isinstance(state, str) or len(state) > MAX_TRACESTATE):
        return "its tracestate is not a string of at most 8192 characters"
    return None


def carried(carrier: Mapping[str, Any] | None) -> dict[str, str]:
    """The trace context headers of ``carrier`` (a message's headers, a
    routing's trace), well formed; empty when there are none or they are
    malformed."""
    if not carrier or malformed(carrier) is not None:
        return {}
    return {k: carrier[k] for k in TRACE_HEADERS if isinstance(carrier.get(k), str)}


def of_routing(routing: Mapping[str, Any] | None) -> dict[str, str]:
    """The trace context a ledger row's routing keeps (under its base when the
    request was sent to its agent version's queue)."""
    if not routing:
        return {}
    found = routing.get(ROUTING_KEY)
    if found is None and isinstance(routing.get("base"), Mapping):
        found = routing["base"].get(ROUTING_KEY)
    return carried(found) if isinstance(found, Mapping) else {}


def with_headers(options: dict[str, Any], context: Mapping[str, str]) -> dict[str, Any]:
    """``options`` whose ``headers`` carry ``context``, unless they carry a
    trace context already (the one the request's first message had)."""
    if not context:
        return options
    headers = options.get("headers")
    headers = dict(headers) if isinstance(headers, Mapping) else {}
    if "traceparent" in headers:
        return options
    return {**options, "headers": {**headers, **context}}


@contextlib.contextmanager
def enqueue_span(task_name: str, request_id: str, agent: str | None,
                 session_id: str | None) -> Iterator[dict[str, str]]:
    """A producer span around recording and publishing a request, inside the
    caller's current span; yields the trace context its messages carry
    (empty without the API, or with no trace to continue and no SDK). With
    no tracer provider set and no current span to continue (tracing off),
    it makes no span and injects nothing: there would be nothing to carry.
    A current span of the caller's (of a provider of its own, not set for
    the process) is continued all the same."""
    api = _trace_api()
    if api is None or (not _recording()
                       and not api.get_current_span().get_span_context().is_valid):
        yield {}
        return
    tracer = _tracer()
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind

    attributes = {"gen_ai.operation.name": "invoke_agent", "messaging.system": "celery",
                  "messaging.operation.type": "send", "messaging.message.id": request_id,
                  "loomflow_worker.request_id": request_id, "loomflow_worker.task": task_name}
    if agent is not None:
        attributes["gen_ai.agent.name"] = agent
    if session_id is not None:
        attributes["gen_ai.conversation.id"] = session_id
    with tracer.start_as_current_span(f"enqueue {agent or task_name}", kind=SpanKind.PRODUCER,
                                      attributes=attributes):
        context: dict[str, str] = {}
        propagate.inject(context)
        yield carried(context)


@dataclass
class AttemptTrace:
    """The span of one attempt and what it counts."""

    span: Any
    attempt: int | None = None
    executed: int = 0
    replayed: int = 0

    def step_attributes(self, name: str, replayed: bool) -> dict[str, Any]:
        found = {"loomflow_worker.step": name, REPLAYED: replayed}
        if self.attempt is not None:
            found["loomflow_worker.attempt"] = self.attempt
        return found


_attempt: contextvars.ContextVar[AttemptTrace | None] = contextvars.ContextVar(
    "loomflow_worker_attempt_trace", default=None)


def _carries_trace(headers: Mapping[str, Any] | None, request_id: str) -> bool:
    """Whether ``headers`` carry a trace to continue. A malformed
    ``traceparent`` is ignored with a log line (the attempt starts a new trace)."""
    if not headers or "traceparent" not in headers:
        return False
    problem = malformed(headers)
    if problem is not None:
        log.warning("request %s: %s; ignored, its attempt starts a new trace", request_id,
                    problem, extra={"action": "trace_ignored", "request": request_id})
        return False
    return True


def parent_of(headers: Mapping[str, Any] | None, request_id: str) -> Any:
    """The context an attempt's span continues: the trace of the message's
    headers (see :func:`_carries_trace`); ``None`` when there is none to continue."""
    if not _carries_trace(headers, request_id):
        return None
    from opentelemetry import propagate

    assert headers is not None
    return propagate.extract(carried(headers))


@contextlib.contextmanager
def attempt_span(headers: Mapping[str, Any] | None, request_id: str, agent: str | None,
                 session_id: str | None, worker: str | None,
                 quarantine: int = 0) -> Iterator[AttemptTrace | None]:
    """The span of one attempt (a consumer span under the request's enqueue),
    current for the attempt's steps and loomflow's spans; ``None`` without
    the API, or with no tracer provider set (an attempt records nothing
    then, and spends nothing on spans: its trace context is kept in the
    ledger for its republished messages all the same). ``quarantine``: it
    runs in a process of quarantine (1 among a few suspects, 2 alone)."""
    tracer = _tracer() if _recording() else None
    if tracer is None:
        _carries_trace(headers, request_id)  # a malformed traceparent is said all the same
        yield None
        return
    from opentelemetry.trace import SpanKind

    attributes: dict[str, str | int] = {
        "gen_ai.operation.name": "invoke_agent", "messaging.system": "celery",
        "messaging.operation.type": "process", "messaging.message.id": request_id,
        "loomflow_worker.request_id": request_id}
    for name, value in (("gen_ai.agent.name", agent), ("gen_ai.conversation.id", session_id),
                        ("loomflow_worker.worker", worker)):
        if value is not None:
            attributes[name] = value
    if quarantine:
        attributes["loomflow_worker.quarantine"] = quarantine
    with tracer.start_as_current_span(
        f"attempt {agent or 'agent'}", context=parent_of(headers, request_id),
        kind=SpanKind.CONSUMER, attributes=attributes,
    ) as span:
        traced = AttemptTrace(span)
        token = _attempt.set(traced)
        try:
            yield traced
        finally:
            _attempt.reset(token)
            span.set_attribute("loomflow_worker.steps.executed", traced.executed)
            span.set_attribute("loomflow_worker.steps.replayed", traced.replayed)


def attempt_started(attempt: int, epoch: int | None, since_heartbeat: float | None) -> None:
    """The attempt's number (and epoch), once the ledger counted it; an
    attempt that resumes a request whose worker died says so (an event)."""
    traced = _attempt.get()
    if traced is None:
        return
    traced.attempt = attempt
    traced.span.set_attribute("loomflow_worker.attempt", attempt)
    if epoch is not None:
        traced.span.set_attribute("loomflow_worker.epoch", epoch)
    if since_heartbeat is not None:
        traced.span.add_event("loomflow_worker.recovered", {
            "loomflow_worker.previous_attempt": attempt - 1,
            "loomflow_worker.since_heartbeat": since_heartbeat})


def attempt_ended(outcome: str, error: str | None = None) -> None:
    """How the attempt ended (``succeeded``, ``parked``, ``retry``, ...)."""
    traced = _attempt.get()
    if traced is None:
        return
    traced.span.set_attribute("loomflow_worker.outcome", outcome)
    if error and outcome in ("failed", "dead"):
        from opentelemetry.trace import Status, StatusCode

        traced.span.set_status(Status(StatusCode.ERROR, error[:500]))


def event(name: str, **attributes: Any) -> None:
    """An event on the attempt's span (a park, a handoff)."""
    traced = _attempt.get()
    if traced is not None:
        traced.span.add_event(f"loomflow_worker.{name}", _attributes(attributes))


def note(routing: Mapping[str, Any] | None, name: str, request_id: str, **attributes: Any) -> None:
    """A span of its own in a request's trace (the trace its ledger row
    keeps) for what happened to it outside its attempts: the sweeper
    dispatching it again, an upgrade moving it."""
    context = of_routing(routing)
    tracer = _tracer() if context else None
    if tracer is None:
        return
    from opentelemetry import propagate

    tracer.start_span(f"{name} {request_id}", context=propagate.extract(context), attributes={
        "loomflow_worker.request_id": request_id, **_attributes(attributes)}).end()


def _attributes(given: Mapping[str, Any]) -> dict[str, Any]:
    return {f"loomflow_worker.{k}": v for k, v in given.items() if v is not None}


def replayed_step(name: str) -> None:
    """A journaled step served from the journal: a span marked replayed, and
    the span around the step (loomflow's ``chat`` or ``execute_tool``)
    marked too."""
    traced = _attempt.get()
    if traced is None:
        return
    traced.replayed += 1
    api = _trace_api()
    assert api is not None
    around = api.get_current_span()
    if str(getattr(around, "name", "")).startswith(AROUND_STEPS):
        around.set_attribute(REPLAYED, True)
    _tracer().start_span(f"step {name}", attributes=traced.step_attributes(name, True)).end()


_UNTRACED: contextlib.AbstractContextManager[None] = contextlib.nullcontext()


def executed_step(name: str, current: bool = True) -> contextlib.AbstractContextManager[None]:
    """A span around a journaled step that runs (not replayed); current for
    what the step calls, unless ``current`` is false (a streamed step, whose
    chunks are yielded to its caller between its parts). Outside a traced
    attempt, a context that does nothing (no generator made per step)."""
    traced = _attempt.get()
    if traced is None:
        return _UNTRACED
    return _executed_step(traced, name, current)


@contextlib.contextmanager
def _executed_step(traced: AttemptTrace, name: str, current: bool) -> Iterator[None]:
    traced.executed += 1
    attributes = traced.step_attributes(name, False)
    if current:
        with _tracer().start_as_current_span(f"step {name}", attributes=attributes):
            yield
        return
    span = _tracer().start_span(f"step {name}", attributes=attributes)
    try:
        yield
    finally:
        span.end()


#: The environment that asks a worker to export its traces over OTLP.
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def export_wanted() -> bool:
    """Whether this process should set up exporting as the standard
    environment says: an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT``
    or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), the API is installed (else a
    log line says why nothing is exported) and nothing set a tracer provider
    yet (the application did, or this process did before it forked)."""
    if not any(os.environ.get(name) for name in ENDPOINT_VARIABLES):
        return False
    api = _trace_api()
    if api is None:
        log.warning("%s is set but opentelemetry-api is not installed (install "
                    "loomflow-worker[otel]); no traces are exported",
                    ENDPOINT_VARIABLES[1], extra={"action": "tracing"})
        return False
    return isinstance(api.get_tracer_provider(), api.ProxyTracerProvider)


def export_from_environment() -> None:
    """Export this process's traces over OTLP/HTTP as the standard OTEL_*
    environment says, when :func:`export_wanted`; a log line says so, or why
    not (the SDK or its exporter is not installed)."""
    if not export_wanted():
        return
    try:
        from .tracing_export import install
    except ImportError as exc:
        log.warning("%s is set but the OpenTelemetry SDK or its OTLP/HTTP exporter is not "
                    "installed (%s; install loomflow-worker[otel]); no traces are exported",
                    ENDPOINT_VARIABLES[1], exc, extra={"action": "tracing"})
        return
    install()


def flush(timeout_millis: int = 5000) -> None:
    """Send the spans still buffered (a process about to exit)."""
    api = _trace_api()
    force = getattr(api.get_tracer_provider(), "force_flush", None) if api else None
    if force is not None:
        force(timeout_millis)
