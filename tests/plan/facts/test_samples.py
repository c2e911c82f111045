"""Every host program's parser, on answers captured from real test hosts (samples/<program>/*.json,
recorded by `python -m tests.plan.facts.record`, pyinfra's tests/facts/<fact>/ shape): each
sample's answer reads as it did, and the program, built from the sample's parameters, still
sends them as it did (its named parameters on stdin)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.frames import Records
from tests.plan.facts.cases import build, load, samples, sent, to_data

ALL = samples()
PROGRAMS = ("apply", "engine-probe", "fetch", "gpu", "host-record", "install", "journal", "model-check", "observe",
            "progress", "show", "signal", "verify", "versions")


def test_every_program_has_a_captured_sample():
    assert sorted({p.parent.name for p in ALL}) == sorted(PROGRAMS)


@pytest.mark.parametrize("path", ALL, ids=[f"{p.parent.name}/{p.stem}" for p in ALL])
def test_a_captured_answer_reads_as_it_did(path: Path):
    s = load(path)
    program = build(s["program"], s["params"])
    got = program.parse(Records(s["stdout"], s["token"], "sample", s["stderr"]))
    assert to_data(got) == s["expected"]


@pytest.mark.parametrize("path", ALL, ids=[f"{p.parent.name}/{p.stem}" for p in ALL])
def test_the_program_still_asks_what_it_asked(path: Path):
    """Its parameters, named, as the sample was asked them: a renamed or reordered parameter
    shows here before a host would read it wrong."""
    s = load(path)
    assert sent(build(s["program"], s["params"]), s["token"]) == s["stdin"]
