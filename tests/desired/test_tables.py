"""tables.validate: parsed TOML checked against a table's annotations, every error at once."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import pytest

from reconciler.desired.tables import DICT_KEY, After, Check, Invalid, Table, validate


def _even(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value % 2:
        raise Invalid(f"expected an even integer, got {value!r}")
    return value


def _short(value: list[int]) -> list[int]:
    if len(value) > 2:
        raise Invalid(f"expected at most 2, got {len(value)}")
    return value


Even = Annotated[int, Check(_even)]


class Inner(Table, frozen=True):
    a: Even | None = None
    b: Even | None = None

    def check_across(self) -> None:
        if (self.a is None) == (self.b is None):
            raise Invalid("expected exactly one of a and b")


class Outer(Table, frozen=True, kw_only=True):
    mode: Literal["on", "off"] | None = None
    name: str
    counts: dict[str, Even] = msgspec.field(default_factory=dict)
    inner: Inner | None = None
    items: Annotated[list[Inner], After(_short)] | None = None
    flag: bool = False


def errors(data: dict) -> list[tuple[str, tuple, str]]:
    with pytest.raises(Invalid) as e:
        validate(Outer, data)
    return [(x["type"], x["loc"], x["msg"]) for x in e.value.errors]


def test_a_valid_file_is_built_with_the_defaults_of_keys_not_written():
    out = validate(Outer, {"name": "x", "counts": {"k": 2}, "items": [{"a": 4}], "mode": "on"})
    assert out == Outer(name="x", counts={"k": 2}, items=[Inner(a=4)], mode="on")
    assert out.flag is False and out.inner is None


def test_every_error_of_a_file_comes_at_once_fields_first_then_unknown_keys():
    assert errors({"nmae": "x", "mode": "of", "counts": {"k": 3}, "flag": 1}) == [
        ("literal_error", ("mode",), "expected 'on' or 'off', got 'of'"),
        ("missing", ("name",), "Field required"),
        ("expected", ("counts", "k"), "expected an even integer, got 3"),
        ("bool_type", ("flag",), "expected true or false, got an integer"),
        ("extra_forbidden", ("nmae",), "Extra inputs are not permitted"),
    ]


def test_nothing_is_coerced():
    assert errors({"name": 1, "counts": {"k": True}}) == [
        ("str_type", ("name",), "expected a string, got an integer"),
        ("expected", ("counts", "k"), "expected an even integer, got True"),
    ]


def test_a_key_of_a_dict_is_checked_as_its_own_location():
    class Keys(Table, frozen=True):
        m: dict[Even, str] = msgspec.field(default_factory=dict)

    with pytest.raises(Invalid) as e:
        validate(Keys, {"m": {"x": 1}})
    assert [(x["loc"], x["type"]) for x in e.value.errors] == [
        (("m", "x", DICT_KEY), "expected"), (("m", "x"), "str_type")]


def test_a_table_or_list_of_the_wrong_kind_says_so():
    assert errors({"name": "x", "inner": 3, "items": {"a": 2}, "counts": []}) == [
        ("dict_type", ("counts",), "expected a table, got an array"),
        ("model_type", ("inner",), "expected a table, got an integer"),
        ("list_type", ("items",), "expected an array, got a table"),
    ]


def test_a_check_across_keys_runs_only_once_the_keys_are_valid():
    assert errors({"name": "x", "inner": {"a": 2, "b": 4}, "items": [{"a": 1, "b": 2}]}) == [
        ("expected", ("inner",), "expected exactly one of a and b"),
        ("expected", ("items", 0, "a"), "expected an even integer, got 1"),
    ]


def test_an_after_check_runs_on_the_checked_value_only():
    assert errors({"name": "x", "items": [{"a": 2}, {"a": 2}, {"b": 2}]}) == [
        ("expected", ("items",), "expected at most 2, got 3")]
    assert errors({"name": "x", "items": [{"a": 2}, {"a": 2}, {"a": 3}]}) == [
        ("expected", ("items", 2, "a"), "expected an even integer, got 3")]
