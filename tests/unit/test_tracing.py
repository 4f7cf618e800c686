"""How a request's trace context is checked, carried in its messages' headers
and kept in its ledger row's routing (no services; the OpenTelemetry API
without an SDK, as a process that enqueues has it)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from loomflow_worker import tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"
PARENT = f"00-{TRACE_ID}-{SPAN_ID}-01"


@pytest.mark.parametrize("carrier", [
    {}, {"traceparent": PARENT}, {"traceparent": PARENT, "tracestate": "vendor=1,other=2"},
])
def test_a_well_formed_or_absent_trace_context_is_not_malformed(carrier: dict[str, str]) -> None:
    assert tracing.malformed(carrier) is None


@pytest.mark.parametrize(("carrier", "says"), [
    ({"traceparent": "garbage"}, "not version-traceid-spanid-flags"),
    ({"traceparent": PARENT.upper()}, "not version-traceid-spanid-flags"),
    ({"traceparent": f"00-{'0' * 32}-{SPAN_ID}-01"}, "all-zero id"),
    ({"traceparent": f"00-{TRACE_ID}-{'0' * 16}-01"}, "all-zero id"),
    ({"traceparent": f"ff-{TRACE_ID}-{SPAN_ID}-01"}, "invalid version"),
    ({"traceparent": 42}, "of type int, not a string"),
    ({"traceparent": PARENT, "tracestate": "x" * 9000}, "tracestate"),
    ({"traceparent": PARENT, "tracestate": ["a"]}, "tracestate"),
])
def test_a_malformed_trace_context_says_what_is_wrong(
    carrier: dict[str, object], says: str
) -> None:
    problem = tracing.malformed(carrier)
    assert problem is not None and says in problem
    assert tracing.carried(carrier) == {}


def test_carried_keeps_only_the_trace_headers() -> None:
    headers = {"traceparent": PARENT, "tracestate": "a=1", "fairness_key": "tenant"}
    assert tracing.carried(headers) == {"traceparent": PARENT, "tracestate": "a=1"}
    assert tracing.carried(None) == {}


def test_the_routing_keeps_the_trace_also_under_a_versions_base() -> None:
    kept = {"traceparent": PARENT}
    assert tracing.of_routing({"queue": "q", "trace": kept}) == kept
    versioned = {"queue": "q.v2", "version": "v2", "base": {"queue": "q", "trace": kept}}
    assert tracing.of_routing(versioned) == kept
    assert tracing.of_routing({"queue": "q"}) == {}
    assert tracing.of_routing(None) == {}
    assert tracing.of_routing({"trace": {"traceparent": "garbage"}}) == {}


def test_headers_get_the_trace_unless_they_carry_one() -> None:
    context = {"traceparent": PARENT}
    assert tracing.with_headers({"priority": 3}, context) == {
        "priority": 3, "headers": {"traceparent": PARENT}}
    # The message's own headers stay, beside it.
    assert tracing.with_headers({"headers": {"fairness_key": "k"}}, context) == {
        "headers": {"fairness_key": "k", "traceparent": PARENT}}
    # A request's first message's trace wins over what its row kept.
    other = f"00-{'1' * 32}-{SPAN_ID}-01"
    first = {"headers": {"traceparent": other}}
    assert tracing.with_headers(first, context) == first
    assert tracing.with_headers({"priority": 3}, {}) == {"priority": 3}


@pytest.fixture
def in_a_span() -> Iterator[SpanContext]:
    """The caller's current span: a trace the enqueue continues."""
    span_context = SpanContext(int(TRACE_ID, 16), int(SPAN_ID, 16), is_remote=False,
                               trace_flags=TraceFlags(TraceFlags.SAMPLED))
    token = otel_context.attach(trace.set_span_in_context(NonRecordingSpan(span_context)))
    try:
        yield span_context
    finally:
        otel_context.detach(token)


def test_an_enqueue_inside_a_span_carries_its_trace(in_a_span: SpanContext) -> None:
    with tracing.enqueue_span("run_agent", "r1", "default", "s1") as carried:
        assert carried["traceparent"].split("-")[1] == TRACE_ID


def test_an_enqueue_outside_any_trace_carries_nothing() -> None:
    with tracing.enqueue_span("run_agent", "r1", "default", "s1") as carried:
        assert carried == {}


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tracer provider is taken as set: this process sets none (a global
    set once), and without one an attempt makes no span."""
    monkeypatch.setattr(tracing, "_recording", lambda: True)


def test_without_a_tracer_provider_an_attempt_makes_no_span(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with tracing.attempt_span({"traceparent": PARENT}, "r1", "default", "s1", "w1") as traced:
        assert traced is None
        with tracing.executed_step("model_call_1"):
            pass
    with caplog.at_level(logging.WARNING, logger="loomflow_worker.tracing"), \
            tracing.attempt_span({"traceparent": "00-nonsense"}, "r2", None, None, None):
        pass
    assert any("request r2" in r.getMessage() and "ignored" in r.getMessage()
               for r in caplog.records)


@pytest.mark.usefixtures("recording")
def test_an_attempt_continues_the_trace_its_headers_carry() -> None:
    with tracing.attempt_span({"traceparent": PARENT}, "r1", "default", "s1", "w1") as traced:
        assert traced is not None
        assert format(trace.get_current_span().get_span_context().trace_id, "032x") == TRACE_ID


@pytest.mark.usefixtures("recording")
def test_a_malformed_traceparent_is_ignored_with_a_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="loomflow_worker.tracing"), \
            tracing.attempt_span({"traceparent": "00-nonsense"}, "r1", None, None, None) as traced:
        assert traced is not None
        assert not trace.get_current_span().get_span_context().is_valid
    assert any("request r1" in r.getMessage() and "ignored" in r.getMessage()
               for r in caplog.records)


@pytest.mark.usefixtures("recording")
def test_an_attempt_counts_its_replayed_and_executed_steps() -> None:
    with tracing.attempt_span({"traceparent": PARENT}, "r1", None, None, None) as traced:
        assert traced is not None
        tracing.attempt_started(2, 0, 1.5)
        tracing.replayed_step("model_call_1")
        with tracing.executed_step("model_call_2"):
            pass
        with tracing.executed_step("stream_3", current=False):
            pass
        assert (traced.attempt, traced.replayed, traced.executed) == (2, 1, 2)
        assert traced.step_attributes("model_call_1", True) == {
            "loomflow_worker.step": "model_call_1", tracing.REPLAYED: True,
            "loomflow_worker.attempt": 2}



def test_a_replayed_spans_usage_is_exported_apart_and_an_executed_ones_as_it_is() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from loomflow_worker.tracing_export import UsageOnce

    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(UsageOnce(SimpleSpanProcessor(exported)))
    tracer = provider.get_tracer("test")
    usage = {"gen_ai.usage.input_tokens": 120, "gen_ai.usage.output_tokens": 30}
    with tracer.start_as_current_span("chat model", attributes=usage) as span:
        span.set_attribute(tracing.REPLAYED, True)
    with tracer.start_as_current_span("chat model", attributes=usage):
        pass
    replayed, executed = exported.get_finished_spans()
    assert dict(replayed.attributes or {}) == {
        tracing.REPLAYED: True, "loomflow_worker.replayed_usage.input_tokens": 120,
        "loomflow_worker.replayed_usage.output_tokens": 30}
    assert replayed.context == span.get_span_context() and replayed.end_time is not None
    assert dict(executed.attributes or {}) == usage
    provider.shutdown()


def test_a_worker_exports_only_when_an_endpoint_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in tracing.ENDPOINT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert tracing.export_wanted() is False
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4318/v1/traces")
    # No tracer provider set in this process: the worker would set one up.
    assert tracing.export_wanted() is True


def test_without_the_api_nothing_is_traced_and_nothing_fails(
    monkeypatch: pytest.MonkeyPatch, in_a_span: SpanContext,
) -> None:
    monkeypatch.setattr(tracing, "_api", None)  # as when opentelemetry-api is not installed
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    assert tracing.export_wanted() is False
    with tracing.enqueue_span("run_agent", "r1", "default", "s1") as carried:
        assert carried == {}
    with tracing.attempt_span({"traceparent": PARENT}, "r1", None, None, None) as traced:
        assert traced is None
        tracing.attempt_started(1, 0, None)
        tracing.replayed_step("model_call_1")
        with tracing.executed_step("model_call_2"):
            pass
    tracing.note({"trace": {"traceparent": PARENT}}, "redispatch", "r1")


def test_tracing_off_makes_no_enqueue_span_and_injects_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The API installed, no tracer provider set, no current span: nothing to
    # carry, so the enqueue spends nothing on a span or on the propagators.
    from opentelemetry import propagate

    def injected(*args: object, **kwargs: object) -> None:
        raise AssertionError("tracing off injected a trace context")

    monkeypatch.setattr(propagate, "inject", injected)
    with tracing.enqueue_span("run_agent", "r1", "default", "s1") as carried:
        assert carried == {}
        assert not trace.get_current_span().get_span_context().is_valid


def test_an_enqueue_continues_a_span_of_a_provider_the_process_did_not_set() -> None:
    # The caller traces with a provider of its own, not set for the process
    # (none is): its current span is continued all the same, sampled or not.
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    for provider, sampled in ((TracerProvider(), 1), (TracerProvider(sampler=ALWAYS_OFF), 0)):
        with provider.get_tracer("web").start_as_current_span("POST /chat") as span, \
                tracing.enqueue_span("run_agent", "r1", "default", "s1") as carried:
            _, trace_id, span_id, flags = carried["traceparent"].split("-")
            assert trace_id == format(span.get_span_context().trace_id, "032x")
            assert span_id == format(span.get_span_context().span_id, "016x")
            assert int(flags, 16) & 1 == sampled


def test_a_tracer_provider_once_found_set_is_not_looked_for_again_nor_its_tracer_made_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    looks: list[int] = []
    provider = TracerProvider()

    def found() -> object:
        looks.append(1)
        return provider

    monkeypatch.setattr(trace, "get_tracer_provider", found)
    tracing.forget_provider()
    try:
        assert tracing._recording() and tracing._recording()
        assert len(looks) == 1
        # Its tracer is made once (an SDK's get_tracer makes a new one each call).
        assert tracing._tracer() is tracing._tracer()
    finally:
        monkeypatch.undo()
        tracing.forget_provider()
    assert tracing._recording() is False  # the process sets none
