"""The rule pack's matching without its heavy parts: plain version ranges and plain model names.

A deploy judges every declarative rule against the server version and the model. Where both
sides are plain (0.5.12 against ">=0.5.10,<0.5.14"; an architecture name with no wildcard), the
answer is computed directly, and must be exactly what packaging and fnmatch say.
"""

from __future__ import annotations

import fnmatch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from reconciler.errors import ConfigError
from reconciler.preflight import _models
from reconciler.preflight._rules import load_rules, parse_rule_file
from reconciler.preflight._schema import Rule
from reconciler.preflight._versions import plain_covers, plain_range

releases = st.lists(st.integers(0, 15), min_size=1, max_size=4).map(lambda xs: ".".join(map(str, xs)))
clauses = st.tuples(st.sampled_from(["<", "<=", ">", ">=", "==", "!="]), st.sampled_from(["", " "]), releases)
specs = st.lists(clauses, min_size=1, max_size=3).map(lambda cs: ",".join(f"{o}{s}{r}" for o, s, r in cs))


@settings(max_examples=800, deadline=None)
@given(specs, releases)
def test_a_plain_range_answers_as_packaging_does(spec, version):
    assert plain_covers(spec, version) == SpecifierSet(spec).contains(Version(version), prereleases=True)


def test_anything_but_plain_is_left_to_packaging():
    for spec, version in [("==1.0.*", "1.0.3"), ("~=0.5.10", "0.5.12"), ("===0.5.12", "0.5.12"),
                          (">=0.5.10,<0.5.14", "0.5.12rc1"), (">=0.5.10", "0.5.12.post1"),
                          (">=0.5.10", "0.5.12+local"), (">=0.5.10", "v0.5.12"), (">=0.5.10rc1", "0.5.12"),
                          (">=0.5.10", "0.5.\u0661"), ("", "1.0")]:
        assert plain_covers(spec, version) is None, (spec, version)
    # ...and the rule still answers through packaging
    rule = Rule(id="r", server="sglang", message="m", fix="f", source="https://s", versions="<0.5.14")
    assert rule.covers("0.5.12rc1") and not rule.covers("0.5.14.post1") and rule.covers("0.5.13")
    assert Rule(id="r", server="sglang", message="m", fix="f", source="https://s", versions="~=0.5.10").covers("0.5.12")


@settings(max_examples=300, deadline=None)
@given(specs)
def test_a_plain_range_is_one_packaging_takes(spec):
    assert plain_range(spec)
    assert str(SpecifierSet(spec))       # valid: packaging reads it (InvalidSpecifier otherwise)


def _rule_file(versions: str) -> bytes:
    return (f'[[rule]]\nid = "r"\nserver = "sglang"\nmessage = "m"\nfix = "f"\nsource = "https://s"\n'
            f'versions = "{versions}"\n').encode()


def test_a_range_that_is_not_plain_is_checked_by_packaging():
    for spec in ["==1.0.*", "~=0.5.10", "===0.5.12", ">=0.5.10rc1", "", ">>1.0", ">=0.5.x", "0.5.1"]:
        assert not plain_range(spec), spec
    assert parse_rule_file(_rule_file("~=0.5.10"), "rules/x.toml").rule[0].versions == "~=0.5.10"
    assert parse_rule_file(_rule_file(">= 0.5.10, <0.6"), "rules/x.toml").rule[0].versions == ">= 0.5.10, <0.6"
    with pytest.raises(ConfigError) as e:
        parse_rule_file(_rule_file(">>1.0"), "rules/x.toml")
    (p,) = e.value.problems
    assert (p.file, p.key) == ("rules/x.toml", "rule[r].versions")
    assert "expected a version range such as '>=0.5.10,<0.5.14', got '>>1.0'" in p.message


def test_every_range_in_the_shipped_rule_pack_is_plain():
    """So that loading the pack, on every deploy, validates its ranges without packaging."""
    ranges = [r.versions for r in load_rules().rules if r.versions is not None]
    assert len(ranges) == 9
    assert all(plain_range(v) for v in ranges), ranges


def test_a_name_with_no_wildcard_is_compared_without_fnmatch(monkeypatch):
    calls: list[str] = []
    real = fnmatch.fnmatchcase
    monkeypatch.setattr(_models.fnmatch, "fnmatchcase", lambda n, p: calls.append(p) or real(n, p))
    assert _models.glob_any("Qwen3NextForCausalLM", ["JambaForCausalLM", "qwen3nextforcausallm"]) \
        == "qwen3nextforcausallm"
    assert _models.glob_any("Qwen3NextForCausalLM", ["Qwen3Next"]) is None
    assert calls == []
    assert _models.glob_any("Qwen/Qwen3-Next-80B-A3B", ["*/qwen3-next-*"]) == "*/qwen3-next-*"
    assert _models.glob_any("x", ["[xy]"]) == "[xy]" and _models.glob_any("x", ["?"]) == "?"
    assert calls == ["*/qwen3-next-*", "[xy]", "?"]
