"""A run plans a host once per facts and context (loop/host_run._HostRun._plan): plan_host is pure,
and a wave's pass, on the facts its lock found unmoved since the survey, used to plan again all
the survey had planned (four plans of a changing host where two are new: a few ms of the
controller's CPU a host in every env change)."""

from __future__ import annotations

import pytest

from reconciler.desired.spec import DesiredState, HostSpec, ServiceSpec, SSHSpec
from reconciler.host.transport import LocalTransport
from reconciler.loop import host_run
from reconciler.loop.host_run import Pass, _HostRun
from reconciler.loop.options import RunIO, RunOptions
from reconciler.loop.results import HostResult
from reconciler.loop.revision import Revision
from reconciler.plan.facts import HostFacts, ServiceFacts
from reconciler.plan.files import render_env_dropin, render_env_file
from reconciler.plan.model import Checks, Context, Kind
from reconciler.plan.records import ServiceRecord

UNIT = "[Service]\nExecStart=/usr/bin/python3 -m http.server 30000\n"
REV = "a" * 40


def _facts() -> HostFacts:
    return HostFacts(services={"m": ServiceFacts(
        "m", UNIT, render_env_dropin("m"), ServiceRecord(hash="old"),
        {"ActiveState": "active", "UnitFileState": "enabled"}, envfile_text=render_env_file({"A": "1"}))})


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = host_run.plan_host

    def plan_host(desired, facts, ctx):  # type: ignore[no-untyped-def]
        calls.append(desired.name)
        return real(desired, facts, ctx)
    monkeypatch.setattr(host_run, "plan_host", plan_host)
    return calls


def _runs(n: int) -> tuple[HostSpec, list[_HostRun]]:
    host = HostSpec("h1", SSHSpec("127.0.0.2"), {"m": ServiceSpec("m", UNIT, {"A": "2"})})
    rev = Revision(DesiredState(REV, {"h1": host}))
    return host, [_HostRun(host, rev, RunOptions(), RunIO(), HostResult("h1", "127.0.0.2"),
                           Pass(LocalTransport("h1"))) for _ in range(n)]


def test_a_later_pass_on_the_same_facts_and_an_equal_context_takes_the_plan_already_made(counted: list[str]) -> None:
    _, (survey, wave) = _runs(2)
    facts = _facts()
    ctx = Context(REV)
    first = survey._plan(facts, ctx)
    assert [a.kind for a in first.changes] == [Kind.WRITE, Kind.RESTART]
    assert survey._plan(facts, Context(REV, checks=Checks())) is first      # an equal context
    assert wave._plan(facts, Context(REV)) is first                        # the wave's pass
    assert counted == ["h1"]


@pytest.mark.parametrize("other", ["facts", "context", "desired"])
def test_other_facts_another_context_or_another_desired_host_is_planned_afresh(
        counted: list[str], other: str) -> None:
    host, (survey, wave) = _runs(2)
    facts = _facts()
    first = survey._plan(facts, Context(REV))
    if other == "facts":        # read again (a later round): equal, yet not the facts planned on
        again = wave._plan(_facts(), Context(REV))
        assert again == first and again is not first
    elif other == "context":    # the service is another pass's (a rollout wave holds it)
        again = wave._plan(facts, Context(REV, deferred=frozenset({"m"})))
        assert not again.changes and first.changes
    else:
        wave.host = HostSpec("h1", host.ssh, {"m": ServiceSpec("m", UNIT, {"A": "1"})})     # the env on disk
        again = wave._plan(facts, Context(REV))
        assert [a.kind for a in again.changes] == [Kind.RESTART]         # no file to write
    assert counted == ["h1", "h1"]
