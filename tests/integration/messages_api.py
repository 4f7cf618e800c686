"""A local stand-in for the Anthropic Messages API (``POST /v1/messages``,
plain JSON and SSE streams), shared by the tests that drive the real
``anthropic`` SDK in this process or in workers. It answers like the real
one: a reply is a pure function of the request, every real call mints fresh
``toolu_`` ids, and a request whose ``tool_result`` blocks don't answer the
``tool_use`` blocks of the assistant message right before them gets HTTP 400.
It records every request, so the tests count the model calls actually sent.
"""

from __future__ import annotations

import json
import math
import secrets
import string
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from loomflow_worker.testing import plan

from .helpers import calls

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
    # The usage it reported (input_tokens, cache_creation_input_tokens,
    # cache_read_input_tokens, output_tokens), for an answered request.
    usage: dict[str, int] = field(default_factory=dict)

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
    def __init__(self, status: int, kind: str, message: str,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message
        self.retry_after = retry_after


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


def _usage(body: dict[str, Any], turn: int, content: list[dict[str, Any]]) -> dict[str, int]:
    """What a reply reports it used, about four characters a token, as the
    real API does with prompt caching: the system prompt and tools (the
    cached prefix) written to the cache by a run's first call and read from
    it by the calls after; the messages at the full input rate."""
    prefix = len(json.dumps([body.get("system"), body.get("tools")])) // 4
    return {
        "input_tokens": len(json.dumps(body.get("messages"))) // 4,
        "cache_creation_input_tokens": prefix if turn == 0 else 0,
        "cache_read_input_tokens": prefix if turn > 0 else 0,
        "output_tokens": len(json.dumps(content)) // 4,
    }


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
    # Metered as Anthropic meters a key, a token bucket: ``per_window``
    # requests at most at once, refilled at ``per_window`` per ``window``
    # seconds; past that, 429 with the retry-after that frees a place (whole
    # seconds, rounded up, as Anthropic sends it).
    per_window: int | None = None
    window: float = 60.0
    _bucket: tuple[float, float] | None = None  # (requests left, when)
    # The first ``overloaded`` requests get 529 (overloaded_error), no retry-after.
    overloaded: int = 0
    _admitted: list[float] = field(default_factory=list)
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

        class Server(ThreadingHTTPServer):
            # Hundreds of runs call at once: a listen backlog of 5 (the
            # default) would refuse connections as no provider does.
            request_queue_size = 1024
            daemon_threads = True

        self._server = Server(("127.0.0.1", 0), Handler)
        # Polled often, so that stop() returns at once rather than in half a second.
        threading.Thread(target=self._server.serve_forever, args=(0.02,), daemon=True).start()

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
            self._meter()
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
                retry_after=rejected.retry_after,
            )
            return
        minted = tuple(b["id"] for b in message["content"] if b["type"] == "tool_use")
        self._record(Received(handler.path, body, api_key, turn, 200, None, minted,
                              message["usage"]))
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
            "usage": _usage(body, turn, content),
        }

    def admitted(self) -> list[float]:
        """When (monotonic) each request was let through its meter."""
        with self._lock:
            return list(self._admitted)

    def _meter(self) -> None:
        with self._lock:
            if self.overloaded > 0:
                self.overloaded -= 1
                raise Rejected(529, "overloaded_error", "Overloaded")
            now = time.monotonic()
            if self.per_window is None:
                self._admitted.append(now)
                return
            rate = self.per_window / self.window
            left, then = self._bucket or (float(self.per_window), now)
            left = min(float(self.per_window), left + (now - then) * rate)
            if left < 1.0:
                self._bucket = (left, now)
                raise Rejected(429, "rate_limit_error",
                               "This request would exceed the rate limit for your organization",
                               retry_after=max(1, math.ceil((1.0 - left) / rate)))
            self._bucket = (left - 1.0, now)
            self._admitted.append(now)

    @staticmethod
    def _send_json(handler: BaseHTTPRequestHandler, status: int, payload: dict[str, Any],
                   retry_after: int | None = None) -> None:
        data = json.dumps(payload).encode()
        handler.send_response(status)
        if retry_after is not None:
            handler.send_header("retry-after", str(retry_after))
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


@contextmanager
def serving() -> Iterator[MessagesAPI]:
    """A local Messages API for the time of the block."""
    server = MessagesAPI()
    server.start()
    try:
        yield server
    finally:
        server.stop()
