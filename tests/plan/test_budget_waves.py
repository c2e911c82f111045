"""The budget driving a rollout (loop/waves.py `Waves`, issue 42): before each wave the members
are read afresh and plan/budget.next_step picks who goes; a blocked budget is read again a few
times (virtual time, FakeClock) before the rollout ends; a halt leaves the hosts not yet gone
untouched. Also which services of a plan drain before the stop (loop/cutover.draining)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from reconciler.desired.spec import CallSpec, DrainSpec, RolloutPolicy, ServiceSpec
from reconciler.loop.cutover import draining
from reconciler.loop.waves import BLOCKED_READS, BLOCKED_WAIT, Waves
from reconciler.plan.budget import Member
from reconciler.plan.model import Action, HostPlan, Kind, Reason, ServicePlan, State, Target
from reconciler.plan.rollout import GroupKey, RolloutPlan, Wave, plan_waves
from tests.clock import FakeClock

HOSTS = ("h1", "h2", "h3")


def rollout(policy: RolloutPolicy, pending: Sequence[str] = HOSTS) -> RolloutPlan:
    waves = plan_waves(pending, {}, policy, len(HOSTS))
    return RolloutPlan(GroupKey("model", "model"), policy, HOSTS, tuple(pending), policy.bound(3), waves)


def run(waves: Waves, fail_at: str | None = None) -> list[Wave]:
    """Walk the waves as the fleet does; `fail_at`: stop after that host's wave (a halt)."""
    async def walk() -> list[Wave]:
        out = []
        while (w := await waves.next()) is not None:
            out.append(w)
            if fail_at in w.hosts:
                break
            waves.went(w)
        return out
    return asyncio.run(walk())


class Fleet:
    """Members as the budget reads them: down ones, and each wave's hosts back once they went."""

    def __init__(self, down: set[str], stays_down: set[str] = frozenset()) -> None:
        self.down, self.stays_down, self.reads = set(down), set(stays_down), 0
        self.waves: Waves | None = None

    async def read(self) -> list[Member]:
        self.reads += 1
        gone = {h for w in (self.waves.done if self.waves else []) for h in w.hosts}
        return [Member(h, h not in (self.down - gone) | self.stays_down, "unhealthy") for h in HOSTS]


# down at start, hosts that stay down, policy -> the waves (hosts, canary), blocked at the end
@pytest.mark.parametrize(("down", "stays", "policy", "want", "blocked"), [
    (set(), set(), RolloutPolicy(1, 1, 2), [(("h1",), True), (("h2",), False), (("h3",), False)], False),
    # max_unavailable 2, but the budget lets one go at a time
    (set(), set(), RolloutPolicy(1, 2, 2), [(("h1",), True), (("h2",), False), (("h3",), False)], False),
    # one host already down: it goes first (as the canary), then the others one by one
    ({"h3"}, set(), RolloutPolicy(1, 1, 2), [(("h3",), True), (("h1",), False), (("h2",), False)], False),
    # min_available 1: two at once after the canary
    (set(), set(), RolloutPolicy(1, 2, 1), [(("h1",), True), (("h2", "h3"), False)], False),
    # h3 down and never coming back, h3 not pending: h1 and h2 can never go
    ({"h3"}, {"h3"}, RolloutPolicy(1, 1, 2), [], True),
])
def test_the_budget_picks_each_wave_from_a_fresh_read(down: set[str], stays: set[str], policy: RolloutPolicy,
                                                      want: list[tuple[tuple[str, ...], bool]],
                                                      blocked: bool) -> None:
    pending = tuple(h for h in HOSTS if h not in stays)
    fleet = Fleet(down, stays)
    clock = FakeClock()
    waves = fleet.waves = Waves(rollout(policy, pending), fleet.read, clock)
    got = run(waves)
    assert [(w.hosts, w.canary) for w in got] == want
    assert waves.blocked is blocked
    if blocked:
        # read again BLOCKED_READS times, BLOCKED_WAIT apart (virtual time), before giving up
        assert fleet.reads == BLOCKED_READS and clock.slept == [BLOCKED_WAIT] * (BLOCKED_READS - 1)
        assert waves.said[-1].startswith("blocked: 2 of 3 ready, min_available = 2; h1 waits: ")
    else:
        assert clock.slept == [] and fleet.reads == len(want)     # one read per wave, none once all went


def test_a_host_that_waits_is_said_and_a_halt_leaves_the_rest_as_one_last_wave() -> None:
    fleet = Fleet({"h3"})
    waves = fleet.waves = Waves(rollout(RolloutPolicy(1, 1, 2)), fleet.read, FakeClock())
    got = run(waves, fail_at="h3")
    assert [w.hosts for w in got] == [("h3",)]
    assert waves.said == ["canary: h3 (2 of 3 ready, min_available = 2); h1 waits: min_available = 2: 2 of 3 "
                          "hosts ready (h3 unhealthy); restarting h1 would leave 1; h2 waits: min_available = 2: "
                          "2 of 3 hosts ready (h3 unhealthy); restarting h2 would leave 1"]
    plan = waves.as_run(got[0])
    assert [w.hosts for w in plan.waves] == [("h3",), ("h1", "h2")]
    assert plan.after(got[0]) == ("h1", "h2")


def test_without_a_budget_the_waves_are_the_plans() -> None:
    p = rollout(RolloutPolicy(1, 1))
    waves = Waves(p, None)
    assert run(waves) == list(p.waves)
    assert waves.as_run() is p and waves.said == []


def spec(name: str, drain: bool) -> ServiceSpec:
    call = CallSpec(kind="host", target="true")
    return ServiceSpec(name, "[Service]\n", drain=DrainSpec(call, call) if drain else None)


def plan(*actions: tuple[Kind, str]) -> HostPlan:
    names = {s for _, s in actions}
    services = {n: ServicePlan(n, State.CHANGED, Target(spec(n, n.startswith("d")), "r" * 40)) for n in names}
    return HostPlan("h1", "r" * 40, tuple(Action(k, Reason.UNIT_CHANGED, s) for k, s in actions), services)


# the plan's actions -> the services that leave rotation and drain before the apply script
@pytest.mark.parametrize(("actions", "want"), [
    ([(Kind.RESTART, "d1")], ["d1"]),                               # a restart of a running server
    ([(Kind.STOP, "d1"), (Kind.WAIT_GPUS, "d1"), (Kind.START, "d1")], ["d1"]),   # through the GPU gate
    ([(Kind.START, "d1")], []),                                      # it was not running: nothing in flight
    ([(Kind.RESTART, "p1")], []),                                    # no drain declared
    ([(Kind.RESTART, "d1"), (Kind.RESTART, "p1"), (Kind.STOP, "d2")], ["d1", "d2"]),
])
def test_which_services_drain_before_the_stop(actions: list[tuple[Kind, str]], want: list[str]) -> None:
    assert [n for n, _ in draining(plan(*actions))] == want


def test_a_blocked_budget_ends_the_rollout_naming_the_service_and_exits_3() -> None:
    from reconciler.loop.results import FleetResult, HostResult, blocked
    from reconciler.plan.budget import next_step
    from reconciler.plan.records import Result
    from reconciler.plan.rollout import RolloutResult

    p = rollout(RolloutPolicy(1, 1, 2), ("h1", "h2"))
    ro = RolloutResult(p)
    step = next_step([Member("h1", True), Member("h2", True), Member("h3", False, "unhealthy")], ["h1", "h2"],
                     p.policy, canaries_left=1)
    hosts = {h: HostResult(h, "127.0.0.1", Result.IN_SYNC) for h in HOSTS}
    blocked(ro, step, ["h1", "h2"], hosts)
    assert (ro.status, ro.reason, ro.untouched) == ("halted", Reason.BUDGET_BLOCKED, ("h1", "h2"))
    assert ro.message == ("model: blocked: 2 of 3 ready, min_available = 2; h1 waits: min_available = 2: 2 of 3 "
                          "hosts ready (h3 unhealthy); restarting h1 would leave 1; h2 waits: min_available = 2: 2 of "
                          "3 hosts ready (h3 unhealthy); restarting h2 would leave 1")
    assert [(h.status, h.reason) for h in hosts.values()] == [
        (Result.QUARANTINED, Reason.BUDGET_BLOCKED), (Result.QUARANTINED, Reason.BUDGET_BLOCKED),
        (Result.IN_SYNC, None)]
    assert FleetResult("r" * 40, False, list(hosts.values()), [ro]).exit_code() == 3
