"""PURE: JSON data read leniently into frozen dataclasses, with msgspec (the project's one
serialiser, docs/architecture.md): what the records on a host (records.py) are read with.

A value is checked against its field's annotation; one that does not read as it costs that field
alone (its default), never the whole record. The bounds of review N5 are types: a string of a
record is never empty ("" reads as absent), and a whole number fits in a signed 64-bit integer
(a larger one, a bool, a non-finite float is no number we take).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
from collections.abc import Hashable, Mapping
from typing import Annotated, Any, TypeVar, cast, get_args, get_origin, get_type_hints

import msgspec

Text = Annotated[str, msgspec.Meta(min_length=1)]
Whole = Annotated[int, msgspec.Meta(ge=-(2**63) + 1, le=2**63 - 1)]
Schema = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]

T = TypeVar("T")
# Per class, what a key that is absent (or does not read as its type) means, where that is not
# the field's default (records.py: a record written before `schema` existed is of schema 1).
Absent = Mapping[type, Mapping[str, Any]]


def load_json(text: str) -> object:
    """JSON text read as data: None for any text that is not JSON as RFC 8259 has it (NaN and
    Infinity are not), nor a number past 64 bits' worth of digits that int() refuses, nor a
    nesting deeper than the decoder goes."""
    try:
        return msgspec.json.decode(text)
    except (msgspec.MsgspecError, RecursionError):
        return None


def read(cls: type[T], data: object, absent: Absent) -> T | None:
    """A `cls` from JSON data: unknown keys are ignored, a missing key or one whose value does
    not read as the field's type is the field's default (or `absent`'s), and a field that holds
    a dataclass is read the same way; None when `data` is no JSON object or a field without a
    default is missing. One msgspec.convert of the whole when all is well, field by field only
    when it is not."""
    if not isinstance(data, Mapping):
        return None
    mine = absent.get(cls, {})
    try:
        return msgspec.convert({**mine, **data}, cls)
    except msgspec.ValidationError:
        pass
    kept: dict[str, Any] = {}
    for name, tp in _hints(cast(Hashable, cls)).items():
        if name not in data:
            if name in mine:
                kept[name] = mine[name]
            continue
        nested = _dataclass_of(tp)
        try:
            kept[name] = read(nested, data[name], absent) if nested else msgspec.convert(data[name], tp)
        except msgspec.ValidationError:
            if name in mine:
                kept[name] = mine[name]
            elif (part := _readable_part(data[name], tp)) is not None:
                kept[name] = part
    try:
        return cls(**kept)
    except TypeError:            # a field without a default is missing
        return None


@functools.cache
def _hints(cls: Any) -> dict[str, Any]:
    """A dataclass's fields and their annotations (Text, Whole ... as msgspec reads them)."""
    hints = get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _readable_part(value: object, tp: Any) -> object:
    """What still reads of a value that does not read as its field's type: of a whole number
    written as a finite float, its whole part; of a table or an array, the entries (items) that
    read as the field's (a secret's version that is no string is left out, the others kept); of
    a word an enum with a `read` (reasons.Reason) does not know, what its `read` makes of it;
    None for anything else."""
    if isinstance(value, str):
        return _enum_word(value, tp)
    if isinstance(value, float):
        return _whole_part(value, tp)
    if isinstance(value, dict):
        return _readable_entries(value, tp)
    if isinstance(value, list):
        return _readable_items(value, tp)
    return None


def _enum_word(value: str, tp: Any) -> object:
    """A word read by the `read` of the field's enum (a reason written by a newer version), or None."""
    for arm in get_args(tp) or (tp,):
        if isinstance(arm, type) and issubclass(arm, enum.Enum) and hasattr(arm, "read"):
            return arm.read(value)
    return None


def _whole_part(value: float, tp: Any) -> int | None:
    """The whole part of a finite float in a whole-number field, when it is in the field's bounds."""
    if tp in (Whole, Schema) and math.isfinite(value) and _reads(int(value), tp):
        return int(value)
    return None


def _readable_entries(value: dict[Any, Any], tp: Any) -> dict[Any, Any] | None:
    """The entries of a table whose values read as a mapping field's values, or None for another field."""
    args = get_args(tp)
    if get_origin(tp) in (Mapping, dict) and len(args) == 2:
        return {k: v for k, v in value.items() if _reads(v, args[1])}
    return None


def _readable_items(value: list[Any], tp: Any) -> tuple[Any, ...] | None:
    """The items of an array that read as a `tuple[X, ...]` field's items, or None for another field."""
    args = get_args(tp)
    if get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return tuple(v for v in value if _reads(v, args[0]))
    return None


def _reads(value: object, tp: Any) -> bool:
    try:
        msgspec.convert(value, tp)
    except msgspec.ValidationError:
        return False
    return True


def _dataclass_of(tp: object) -> type | None:
    """The dataclass a field holds (`Quarantine | None` -> Quarantine), or None."""
    for arm in get_args(tp) or (tp,):
        if isinstance(arm, type) and dataclasses.is_dataclass(arm):
            return arm
    return None


def json_or_none(text: str, limit: int | None = None) -> Any:
    """What the JSON text holds, or None: a text over `limit` characters, text that is not JSON,
    or JSON nested too deep to read (total: never an exception). What it holds is the caller's
    to check, shape by shape."""
    if limit is not None and len(text) > limit:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None
