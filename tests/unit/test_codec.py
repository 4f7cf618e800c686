"""Journal values decode to exactly what loomflow's own codec gives (no services)."""

from __future__ import annotations

import dataclasses
import enum
import uuid
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from pathlib import PurePosixPath
from typing import Any

import pytest
from loomflow.core.types import Episode, Message, ModelChunk, Role, ToolCall, ToolResult, Usage
from loomflow.runtime import _codec

from loomflow_worker.admin.operator_signals import payload_blob
from loomflow_worker.runtime.codec import CodecStats, decode, encode


class Colour(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Point:
    x: int
    tags: tuple[str, ...]


VALUES: list[Any] = [
    None, True, 3, 2.5, "text", [1, [2, {"a": [3]}]], {"plain": {"nested": [1, 2]}},
    {(1, 2): "tuple key", 3: "int key"}, {"$t": "a user key that looks like a tag"},
    (1, (2, 3)), {1, 2}, frozenset({"a"}), b"\x00\xff", Colour.RED,
    datetime(2026, 11, 30, 12, 0, tzinfo=UTC), date(2026, 1, 2), time(3, 4, 5),
    timedelta(days=1, seconds=2, microseconds=3), Decimal("1.10"), uuid.UUID(int=7),
    PurePosixPath("/a/b"), Point(1, ("x", "y")),
    ToolResult(call_id="toolu_1", ok=True, output="recorded a"),
    ToolCall(id="toolu_2", tool="record", args={"tag": "b", "n": [1, 2]}),
    [ModelChunk(kind="text", text="hi"),
     ModelChunk(kind="finish", finish_reason="stop", usage=Usage(input_tokens=3, output_tokens=4))],
    Message(role=Role.USER, content="hello"),
    {"models": [ToolResult(call_id="c", ok=False, error="x")], "when": datetime(2026, 1, 1)},
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_decode_matches_loomflows_codec(value: Any) -> None:
    blob = _codec.dumps(value)
    ok, got = decode(blob, "json", CodecStats(), key="k")
    expected = _codec.loads(blob)
    assert ok
    assert type(got) is type(expected)
    assert got == expected
    if hasattr(expected, "model_fields_set"):
        assert got.model_fields_set == expected.model_fields_set


def test_an_episode_round_trips() -> None:
    episode = Episode(session_id="s", input="do a thing", output="did it")
    ok, got = decode(_codec.dumps(episode), "json", CodecStats(), key="k")
    assert ok and got == episode


def test_an_unknown_class_is_undecodable_and_counted() -> None:
    stats = CodecStats()
    blob = _codec.MAGIC + b'{"$t":"model","cls":"nowhere:Thing","v":{},"set":[]}'
    assert decode(blob, "json", stats, key="k") == (False, None)
    assert stats.undecodable == 1


def test_a_model_stored_before_its_class_gained_a_field_gets_the_default() -> None:
    stored = ToolResult(call_id="c", ok=True, output="x")
    assert b',"duration_ms":null' in _codec.dumps(stored)
    blob = _codec.dumps(stored).replace(b',"duration_ms":null', b"")
    assert b"duration_ms" not in blob
    ok, got = decode(blob, "json", CodecStats(), key="k")
    assert ok and got == _codec.loads(blob) == stored


class Shade(enum.IntEnum):
    DARK = 1


class Tag(str):
    pass


class Loose(ToolResult, extra="allow"):
    pass


ENCODED: list[Any] = [
    *VALUES, Shade.DARK, [Shade.DARK, {"k": Shade.DARK}], Tag("sub"), {Tag("k"): 1},
    [True, 1, 1.5, None], (ToolResult(call_id="t", ok=True, output=[1, (2,)]),),
    Loose(call_id="l", ok=True, extra_field={"deep": (1, b"x")}),
    {"a": {1: "int key inside"}}, [[], {}, ()], float("nan"), "ünïcødé \u2603",
]


@pytest.mark.parametrize("value", ENCODED, ids=lambda v: type(v).__name__)
def test_encode_writes_loomflows_bytes(value: Any) -> None:
    assert encode(value, "json", CodecStats(), key="k") == _codec.dumps(value)


def test_a_value_the_codec_cannot_store_is_refused_and_counted() -> None:
    stats = CodecStats()
    assert encode([1, object()], "json", stats, key="k") is None
    assert stats.unencodable == 1


@pytest.mark.parametrize("value", [*VALUES, *ENCODED, {"a": [1, {"$t": "x"}]}, 10**30, -0.0],
                         ids=lambda v: type(v).__name__)
def test_a_signal_payload_is_stored_as_loomflows_codec_stores_it(value: Any) -> None:
    # Plain JSON is written without the codec (the signal command loads no agent
    # framework), anything else through it: the bytes are the codec's either way.
    assert payload_blob(value) == _codec.dumps(value)


def test_a_signal_payload_the_codec_cannot_store_is_refused() -> None:
    with pytest.raises(TypeError):
        payload_blob({"a": object()})
