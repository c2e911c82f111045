"""The tables of the desired-state TOML files, checked against their declared types.

A table is a frozen msgspec Struct (why msgspec: docs/architecture.md, "One serialiser").
`validate(Table, data)` checks parsed TOML against the table's annotations and builds it, or
raises `Invalid` with every error of the file at once, each as a dict with `type`, `loc`, `msg`
and `input`: the shape that problems.py turns into "file: key: what is expected".

What an annotation may be (nothing else is declared in schema.py and schema_drain.py):
- `Annotated[T, Check(fn)]`: `fn(value)` alone decides (returns the value, or raises `Invalid`
  with the message); `Annotated[T, After(fn)]`: T is checked first, then `fn(result)`;
- a Table, `dict[K, V]`, `list[T]`, `Literal[...]`, `X | None` (TOML has no null: a key that is
  not written takes the field's default);
- `str`, `int`, `float`, `bool`, checked strictly (nothing is ever coerced).

Unknown keys are errors, required keys (no default) must be written, and a table's own
`check_across()` (a check across its keys) runs once its keys are valid. Errors come in the order of
the table's fields, then its unknown keys; a dict's key before its value.
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal, NamedTuple, Union, get_args, get_origin

import msgspec

from ..errors import describe, kind_of
from ..redact import redact

DICT_KEY = "[key]"      # the last part of an error's loc when the error is about a dict's key


class Invalid(Exception):
    """What a check raises: `msg` is the whole message ("expected ..., got ..."), never a value
    that must stay secret; `kind`, the error's type (problems.py words an "expected" one about a
    key as an invalid name). `errors`: every error of a validation (validate() raises it so)."""

    def __init__(self, msg: str = "", errors: Sequence[Mapping[str, Any]] = (), kind: str = "expected"):
        super().__init__(msg or f"{len(errors)} errors")
        self.msg, self.kind = msg, kind
        self.errors = list(errors)


class Check(NamedTuple):
    """Annotated metadata: the function that checks a raw value (it alone decides)."""

    fn: Callable[[Any], Any]


class After(NamedTuple):
    """Annotated metadata: a function run on the value once its type is checked."""

    fn: Callable[[Any], Any]


class Table(msgspec.Struct, frozen=True, kw_only=True):
    """Base of every table: unknown keys are errors, nothing is coerced, nothing mutates."""

    def check_across(self) -> None:
        """A check across the table's keys, once each is valid: raise Invalid (default: none)."""


@functools.cache
def fields_of(cls: type) -> dict[str, Any]:
    """A table's fields and their annotations (Annotated kept), in declaration order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {name: hints[name] for name in cls.__struct_fields__}  # type: ignore[attr-defined]


def is_table(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, Table)


T = typing.TypeVar("T", bound=Table)


def validate(cls: type[T], data: Any) -> T:
    """`data` (parsed TOML) checked against `cls` and built; Invalid with every error else."""
    errors: list[dict[str, Any]] = []
    value = _check(cls, data, (), errors)
    if errors:
        raise Invalid(errors=errors)
    return value  # type: ignore[no-any-return]


_BAD = object()        # what a check gives for a value with errors (they are in `errors`)
_SCALARS = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}


def _expected(what: str, value: Any) -> str:
    """'expected a list, got an integer': the kind of a wrong value, never the value itself (a
    key may hold a secret; a check that knows a value is safe to show says it in its own words)."""
    return f"expected {what}, got {kind_of(value)}"


def _error(errors: list[dict[str, Any]], kind: str, loc: tuple[Any, ...], msg: str, value: Any) -> object:
    errors.append({"type": kind, "loc": loc, "msg": msg, "input": value})
    return _BAD


def _check(tp: Any, value: Any, loc: tuple[Any, ...], errors: list[dict[str, Any]]) -> Any:
    origin = get_origin(tp)
    if origin in _BY_ORIGIN:
        return _BY_ORIGIN[origin](tp, value, loc, errors)
    if is_table(tp):
        return _table(tp, value, loc, errors)
    if tp in _SCALARS:
        ok = isinstance(value, tp) and (tp is bool or not isinstance(value, bool))
        return value if ok else _error(errors, f"{tp.__name__}_type", loc, _expected(_SCALARS[tp], value), value)
    raise TypeError(f"no check for {tp!r}")      # a table declared with a type this module does not know


def _annotated(tp: Any, value: Any, loc: tuple[Any, ...], errors: list[dict[str, Any]]) -> Any:
    base, *meta = get_args(tp)
    check = next((m for m in meta if isinstance(m, Check)), None)
    if check is not None:
        return _call(check.fn, value, loc, errors)
    out = _check(base, value, loc, errors)
    for m in meta:
        if isinstance(m, After) and out is not _BAD:
            out = _call(m.fn, out, loc, errors)
    return out


def _optional(tp: Any, value: Any, loc: tuple[Any, ...], errors: list[dict[str, Any]]) -> Any:
    (inner,) = [a for a in get_args(tp) if a is not type(None)]
    return None if value is None else _check(inner, value, loc, errors)


def _literal(tp: Any, value: Any, loc: tuple[Any, ...], errors: list[dict[str, Any]]) -> Any:
    allowed = get_args(tp)
    if any(type(value) is type(a) and value == a for a in allowed):
        return value
    words = [repr(a) for a in allowed]
    said = f"{', '.join(words[:-1])} or {words[-1]}" if len(words) > 1 else words[0]
    # a choice among words of the schema: the word given is shown (redacted, cut), as a check shows a value
    got = describe(redact(value)) if isinstance(value, str) else kind_of(value)
    return _error(errors, "literal_error", loc, f"expected {said}, got {got}", value)


def _list(tp: Any, value: Any, loc: tuple[Any, ...], errors: list[dict[str, Any]]) -> Any:
    if not isinstance(value, list):
        return _error(errors, "list_type", loc, _expected("an array", value), value)
    (item,) = get_args(tp)
    items = [_check(item, v, (*loc, i), errors) for i, v in enumerate(value)]
    return _BAD if _BAD in items else items


def _call(fn: Callable[[Any], Any], value: Any, loc: tuple[Any, ...], errors: list[dict[str, Any]]) -> Any:
    try:
        return fn(value)
    except Invalid as e:
        return _error(errors, e.kind, loc, e.msg, value)


def _dict(tp: Any, value: Any, loc: tuple[Any, ...], errors: list[dict[str, Any]]) -> Any:
    if not isinstance(value, dict):
        return _error(errors, "dict_type", loc, _expected("a table", value), value)
    k_tp, v_tp = get_args(tp)
    out = {_check(k_tp, k, (*loc, k, DICT_KEY), errors): _check(v_tp, v, (*loc, k), errors) for k, v in value.items()}
    return _BAD if _BAD in out or _BAD in out.values() else out


def _table(cls: type[Table], value: Any, loc: tuple[Any, ...], errors: list[dict[str, Any]]) -> Any:
    if not isinstance(value, dict):
        return _error(errors, "model_type", loc, _expected("a table", value), value)
    before = len(errors)
    fields = fields_of(cls)
    given = {}
    for name, tp in fields.items():
        if name in value:
            given[name] = _check(tp, value[name], (*loc, name), errors)
        elif name in _required_fields(cls):
            _error(errors, "missing", (*loc, name), "Field required", value)
    for k, v in value.items():
        if k not in fields:
            _error(errors, "extra_forbidden", (*loc, k), "Extra inputs are not permitted", v)
    if len(errors) > before:
        return _BAD
    table = cls(**given)
    try:
        table.check_across()
    except Invalid as e:
        return _error(errors, e.kind, loc, e.msg, value)
    return table


_BY_ORIGIN: dict[Any, Callable[[Any, Any, tuple[Any, ...], list[dict[str, Any]]], Any]] = {
    Annotated: _annotated, Union: _optional, types.UnionType: _optional, Literal: _literal, dict: _dict, list: _list}


@functools.cache
def _required_fields(cls: type[Table]) -> frozenset[str]:
    return frozenset(f.name for f in msgspec.structs.fields(cls) if f.required)
