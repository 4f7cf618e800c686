"""A request is one OpenTelemetry trace, across the process that enqueues it
and every attempt on every worker: real workers export over OTLP/HTTP (set
up from the standard environment, no code) to a receiver in this process."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Span, Tracer

from loomflow_worker.tasks import run_agent
from loomflow_worker.tracing import REPLAYED
from tests.chaos.checks import RECOVERY, SHARING, quarantined
from tests.integration.celery_harness import Fleet, wait_status
from tests.integration.helpers import calls, tool_counts, wait_for_execution
from tests.integration.otlp_receiver import ReceivedSpan, Receiver, serve

pytestmark = pytest.mark.slow

ATTEMPT = "loomflow_worker.attempt"
OUTCOME = "loomflow_worker.outcome"
REQUEST = "loomflow_worker.request_id"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    yield from serve()


@pytest.fixture
def caller(receiver: Receiver) -> Iterator[Tracer]:
    """The tracer of a web process that enqueues inside its request's span
    (its own provider: this process's global one stays unset)."""
    provider = TracerProvider(resource=Resource.create({"service.name": "web"}))
    provider.add_span_processor(
        SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{receiver.endpoint}/v1/traces")))
    yield provider.get_tracer("web")
    provider.shutdown()


def _exporting(receiver: Receiver) -> dict[str, str]:
    """A worker's environment, the standard way."""
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_SERVICE_NAME": "agents", "OTEL_BSP_SCHEDULE_DELAY": "100",
            "TEST_TELEMETRY": "otel"}


def _ids(span: Span) -> tuple[str, str]:
    context = span.get_span_context()
    return format(context.trace_id, "032x"), format(context.span_id, "016x")


def _attempts(spans: list[ReceivedSpan], request_id: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name.startswith("attempt ")
            and s.attributes.get(REQUEST) == request_id]


def _ended(spans: list[ReceivedSpan], request_id: str, outcome: str = "succeeded") -> bool:
    return any(s.attributes.get(OUTCOME) == outcome for s in _attempts(spans, request_id))


def _under(spans: list[ReceivedSpan], root: ReceivedSpan) -> list[ReceivedSpan]:
    """The spans descending from ``root``."""
    found, frontier = [], {root.span_id}
    while frontier:
        children = [s for s in spans if s.parent_id in frontier]
        found += children
        frontier = {s.span_id for s in children}
    return found


def _steps(spans: list[ReceivedSpan], replayed: bool) -> set[str]:
    return {s.attributes["loomflow_worker.step"] for s in spans
            if s.name.startswith("step ") and s.attributes.get(REPLAYED) is replayed}


def test_a_request_killed_mid_run_and_resumed_elsewhere_is_one_trace(
    fleet: Fleet, receiver: Receiver, caller: Tracer
) -> None:
    env = {**RECOVERY, **_exporting(receiver), "TEST_TOOL_SLEEP": "0.4"}
    fleet.start("w1", concurrency=1, **env)
    fleet.start("w2", concurrency=1, **env)
    tags = ["t0", "t1", "t2"]
    with caller.start_as_current_span("POST /chat") as web:
        result = run_agent.delay(calls(*tags), "s-traced")
    trace_id, web_span = _ids(web)
    _, pid, _, _ = wait_for_execution(fleet.dsn, tags[1])
    victim = fleet.worker_of(pid)
    # The steps the first attempt completed are exported before its worker dies.
    receiver.wait_for("step of the first attempt", lambda spans: any(
        s.trace_id == trace_id and s.attributes.get(ATTEMPT) == 1 for s in spans))
    fleet.kill(victim)
    assert result.get(timeout=60)["output"] == "done: " + ", ".join(
        f"recorded {t}" for t in tags)
    spans = receiver.wait_for("succeeded attempt", lambda spans: _ended(spans, result.id))
    spans = receiver.wait_for("sweeper's redispatch", lambda spans: any(
        s.name.startswith("redispatch ") and s.trace_id == trace_id for s in spans))

    # One trace: the caller's, with the resumed attempt under the caller's span.
    assert {s.trace_id for s in spans if s.attributes.get(REQUEST) == result.id} == {trace_id}
    [resumed] = _attempts(spans, result.id)
    assert resumed.parent_id == web_span and resumed.trace_id == trace_id
    assert resumed.attributes[ATTEMPT] == 2 and resumed.service == "agents"
    assert resumed.attributes["loomflow_worker.worker"].startswith("w2-" if victim == "w1"
                                                                   else "w1-")
    assert resumed.attributes["gen_ai.conversation.id"] == "s-traced"
    assert "loomflow_worker.recovered" in resumed.events
    # The killed attempt's completed steps are in the trace; the resumed one
    # replays exactly those done before the crash and runs the rest.
    first = [s for s in spans if s.trace_id == trace_id and s.attributes.get(ATTEMPT) == 1]
    done_before = {"model_call_1", "tool_call_1_0", "model_call_2"}
    assert first and _steps(first, replayed=False) <= done_before
    second = _under(spans, resumed)
    assert _steps(second, replayed=True) == done_before
    assert _steps(second, replayed=False) >= {"tool_call_2_0", "model_call_3", "tool_call_3_0"}
    assert not _steps(second, replayed=False) & done_before
    assert resumed.attributes["loomflow_worker.steps.replayed"] == len(done_before)
    assert resumed.attributes["loomflow_worker.steps.executed"] >= 4
    # loomflow's own spans are inside the attempt; its replayed model calls
    # are marked, and their usage is not reported again.
    names = [s.name for s in second]
    assert any(n.startswith("invoke_agent") for n in names)
    chats = [s for s in second if s.name.startswith("chat")]
    assert len(chats) == 4
    replayed_chats = [s for s in chats if s.attributes.get(REPLAYED) is True]
    assert len(replayed_chats) == 2
    assert not any(k.startswith("gen_ai.usage.") for s in replayed_chats for k in s.attributes)
    assert tool_counts(fleet.dsn)["t0"] == 1


def test_a_parked_request_keeps_its_trace_through_the_handoff(
    fleet: Fleet, receiver: Receiver, caller: Tracer
) -> None:
    fleet.start("w1", concurrency=2, **_exporting(receiver), TEST_TOOL_SLEEP="0.4")
    with caller.start_as_current_span("POST /chat first") as web_first:
        first = run_agent.delay(calls("p1", "p2"), "s-park")
    wait_for_execution(fleet.dsn, "p1")
    with caller.start_as_current_span("POST /chat second") as web_second:
        second = run_agent.delay(calls("q1"), "s-park")
    fleet.wait_logged(f"request {second.id} parked")
    assert first.get(timeout=60)["output"] == "done: recorded p1, recorded p2"
    assert second.get(timeout=60)["output"] == "done: recorded q1"
    spans = receiver.wait_for("second's attempts", lambda spans: _ended(spans, second.id)
                              and _ended(spans, second.id, "parked") and _ended(spans, first.id))
    trace_id, web_span = _ids(web_second)
    attempts = _attempts(spans, second.id)
    assert sorted(a.attributes[OUTCOME] for a in attempts) == ["parked", "succeeded"]
    assert {(a.trace_id, a.parent_id) for a in attempts} == {(trace_id, web_span)}
    [handing] = _attempts(spans, first.id)
    assert handing.trace_id == _ids(web_first)[0] != trace_id
    assert "loomflow_worker.handoff" in handing.events


def test_a_malformed_traceparent_is_ignored_and_the_run_succeeds(
    fleet: Fleet, receiver: Receiver
) -> None:
    fleet.start("w1", concurrency=1, **_exporting(receiver))
    result = run_agent.apply_async((calls("m1"), "s-bad"),
                                   headers={"traceparent": "00-not-a-trace-01"})
    assert result.get(timeout=60)["output"] == "done: recorded m1"
    fleet.wait_logged(f"request {result.id}: its traceparent '00-not-a-trace-01' is not")
    fleet.wait_logged("ignored, its attempt starts a new trace")
    spans = receiver.wait_for("its attempt", lambda spans: _ended(spans, result.id))
    [attempt] = _attempts(spans, result.id)
    assert attempt.parent_id == ""  # a new trace


def test_a_request_run_in_quarantine_keeps_its_trace(
    fleet: Fleet, receiver: Receiver, caller: Tracer
) -> None:
    env = {**SHARING, "LOOMFLOW_WORKER_LEASE": "3", "LOOMFLOW_WORKER_REDISPATCH_AFTER": "3",
           "TEST_TOOL_SLEEP": "2", **_exporting(receiver)}
    # Both die twice with their shared process: their third attempts run in
    # a process of quarantine, then (a step done) back in the shared one.
    with caller.start_as_current_span("POST /chat") as web:
        suspect, neighbour = quarantined(fleet, env)
    trace_id, web_span = _ids(web)
    for request_id in (suspect, neighbour):
        assert wait_status(fleet.dsn, request_id, ("succeeded", "failed", "dead"),
                           timeout=120) == "succeeded", fleet.log_text()
    spans = receiver.wait_for("attempts in and after quarantine", lambda spans: all(
        _ended(spans, r) for r in (suspect, neighbour)) and all(any(
            a.attributes.get("loomflow_worker.quarantine") for a in _attempts(spans, r))
            for r in (suspect, neighbour)))
    for request_id in (suspect, neighbour):
        attempts = _attempts(spans, request_id)
        assert {(a.trace_id, a.parent_id) for a in attempts} == {(trace_id, web_span)}
        in_quarantine = [a for a in attempts if a.attributes.get("loomflow_worker.quarantine")]
        assert in_quarantine and all(a.attributes[ATTEMPT] == 3 for a in in_quarantine)


WEB_PROCESS = """
import sys
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=sys.argv[1])))
trace.set_tracer_provider(provider)
from loomflow_worker.tasks import run_agent

with trace.get_tracer("web").start_as_current_span("POST /chat") as span:
    result = run_agent.delay(sys.argv[2], "s-web")
print(result.id, format(span.get_span_context().span_id, "016x"))
provider.shutdown()
"""


def test_the_enqueue_is_a_span_of_the_callers_process_inside_its_current_span(
    fleet: Fleet, receiver: Receiver
) -> None:
    fleet.start("w1", concurrency=1, **_exporting(receiver))
    done = subprocess.run(
        [sys.executable, "-c", WEB_PROCESS, f"{receiver.endpoint}/v1/traces", calls("e1")],
        env={**fleet.env, "OTEL_SERVICE_NAME": "web"}, capture_output=True, text=True,
        timeout=120, check=True)
    request_id, web_span = done.stdout.split()
    assert wait_status(fleet.dsn, request_id, ("succeeded", "failed"), timeout=60) == "succeeded"
    spans = receiver.wait_for("its attempt", lambda spans: _ended(spans, request_id))
    [enqueue] = [s for s in spans if s.name.startswith("enqueue ")
                 and s.attributes.get(REQUEST) == request_id]
    [attempt] = _attempts(spans, request_id)
    assert (enqueue.parent_id, enqueue.service) == (web_span, "web")
    assert enqueue.attributes["gen_ai.conversation.id"] == "s-web"
    assert (attempt.trace_id, attempt.parent_id) == (enqueue.trace_id, enqueue.span_id)
