"""A worker's export of its traces, with the OpenTelemetry SDK (imported only
when a worker exports: :func:`loomflow_worker.tracing.export_from_environment`).

A replayed model call did not call the model: loomflow's ``chat`` span around
it still states the usage the journal recorded, which tools that add up
``gen_ai.usage.*`` (Langfuse, Logfire, Datadog's LLM views) would count a
second time. :class:`UsageOnce` moves a replayed span's usage under
``loomflow_worker.replayed_usage.*`` before it is exported."""

from __future__ import annotations

import logging

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

log = logging.getLogger(__name__)

#: The attribute that marks a replayed span (``loomflow_worker.tracing.REPLAYED``,
#: which imports this module when it exports: named again here, not imported).
REPLAYED = "loomflow_worker.replayed"

#: The prefix of the usage attributes of the GenAI semantic conventions.
USAGE = "gen_ai.usage."
#: Where a replayed span's usage goes instead.
REPLAYED_USAGE = "loomflow_worker.replayed_usage."


class UsageOnce(SpanProcessor):
    """``processor``, given each replayed span with its usage moved out of
    ``gen_ai.usage.*``: a model call's tokens are reported once, by the
    attempt that made the call. A worker whose application sets up its own
    tracer provider wraps its processor with it:
    ``provider.add_span_processor(UsageOnce(BatchSpanProcessor(exporter)))``."""

    def __init__(self, processor: SpanProcessor) -> None:
        self.processor = processor

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self.processor.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        self.processor.on_end(without_replayed_usage(span))

    def shutdown(self) -> None:
        self.processor.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.processor.force_flush(timeout_millis)


def without_replayed_usage(span: ReadableSpan) -> ReadableSpan:
    """``span`` as it is, or, replayed and stating usage, a copy of it whose
    usage is under ``loomflow_worker.replayed_usage.*``."""
    attributes = span.attributes or {}
    if attributes.get(REPLAYED) is not True or not any(k.startswith(USAGE) for k in attributes):
        return span
    moved = {(REPLAYED_USAGE + k.removeprefix(USAGE) if k.startswith(USAGE) else k): v
             for k, v in attributes.items()}
    return ReadableSpan(
        name=span.name, context=span.context, parent=span.parent, resource=span.resource,
        attributes=moved, events=span.events, links=span.links, kind=span.kind,
        status=span.status, start_time=span.start_time, end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


def environment_provider() -> TracerProvider:
    """A tracer provider as the standard ``OTEL_*`` environment configures it
    (resource, sampler, limits), exporting over OTLP/HTTP in batches."""
    provider = TracerProvider()
    provider.add_span_processor(UsageOnce(BatchSpanProcessor(OTLPSpanExporter())))
    return provider


def install() -> None:
    """Make :func:`environment_provider` this process's tracer provider."""
    trace.set_tracer_provider(environment_provider())
    log.info("exporting traces over OTLP/HTTP", extra={"action": "tracing"})
