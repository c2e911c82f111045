"""Validation errors -> Problems that name the file and the dotted key, and say what is expected.

One translation for every TOML file a user writes: the desired state (load.py) and the rule
pack (preflight), both tables of tables.py, whose errors are dicts with `type`, `loc`, `msg`
and `input`.

A key reads as it is written in TOML (`services."a;b".env.A`); an item of an array of tables is
named by its `id` when its table has one (`rule[my-rule].when`), else counted from 1 as a reader
counts (`model[#1].traits`). An unknown key lists the keys allowed there and
suggests the closest one.

Input values are never echoed here (env values may be secrets); only the schema validators,
which know whether a value is secret, show values.
"""

from __future__ import annotations

import difflib
import json
import re
import types
from collections.abc import Mapping, Sequence
from typing import Any, Union, get_args, get_origin

from ..errors import Problem, kind_of
from .tables import DICT_KEY as _DICT_KEY  # the last loc entry when the error is about a key
from .tables import fields_of, is_table

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+\Z")

# (the class of a table, a key) -> the message for that key when it is unknown there: for a
# key that belongs in another file or table, saying where it goes helps more than a list.
Hints = Mapping[tuple[type, str], str]
Errors = Sequence[Mapping[str, Any]]


def dotted(*parts: object) -> str:
    """A dotted key for messages; parts that are not bare TOML keys are quoted: services."a;b"."""
    return ".".join(_key(str(p)) for p in parts)


def _key(part: str) -> str:
    # Non-ASCII as it is (readable, and a registered secret in a key is still recognized and
    # masked); control characters escaped by JSON.
    return part if _BARE_KEY.fullmatch(part) else json.dumps(part, ensure_ascii=False)


def key_path(loc: Sequence[int | str]) -> tuple[str, ...]:
    """The key path of an error, as strings: ('services', 'a;b', '[key]') -> ('services', 'a;b')."""
    return tuple(str(x) for x in loc if x != _DICT_KEY)


def validation_problems(file: str, model: type, errors: Errors, *,
                        data: Any = None, hints: Hints | None = None) -> list[Problem]:
    """Turn the errors about one file into Problems: a dotted key and what is expected.

    model is the table the file was validated against; errors, its errors (tables.Invalid's);
    data, the parsed file, lets an item of an array of tables be named by its id. hints: see
    `Hints`.
    """
    problems = []
    for e in errors:
        loc = e["loc"]
        is_name = bool(loc) and loc[-1] == _DICT_KEY
        kind = e["type"]
        if kind == "missing":
            message = "required key missing"
        elif kind == "extra_forbidden":
            message = _unknown_key(model, key_path(loc), hints or {})
        elif kind in ("model_type", "model_attributes_type", "dict_type"):
            message = f"expected a table, got {kind_of(e['input'])}"
        elif kind == "expected":
            message = ("invalid name: " if is_name else "") + e["msg"]
        else:
            message = e["msg"].removeprefix("Value error, ")
        problems.append(Problem(file, _where(model, loc, data), message))
    return problems


def _where(model: type, loc: Sequence[int | str], data: Any) -> str:
    """The dotted key of an error location; an array item is named by its id or its number."""
    parts: list[str] = []
    at: Any = data                       # the value at the path so far, when data was given
    for i, x in enumerate(loc):
        if x == _DICT_KEY:
            continue
        if isinstance(x, int):
            item = at[x] if isinstance(at, list) and x < len(at) else None
            table = _model_at(model, key_path(loc[:i + 1]))
            rid = item.get("id") if isinstance(item, Mapping) and table and "id" in fields_of(table) else None
            label = rid if isinstance(rid, str) and rid else f"#{x + 1}"
            if parts:
                parts[-1] += f"[{label}]"
            else:
                parts.append(f"[{label}]")
            at = item
        else:
            parts.append(_key(x))
            at = at.get(x) if isinstance(at, Mapping) else None
    return ".".join(parts)


def _unknown_key(model: type, path: tuple[str, ...], hints: Hints) -> str:
    parent = _model_at(model, path[:-1])
    key = path[-1]
    if parent is not None and (parent, key) in hints:
        return hints[parent, key]
    allowed = list(fields_of(parent)) if parent else []
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown key ({hint}allowed: {', '.join(allowed)})"


def _model_at(model: type, path: tuple[str, ...]) -> type | None:
    """The class that validates the table at `path` (walking fields, dict values and array
    items; an item's part of the path is its index)."""
    tp: Any = model
    for part in path:
        tp = _strip(tp)
        if is_table(tp):
            tp = fields_of(tp).get(part)
            if tp is None:
                return None
        elif get_origin(tp) is dict:
            tp = get_args(tp)[1]
        elif get_origin(tp) is list:
            tp = get_args(tp)[0]
        else:
            return None
    tp = _strip(tp)
    return tp if is_table(tp) else None


def _strip(tp: Any) -> Any:
    """Annotated[X, ...] -> X; X | None -> X."""
    if hasattr(tp, "__metadata__"):
        return _strip(get_args(tp)[0])
    args = [a for a in get_args(tp) if a is not type(None)]
    if get_origin(tp) in (Union, types.UnionType) and len(args) == 1:
        return _strip(args[0])
    return tp
