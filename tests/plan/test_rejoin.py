"""A leave of rotation that no rejoin followed (plan/rejoin.py, issue 42), as a table of
(desired, observed, context) -> the plan's steps: a healthy service that this plan does not
touch rejoins (REJOIN), one the plan restarts, starts, stops or watches goes through its own
cutover, one that is not healthy stays out and the note says why, and one taken out of rotation
by hand (no record of a leave) is left alone."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest

from reconciler.desired.spec import CallSpec, DrainSpec, ServiceSpec
from reconciler.plan.actions import plan_host
from reconciler.plan.facts import HostFacts, ServiceFacts
from reconciler.plan.model import Context, Kind, ServicePlan, State, Target
from reconciler.plan.records import HostRecord, Pending, Quarantine, Result, ServiceRecord
from reconciler.plan.rejoin import not_healthy
from reconciler.values import replace
from tests.plan.test_plan import GOOD, OLD, REV, host, on_host, svc, verified

D = DrainSpec(CallSpec("haproxy", "/run/haproxy.sock", input="set server models/h1 state drain"),
              CallSpec("haproxy", "/run/haproxy.sock", input="set server models/h1 state ready"))
M = svc(drain=D)
M_OLD = svc(env={"A": "0"}, drain=D)           # what ran before a change of env
BARE = svc()                                   # no drain declared
BAD = svc(env={"A": "bad"}, drain=D)           # a desired version that failed here
LAST = svc(env={"A": "good"}, drain=D)         # ... and the last good one, running again
QBAD = Quarantine(hash=BAD.content_hash(), revision=REV, reason="CrashLoop", at=7)
PENDING = replace(verified(M_OLD, OLD), hash=M.content_hash(), revision=REV,
                  pending=Pending(hash=M.content_hash(), revision=REV, at=5, started=True))


def left(f: ServiceFacts) -> ServiceFacts:
    """The service with a leave of rotation recorded on the host (rotation/NAME.left)."""
    return replace(f, left_rotation=True)


@dataclass(frozen=True)
class Case:
    id: str
    desired: tuple[ServiceSpec, ...]
    observed: ServiceFacts
    steps: tuple[str, ...]                      # `kind service Reason: detail`, the visible ones
    result: Result = Result.IN_SYNC             # the service's plan's result
    ctx: Mapping[str, object] = field(default_factory=dict)


WHY = "(left by a run that did not finish)"
CASES = [
    Case("in sync and healthy: it rejoins, not restarted", (M,), left(on_host(M, verified(M))),
         ("record - Record", f"rejoin m LeftRotation: rejoin rotation {WHY}"), Result.CONVERGED),
    Case("taken out of rotation by hand (no leave recorded): left alone", (M,), on_host(M, verified(M)), ()),
    Case("a change restarts it: its own cutover rejoins it", (M,), left(on_host(M_OLD, verified(M_OLD, OLD))),
         ("intent m Record", "write m EnvChanged", "restart m UnitChanged", "record m Record", "record - Record",
          "watch m HealthCheck"), Result.CONVERGED),
    Case("stopped: the plan starts it, its own cutover rejoins it", (M,),
         left(on_host(M, verified(M), active="inactive")),
         ("start m NotRunning", "record m Record", "record - Record", "watch m HealthCheck"), Result.CONVERGED),
    Case("its deploy has no verdict: the watch decides", (M,), left(on_host(M, PENDING)),
         ("watch m Reverify",), Result.CONVERGED),
    Case("still starting: stays out", (M,), left(on_host(M, verified(M), active="activating")),
         (f"hold m HoldOutOfRotation: stays out of rotation {WHY}: its unit is activating, not active",)),
    Case("no drain declared: stays out, put back by hand", (BARE,), left(on_host(BARE, verified(BARE))),
         (f"hold m HoldOutOfRotation: stays out of rotation {WHY}: it declares no drain, so no rejoin: put it "
          "back by hand",)),
    Case("quarantined, its last good runs: it rejoins", (BAD,),
         left(on_host(LAST, verified(LAST, GOOD, quarantine=QBAD))),
         ("hold m HoldLastGood: desired aaaaaaa quarantined (CrashLoop), running ccccccc", "record - Record",
          f"rejoin m LeftRotation: rejoin rotation {WHY}"),
         Result.QUARANTINED, {"last_good": {"m": LAST}}),
    Case("a rollout wave converges it: that pass decides", (M,), left(on_host(M, verified(M))), (),
         ctx={"deferred": frozenset({"m"})}),
]


def shown(a_kind: str, service: str | None, reason: str, detail: str) -> str:
    return f"{a_kind} {service or '-'} {reason}" + (f": {detail}" if detail and a_kind in ("rejoin", "hold") else "")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_recorded_leave(case: Case) -> None:
    ctx = replace(Context(REV), **case.ctx)  # type: ignore[arg-type]
    plan = plan_host(host(*case.desired), HostFacts(services={"m": case.observed},
                                                                 record=HostRecord(applied_revision=REV)), ctx)
    got = tuple(shown(a.kind.value, a.service, a.reason.value, a.detail) for a in plan.actions
                if a.kind not in (Kind.ARM, Kind.ARM_TIMER, Kind.DISARM))
    assert got == case.steps
    assert plan.services["m"].result is case.result


def _sp(spec: ServiceSpec, state: State = State.IN_SYNC) -> ServicePlan:
    return ServicePlan("m", state, Target(spec, REV))


@pytest.mark.parametrize(("record", "why"), [
    (verified(M), None),
    (None, "its record does not say it runs aaaaaaa"),
    (replace(verified(M), corrupt=True), "its record does not say it runs aaaaaaa"),
    (verified(M_OLD, OLD), "its record does not say it runs aaaaaaa"),
    (PENDING, "the deploy of aaaaaaa has no verdict yet"),
    (ServiceRecord(hash=M.content_hash(), revision=REV), "aaaaaaa never passed its health check here"),
])
def test_only_a_version_that_passed_health_here_rejoins(record: ServiceRecord | None, why: str | None) -> None:
    assert not_healthy(_sp(M), on_host(M, record)) == why


def test_a_service_with_nothing_to_run_stays_out() -> None:
    sp = ServicePlan("m", State.QUARANTINED_NO_GOOD)
    assert not_healthy(sp, on_host(M, verified(M), active="inactive")) == "nothing to run (QuarantinedNoLastGood)"
