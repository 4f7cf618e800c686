"""Journal values on the wire: loomflow's tagged-JSON codec, pickle only on opt-in."""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import pickle
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from datetime import time as dt_time
from decimal import Decimal
from enum import Enum
from pathlib import PurePath
from typing import Any, Literal

from loomflow.runtime import _codec
from pydantic import BaseModel

from .errors import InvalidInput

Serializer = Literal["json", "pickle"]

_TAG = _codec._TAG

log = logging.getLogger(__name__)


@dataclass
class CodecStats:
    """Values the journal refused: counted, logged, and their steps re-executed."""

    unencodable: int = 0
    undecodable: int = 0


def check_serializer(serializer: str) -> Serializer:
    if serializer == "json":
        return "json"
    if serializer == "pickle":
        return "pickle"
    raise InvalidInput(
        f'serializer must be "json" or "pickle", not {serializer!r}; "pickle" runs code '
        "from the journal on replay, so use it only for a store no untrusted party can write"
    )


def encode(value: Any, serializer: Serializer, stats: CodecStats, *, key: str) -> bytes | None:
    """``value`` as stored bytes, or ``None`` (counted, logged) when it can't be stored."""
    if serializer == "pickle":
        return pickle.dumps(value)
    try:
        return dumps(value)
    except TypeError as exc:
        stats.unencodable += 1
        log.warning(
            "journal: step %s returned a value the JSON codec can't store (%s); it is not "
            "journaled and re-executes on resume. Return JSON-able values, pydantic models "
            "or dataclasses.",
            key,
            exc,
            extra={"action": "journal_unencodable", "step": key},
        )
        return None


# ---- encoding: loomflow's ``_codec.dumps``, byte for byte, with less work per value --------

# No check for cycles: _encode builds every list and dict anew, so what it
# hands over has none (a value with a cycle fails in _encode already).
_JSON = json.JSONEncoder(separators=(",", ":"), check_circular=False)


def dumps(value: Any) -> bytes:
    """``_codec.dumps(value)``: the same bytes, built with a branch chosen once
    per type instead of a chain of ``isinstance`` checks per value."""
    return _codec.MAGIC + _JSON.encode(_encode(value)).encode("utf-8")


def _encode(value: Any) -> Any:
    kind = type(value)
    if kind is str or kind is int or kind is float or kind is bool or value is None:
        return value
    encoder = _ENCODERS.get(kind)
    if encoder is None:
        encoder = _ENCODERS[kind] = _encoder_of(kind)
    return encoder(value)


def _list(value: list[Any]) -> list[Any]:
    return [_encode(v) for v in value]


def _dict(value: dict[Any, Any]) -> Any:
    for k in value:
        if type(k) is not str:
            return _codec._encode(value)  # tagged "map", or a key of a str subclass
    if _TAG in value:
        return _codec._encode(value)
    return {k: _encode(v) for k, v in value.items()}


def _tuple(value: tuple[Any, ...]) -> Any:
    return {_TAG: "tuple", "v": [_encode(v) for v in value]}


def _model_encoder(cls: type[BaseModel]) -> Callable[[Any], Any]:
    path = f"{cls.__module__}:{cls.__qualname__}"

    def encode_model(value: BaseModel) -> Any:
        extra = value.__pydantic_extra__
        return {
            _TAG: "model",
            "cls": path,
            "v": {k: _encode(v) for k, v in value.__dict__.items()},
            "x": _encode(extra) if extra else {},
            "set": sorted(value.__pydantic_fields_set__),
        }

    return encode_model


def _encoder_of(kind: type) -> Callable[[Any], Any]:
    """How loomflow's ``_codec._encode`` encodes a value of type ``kind``: the
    first of its ``isinstance`` checks that ``kind`` passes decides. Lists,
    dicts, tuples and models (nearly every journal value) get their own
    function here; anything else is loomflow's own function."""
    if issubclass(kind, bool | int | float | str):
        return lambda value: value
    if kind is list:
        return _list
    if kind is dict:
        return _dict
    if kind is tuple:
        return _tuple
    if issubclass(kind, list | dict | tuple | frozenset | set | bytes | Enum):
        return _codec._encode
    if issubclass(kind, BaseModel):
        return _model_encoder(kind)
    return _codec._encode


_ENCODERS: dict[type, Callable[[Any], Any]] = {}


def _dataclass(cls: type, values: dict[str, Any]) -> Any:
    revived: Any = object.__new__(cls)
    for name, item in values.items():
        object.__setattr__(revived, name, item)
    return revived


#: Tags whose value is rebuilt from ``v`` alone.
_PLAIN: dict[str, Callable[[Any], Any]] = {
    "map": lambda v: {key: item for key, item in v},
    "tuple": tuple,
    "set": set,
    "frozenset": frozenset,
    "bytes": base64.b64decode,
    "datetime": datetime.fromisoformat,
    "date": date.fromisoformat,
    "time": dt_time.fromisoformat,
    "timedelta": lambda v: timedelta(days=v[0], seconds=v[1], microseconds=v[2]),
    "decimal": Decimal,
    "uuid": uuid.UUID,
}


@dataclass(frozen=True, slots=True)
class _ModelClass:
    """What decoding needs of a model class, looked up once per class path."""

    cls: type[BaseModel]
    fields: Any  # the keys of the class's fields, when a bare build is exact
    extra: bool

    @classmethod
    def of(cls, path: str) -> _ModelClass:
        found = _MODEL_CLASSES.get(path)
        if found is None:
            model = _codec._resolve(path)  # only a class of a module already loaded
            if not issubclass(model, BaseModel):
                raise _codec.UndecodableValue(f"{path} is not a pydantic model")
            exact = model.__pydantic_post_init__ is None and not model.__pydantic_root_model__
            found = cls(
                model,
                model.__pydantic_fields__.keys() if exact else None,
                model.model_config.get("extra") == "allow",
            )
            _MODEL_CLASSES[path] = found
        return found

    def build(self, fields_set: set[str], values: dict[str, Any], extra: dict[str, Any]) -> Any:
        """``cls.model_construct(fields_set, **values, **extra)``. The codec
        stores every field of a model, so a model whose stored fields are
        exactly its fields (and that has no post-init) is built as
        model_construct builds it, without looking up a default or an
        alias for each field."""
        if self.fields is None or values.keys() != self.fields:
            return self.cls.model_construct(fields_set, **{**values, **extra})
        model = self.cls.__new__(self.cls)
        _set = object.__setattr__
        _set(model, "__dict__", values)
        _set(model, "__pydantic_fields_set__", fields_set)
        _set(model, "__pydantic_extra__", extra if self.extra else None)
        _set(model, "__pydantic_private__", None)
        return model


_MODEL_CLASSES: dict[str, _ModelClass] = {}


def _revive(obj: dict[str, Any]) -> Any:
    """loomflow's ``_codec._decode`` for one JSON object, as ``json.loads`` builds
    it: its members are revived already (the parser calls this bottom-up), so
    no Python walks the lists and plain objects of a value a second time."""
    tag = obj.get(_TAG)
    if tag is None:
        return obj
    if tag == "model":
        return _ModelClass.of(obj["cls"]).build(
            set(obj.get("set") or ()), obj["v"], obj.get("x") or {}
        )
    plain = _PLAIN.get(tag)
    if plain is not None:
        return plain(obj.get("v"))
    cls = _codec._resolve(obj["cls"])
    v: Any = obj.get("v")
    if tag == "path" and issubclass(cls, PurePath):
        return cls(v)
    if tag == "enum" and issubclass(cls, Enum):
        return cls(v)
    if tag == "dataclass" and dataclasses.is_dataclass(cls):
        return _dataclass(cls, v)
    raise _codec.UndecodableValue(f"unknown or mismatched tag {tag!r} for {obj.get('cls')}")


def decode(blob: bytes, serializer: Serializer, stats: CodecStats, *, key: str) -> tuple[bool, Any]:
    """``(True, value)``, or ``(False, None)`` (counted, logged) for a value that won't load.

    Under the JSON serializer nothing is ever unpickled."""
    if blob[:3] == _codec.MAGIC:
        try:
            return True, json.loads(blob[3:], object_hook=_revive)
        except (ValueError, TypeError, KeyError, AttributeError, _codec.UndecodableValue) as exc:
            reason = str(exc)
    elif serializer == "pickle":
        return True, pickle.loads(blob)
    else:
        reason = "not a JSON journal value (pickles are never loaded unless opted in)"
    stats.undecodable += 1
    log.warning(
        "journal: can't decode the stored value of step %s (%s); the step runs again",
        key,
        reason,
        extra={"action": "journal_undecodable", "step": key},
    )
    return False, None
