"""The pre-flight's one round trip (loop/checks._batch) and the engine probe that rides it
(loop/preflight._riding): the probe runs after the GPU read, never before it, and last; a host that
asks one engine asks it in the same round trip; several run side by side in their own."""

from __future__ import annotations

import pytest

from reconciler.frames import batch
from reconciler.host.engine import Ask, EngineProbe
from reconciler.host.versions import VersionRead
from reconciler.loop.checks import _batch
from reconciler.loop.preflight import _riding
from reconciler.plan.facts.versions import Versions
from reconciler.preflight import EngineRun, EngineVerdict, ModelCheck


def _run(service: str) -> EngineRun:
    return EngineRun(service, "sglang", "/usr/bin/python3", ("--model-path", "/models/m"))


def _probe(service: str) -> Ask:
    return Ask(_run(service), EngineProbe(_run(service)), "key")


def read_program(read: VersionRead) -> Versions:
    return Versions((read,))


def _early(service: str) -> Ask:
    return Ask(_run(service), early=EngineVerdict(service, "sglang", "inconclusive", message="did not run"))


def test_the_probe_runs_last_after_the_gpu_read():
    """After the GPU read, and last: its probe program ends the round trip's stdin and is read
    only where the probe runs (frames.batch refuses a `last` program anywhere else)."""
    read = VersionRead("m", "/usr/bin/python3", "sglang")
    probe = EngineProbe(_run("m"))
    facts = _batch({"m": ("[Service]\n", None)}, ModelCheck(["/models/m"]), 0, [read], probe)
    assert list(facts) == ["verify", "model", "gpu", "versions", "engine"]
    assert facts["engine"] is probe
    assert list(_batch({}, None, 0, [read])) == ["gpu", "versions"]
    with pytest.raises(ValueError, match="goes last"):
        batch([probe, read_program(read)], ["t1", "t2"])


def test_one_probe_rides_the_round_trip_several_do_not():
    one = _probe("a")
    assert _riding([one]) is one
    assert _riding([_early("b"), one]) is one           # an answer given without the host asks nothing
    assert _riding([_probe("a"), _probe("b")]) is None
    assert _riding([_early("a")]) is None
    assert _riding([]) is None
