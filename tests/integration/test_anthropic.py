"""Crash and resume through the real ``anthropic`` SDK and loomflow's ``AnthropicModel``.

A local stand-in for the Messages API (``POST /v1/messages``, plain JSON
and SSE streams) answers like the real one: a reply is a pure function of
the request, every real call mints fresh ``toolu_`` ids, and a request
whose ``tool_result`` blocks don't answer the ``tool_use`` blocks of the
assistant message right before them gets HTTP 400. It records every
request, so the tests count the model calls actually sent.
"""

from __future__ import annotations

import json
import secrets
import string
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anthropic
import pytest
from loomflow import Agent, Event, RunResult
from loomflow.core.errors import InvalidRequestError
from loomflow.core.types import EventKind
from loomflow.model.anthropic import AnthropicModel
from loomflow.runtime import InMemoryJournalStore, JournaledRuntime

from loomflow_worker.runtime import PostgresRuntime
from loomflow_worker.testing import EffectsLog, plan

from .helpers import calls, crash_on, crashes

pytestmark = pytest.mark.anyio

MODEL = "claude-sonnet-4-6"
API_KEY = "sk-ant-test-not-a-key"
PROMPT = calls("a", "b")
ANSWER = "done: recorded a, recorded b"


# ---- the local Messages API -------------------------------------------------------------------


@dataclass(frozen=True)
class Received:
    """One request the server got, and how it answered."""

    path: str
    body: dict[str, Any]
    api_key: str | None
    turn: int
    status: int
    error: str | None = None
    minted: tuple[str, ...] = ()

    @property
    def streamed(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def system(self) -> str:
        system = self.body.get("system", "")
        if isinstance(system, str):
            return system
        return "\n\n".join(block.get("text", "") for block in system)

    def tool_result_ids(self) -> list[str]:
        return [
            block["tool_use_id"]
            for message in self.body.get("messages", [])
            if isinstance(message["content"], list)
            for block in message["content"]
            if block.get("type") == "tool_result"
        ]


class Rejected(Exception):
    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


def _text_of(content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    return "".join(block.get("text", "") for block in content if block.get("type") == "text")


def _is_prompt(message: dict[str, Any]) -> bool:
    """A user turn (as opposed to a user message carrying only tool results)."""
    content = message["content"]
    return message["role"] == "user" and (
        isinstance(content, str) or any(block.get("type") == "text" for block in content)
    )


def _blocks(message: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    content = message["content"]
    return [] if isinstance(content, str) else [b for b in content if b.get("type") == kind]


def _check_tool_pairing(messages: list[dict[str, Any]]) -> None:
    """The Messages API's rule: tool results answer the assistant message right before."""
    for index, message in enumerate(messages):
        results = _blocks(message, "tool_result")
        if not results:
            continue
        previous = messages[index - 1] if index > 0 else None
        expected = (
            {block["id"] for block in _blocks(previous, "tool_use")}
            if previous is not None and previous["role"] == "assistant"
            else set()
        )
        for block in results:
            if block["tool_use_id"] not in expected:
                raise Rejected(
                    400,
                    "invalid_request_error",
                    f"messages.{index}: unexpected `tool_use_id` found in `tool_result` blocks: "
                    f"{block['tool_use_id']}. Each `tool_result` block must have a "
                    "corresponding `tool_use` block in the previous message.",
                )
    for index, message in enumerate(messages):
        uses = [block["id"] for block in _blocks(message, "tool_use")]
        if not uses:
            continue
        following = messages[index + 1] if index + 1 < len(messages) else None
        answered = (
            {block["tool_use_id"] for block in _blocks(following, "tool_result")}
            if following is not None
            else set()
        )
        missing = [use for use in uses if use not in answered]
        if missing:
            raise Rejected(
                400,
                "invalid_request_error",
                f"messages.{index + 1}: `tool_use` ids were found without `tool_result` blocks "
                f"immediately after: {', '.join(missing)}. Each `tool_use` block must have a "
                "corresponding `tool_result` block in the next message.",
            )


def _new_id(prefix: str) -> str:
    alphabet = string.ascii_letters + string.digits
    return prefix + "".join(secrets.choice(alphabet) for _ in range(22))


def _pieces(text: str, size: int = 7) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def _sse(message: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """A finished Message as the event sequence the streaming API sends."""
    usage = message["usage"]
    yield (
        "message_start",
        {
            "type": "message_start",
            "message": {
                **message,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {**usage, "output_tokens": 1},
            },
        },
    )
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            start: dict[str, Any] = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": p} for p in _pieces(block["text"])]
        else:
            start = {**block, "input": {}}
            raw = json.dumps(block["input"])
            deltas = [{"type": "input_json_delta", "partial_json": p} for p in ["", *_pieces(raw)]]
        yield (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": index,
                "content_block": start,
            },
        )
        if index == 0:
            yield "ping", {"type": "ping"}
        for delta in deltas:
            yield (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": delta,
                },
            )
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    yield (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
            "usage": {"output_tokens": usage["output_tokens"]},
        },
    )
    yield "message_stop", {"type": "message_stop"}


@dataclass
class MessagesAPI:
    """A local Messages API whose replies follow the prompt's ``call`` lines.

    Turn ``n`` (counted from the last user prompt) answers with the ``n``-th
    line's tool calls under fresh ids; past the last line, with the text
    ``done: <every tool result of this run>``."""

    received: list[Received] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> None:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length", "0")))
                api._serve(self, json.loads(raw or b"{}"))

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # -- what the tests read

    def turns(self) -> list[int]:
        return [r.turn for r in self.received]

    def statuses(self) -> list[int]:
        return [r.status for r in self.received]

    # -- serving

    def _serve(self, handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        messages: list[dict[str, Any]] = body.get("messages", [])
        prompt_at = max((i for i, m in enumerate(messages) if _is_prompt(m)), default=-1)
        this_run = messages[prompt_at + 1 :]
        turn = sum(1 for m in this_run if m["role"] == "assistant")
        # SDK 2.x sends the key as a bearer token, older ones as x-api-key.
        bearer = handler.headers.get("authorization", "")
        api_key = handler.headers.get("x-api-key") or bearer.removeprefix("Bearer ") or None
        try:
            if handler.path != "/v1/messages":
                raise Rejected(404, "not_found_error", f"Not found: {handler.path}")
            if api_key != API_KEY or not handler.headers.get("anthropic-version"):
                raise Rejected(401, "authentication_error", "invalid x-api-key")
            _check_tool_pairing(messages)
            prompt = _text_of(messages[prompt_at]["content"]) if prompt_at >= 0 else ""
            message = self._reply(body, plan(prompt), turn, this_run)
        except Rejected as rejected:
            self._record(
                Received(handler.path, body, api_key, turn, rejected.status, rejected.message)
            )
            self._send_json(
                handler,
                rejected.status,
                {
                    "type": "error",
                    "error": {"type": rejected.kind, "message": rejected.message},
                },
            )
            return
        minted = tuple(b["id"] for b in message["content"] if b["type"] == "tool_use")
        self._record(Received(handler.path, body, api_key, turn, 200, None, minted))
        if body.get("stream"):
            self._send_sse(handler, message)
        else:
            self._send_json(handler, 200, message)

    def _record(self, received: Received) -> None:
        with self._lock:
            self.received.append(received)

    def _reply(
        self,
        body: dict[str, Any],
        turns: list[list[tuple[str, dict[str, Any]]]],
        turn: int,
        this_run: list[dict[str, Any]],
    ) -> dict[str, Any]:
        offered = {tool["name"] for tool in body.get("tools", [])}
        content: list[dict[str, Any]]
        if turn < len(turns):
            for name, _ in turns[turn]:
                if name not in offered:
                    raise Rejected(400, "invalid_request_error", f"no tool named {name!r}")
            content = [{"type": "text", "text": "I'll record that."}] + [
                {"type": "tool_use", "id": _new_id("toolu_01"), "name": name, "input": args}
                for name, args in turns[turn]
            ]
            stop_reason = "tool_use"
        else:
            outputs = [
                _text_of(block["content"])
                for message in this_run
                for block in _blocks(message, "tool_result")
            ]
            content = [{"type": "text", "text": "done: " + ", ".join(outputs)}]
            stop_reason = "end_turn"
        return {
            "id": _new_id("msg_01"),
            "type": "message",
            "role": "assistant",
            "model": body.get("model", MODEL),
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": {
                "input_tokens": len(json.dumps(body)) // 4,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "output_tokens": len(json.dumps(content)) // 4,
            },
        }

    @staticmethod
    def _send_json(handler: BaseHTTPRequestHandler, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        handler.send_response(status)
        handler.send_header("content-type", "application/json")
        handler.send_header("content-length", str(len(data)))
        handler.send_header("request-id", _new_id("req_01"))
        handler.end_headers()
        handler.wfile.write(data)

    @staticmethod
    def _send_sse(handler: BaseHTTPRequestHandler, message: dict[str, Any]) -> None:
        handler.send_response(200)
        handler.send_header("content-type", "text/event-stream; charset=utf-8")
        handler.send_header("cache-control", "no-cache")
        handler.send_header("transfer-encoding", "chunked")
        handler.send_header("request-id", _new_id("req_01"))
        handler.end_headers()
        for event, data in _sse(message):
            chunk = f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            handler.wfile.flush()
        handler.wfile.write(b"0\r\n\r\n")
        handler.wfile.flush()


# ---- fixtures and helpers ---------------------------------------------------------------------


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Iterator[MessagesAPI]:
    server = MessagesAPI()
    server.start()
    # AnthropicModel builds its own AsyncAnthropic client (SDK retries off);
    # the SDK takes the server from ANTHROPIC_BASE_URL.
    monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def models() -> AsyncIterator[list[AnthropicModel]]:
    """Every AnthropicModel a test makes; their HTTP clients are closed afterwards."""
    made: list[AnthropicModel] = []
    try:
        yield made
    finally:
        for model in made:
            await model._client.close()


def claude_agent(
    runtime: Any, effects: EffectsLog, models: list[AnthropicModel], instructions: str = "v1"
) -> Agent:
    model = AnthropicModel(MODEL, api_key=API_KEY, request_timeout_s=10)
    models.append(model)
    # auto_extract would send extra model calls of its own after each run.
    return Agent(
        instructions, model=model, tools=[effects.tool()], runtime=runtime, auto_extract=False
    )


async def run(agent: Agent, *, streamed: bool, events: list[Event] | None = None) -> RunResult:
    if not streamed:
        return await agent.run(PROMPT, session_id="s", user_id="u")
    seen = [] if events is None else events

    async def emit(event: Event) -> None:
        seen.append(event)

    return await agent.run(PROMPT, session_id="s", user_id="u", emit=emit)


async def crash_then_resume(
    runtime: Any,
    dsn: str,
    models: list[AnthropicModel],
    *,
    streamed: bool,
    resume_instructions: str,
    events: list[Event] | None = None,
) -> RunResult:
    """Run 1 dies in tool b; run 2 (a fresh agent and model) repeats the request."""
    crashing = EffectsLog(dsn, on_start=crash_on("b"))
    with crashes():
        await run(claude_agent(runtime, crashing, models, "v1"), streamed=streamed)
    agent = claude_agent(runtime, EffectsLog(dsn), models, resume_instructions)
    return await run(agent, streamed=streamed, events=events)


PATHS = pytest.mark.parametrize("streamed", [False, True], ids=["complete", "stream"])


# ---- tests -------------------------------------------------------------------------------------


@PATHS
async def test_a_resumed_run_sends_no_completed_model_call_again(
    runtime: PostgresRuntime,
    dsn: str,
    api: MessagesAPI,
    models: list[AnthropicModel],
    streamed: bool,
) -> None:
    events: list[Event] = []
    result = await crash_then_resume(
        runtime, dsn, models, streamed=streamed, resume_instructions="v1", events=events
    )
    assert result.output == ANSWER
    # Turns 0 and 1 completed in run 1 and replay; only turn 2 is sent by run 2.
    assert api.turns() == [0, 1, 2]
    assert api.statuses() == [200, 200, 200]
    assert {r.path for r in api.received} == {"/v1/messages"}
    assert {r.api_key for r in api.received} == {API_KEY}
    assert {r.streamed for r in api.received} == {streamed}
    # a completed before the crash; b was in flight and runs again.
    assert await EffectsLog(dsn).counts() == {"a": 1, "b": 2}
    # The final request answers the ids the server minted in run 1, verbatim.
    first, second, last = api.received
    assert last.tool_result_ids() == [*first.minted, *second.minted]
    if streamed:
        text = "".join(
            e.payload["chunk"]["text"] or ""
            for e in events
            if e.kind == EventKind.MODEL_CHUNK and e.payload["chunk"]["kind"] == "text"
        )
        assert text.endswith(ANSWER)


@PATHS
async def test_a_replayed_tool_result_answers_under_the_new_tool_use_id(
    runtime: PostgresRuntime,
    dsn: str,
    api: MessagesAPI,
    models: list[AnthropicModel],
    streamed: bool,
) -> None:
    # A deploy changed the instructions between the crash and the resume: the
    # model is asked again and mints new ids, while tool a's result replays.
    result = await crash_then_resume(
        runtime, dsn, models, streamed=streamed, resume_instructions="v2"
    )
    assert result.output == ANSWER
    assert api.turns() == [0, 1, 0, 1, 2]
    assert api.statuses() == [200] * 5
    assert [r.system for r in api.received] == ["v1", "v1", "v2", "v2", "v2"]
    assert await EffectsLog(dsn).counts() == {"a": 1, "b": 2}
    old_a, _, new_a, new_b, last = api.received
    assert new_a.minted != old_a.minted
    # a's replayed result was re-stamped with the id the server minted in run 2.
    assert new_b.tool_result_ids() == list(new_a.minted)
    assert last.tool_result_ids() == [*new_a.minted, *new_b.minted]


@PATHS
async def test_loomflows_own_runtime_sends_the_stale_tool_use_id(
    dsn: str, api: MessagesAPI, models: list[AnthropicModel], streamed: bool
) -> None:
    # The scenario above on loomflow's JournaledRuntime: the replayed result keeps
    # run 1's id and the API refuses the request. The test above guards this.
    runtime = JournaledRuntime(InMemoryJournalStore())
    with pytest.raises(InvalidRequestError) as info:
        await crash_then_resume(runtime, dsn, models, streamed=streamed, resume_instructions="v2")
    cause = info.value.__cause__
    assert isinstance(cause, anthropic.BadRequestError)
    assert cause.status_code == 400
    assert isinstance(cause.body, dict)
    assert cause.body["type"] == "error"
    error = cause.body["error"]
    assert error["type"] == "invalid_request_error"
    old_a, _, new_a, refused = api.received
    assert error["message"].startswith(
        f"messages.2: unexpected `tool_use_id` found in `tool_result` blocks: {old_a.minted[0]}."
    )
    # Sent once: neither the SDK nor loomflow's retry policy retries a 400.
    assert api.turns() == [0, 1, 0, 1]
    assert api.statuses() == [200, 200, 200, 400]
    assert refused.tool_result_ids() == list(old_a.minted) != list(new_a.minted)
    # b never ran again.
    assert await EffectsLog(dsn).counts() == {"a": 1, "b": 1}
