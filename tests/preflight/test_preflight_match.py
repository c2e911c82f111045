"""The rule pack's matching without its heavy parts: plain version ranges and plain model names.

A deploy judges every declarative rule against the server version and the model. Where both
sides are plain (0.5.12 against ">=0.5.10,<0.5.14"; an architecture name with no wildcard), the
answer is computed directly, and must be exactly what packaging and fnmatch say.
"""

from __future__ import annotations

import fnmatch

from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from reconciler.preflight import _models
from reconciler.preflight._schema import Rule
from reconciler.preflight._versions import plain_covers

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
