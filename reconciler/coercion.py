"""typer's parameter coercion for plain types, without pydantic (a cold-start cost).

typer 0.2x coerces every parameter's value through a pydantic TypeAdapter that it builds on each
invocation: importing pydantic and compiling a schema per parameter costs about 0.1 s before a
command starts, a sixth of a no-change `reconcile` run. The reconciler's parameters are str,
bool, int and float (with min/max), Path and lists of str: `install()` has typer coerce those
directly, with the messages typer gives for them (pydantic's wording), and leaves every other
type (and any parameter with a parser, a click type or clamping) to typer. A typer without these
internals (an older or a newer release) is left as it is; tests/test_cold_start.py compares both
ways on every kind of value the reconciler's commands take.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union, get_args, get_origin

Convert = Callable[[Any, Any, Any], Any]      # (value, param, ctx) -> value; ValueError: bad input

_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}


def _text(value: Any, param: Any = None, ctx: Any = None) -> str:
    """A CLI value as str (bytes decoded as typer decodes argv)."""
    if isinstance(value, bytes):
        try:
            return value.decode(sys.getfilesystemencoding())
        except UnicodeError:
            return value.decode("utf-8", "replace")
    return str(value)


def _flag(value: Any, param: Any = None, ctx: Any = None) -> bool:
    if isinstance(value, bool):
        return value
    text = _text(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE or text == "":
        return False
    raise ValueError("Input should be a valid boolean, unable to interpret input")


def _number(kind: type, low: float | None, high: float | None) -> Convert:
    what = "a valid integer, unable to parse string as an integer" if kind is int else \
        "a valid number, unable to parse string as a number"

    def convert(value: Any, param: Any = None, ctx: Any = None) -> Any:
        if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"Input should be {what}")
        try:
            n = kind(value.strip() if isinstance(value, str) else value)
        except (TypeError, ValueError):
            raise ValueError(f"Input should be {what}") from None
        if low is not None and n < low:
            raise ValueError(f"Input should be greater than or equal to {low}")
        if high is not None and n > high:
            raise ValueError(f"Input should be less than or equal to {high}")
        return n
    return convert


def _optional(annotation: Any) -> Any:
    """X for `X | None` (typer hands None to no converter), else the annotation itself."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def converter(annotation: Any, info: Any, coerce_path: Callable[..., Any] | None = None) -> Convert | None:
    """How to coerce a value of this annotation without pydantic, or None (typer's own way)."""
    if any(getattr(info, k, None) for k in ("parser", "click_type", "clamp")):
        return None
    annotation = _optional(annotation)
    if get_origin(annotation) is list:
        (item,) = get_args(annotation) or (None,)
        if item is not str:
            return None

        def texts(value: Any, param: Any = None, ctx: Any = None) -> list[str]:
            return [_text(v) for v in (value if isinstance(value, list | tuple) else [value])]
        return texts
    if annotation is str:
        return _text
    if annotation is bool:
        return _flag
    if annotation in (int, float):
        return _number(annotation, getattr(info, "min", None), getattr(info, "max", None))
    if annotation is Path and coerce_path is not None and getattr(info, "path_type", None) in (None, Path):
        def path(value: Any, param: Any = None, ctx: Any = None) -> Any:
            p = value if isinstance(value, Path) else Path(_text(value))
            return coerce_path(p, info, path_type=Path, param=param, ctx=ctx)
        return path
    return None


def install() -> None:
    """Have typer coerce plain parameter types without building pydantic TypeAdapters."""
    try:
        from typer import core
    except ImportError:
        return
    build = getattr(core, "build_runtime_param", None)
    if build is None or getattr(build, "_plain", False):
        return
    plain = plain_builder(build)          # same contract as typer's, typed more loosely
    if plain is not None:
        core.build_runtime_param = plain      # type: ignore[assignment]


def plain_builder(build: Callable[[Any], Any]) -> Callable[[Any], Any] | None:
    """typer's build_runtime_param with plain types coerced directly (None: typer has not the
    internals this relies on)."""
    try:
        from typer import _coercion
        from typer._click.exceptions import BadParameter
        from typer._param_types import coerce_cli_path
    except ImportError:
        return None
    base: Any = getattr(_coercion, "RuntimeParam", None)
    if base is None:
        return None

    @dataclass(frozen=True)
    class PlainRuntimeParam(base):  # type: ignore[misc]
        """Coercion of a plain type by a converter (typer's RuntimeParam contract)."""

        convert: Convert | None = None

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            assert self.convert is not None
            try:
                return self.convert(value, param, ctx)
            except ValueError as e:
                raise BadParameter(str(e), ctx=ctx, param=param) from None

    def plain(descriptor: Any) -> Any:
        convert = None if getattr(descriptor, "file_annotation", None) is not None else \
            converter(descriptor.annotation, descriptor.parameter_info, coerce_cli_path)
        if convert is None:
            return build(descriptor)
        return PlainRuntimeParam(parameter_info=descriptor.parameter_info, annotation=descriptor.annotation,
                                 convert=convert)

    plain._plain = True  # type: ignore[attr-defined]
    return plain
