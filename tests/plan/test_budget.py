"""plan/budget.py: the waves of a rollout group under min_available (tables), the hosts that
wait and why, and, without a budget, exactly the waves plan/rollout.py makes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.desired.spec import RolloutPolicy
from reconciler.plan.budget import Member, Step, Wait, forecast_steps, next_step
from reconciler.plan.rollout import order_hosts, plan_waves


def group(names: str, down: str = "", why: str = "down") -> list[Member]:
    """Members "h1 h2 h3"; those in `down` are not ready."""
    gone = set(down.split())
    return [Member(n, n not in gone, why if n in gone else None) for n in names.split()]


def waves(steps: tuple[Step, ...]) -> list[tuple[str, ...]]:
    return [s.go for s in steps]


# members, down, pending (wave order), policy -> the waves, and whether the last step is blocked
@pytest.mark.parametrize(("members", "down", "pending", "policy", "want", "blocked"), [
    # three hosts serving one model, min_available 2: one at a time, canary first
    ("h1 h2 h3", "", "h1 h2 h3", RolloutPolicy(1, 2, 2), [("h1",), ("h2",), ("h3",)], False),
    # max_unavailable would allow two at once; the budget allows one
    ("h1 h2 h3 h4", "", "h1 h2 h3 h4", RolloutPolicy(0, 2, 3), [("h1",), ("h2",), ("h3",), ("h4",)], False),
    # four hosts, min 2, two at once after the canary
    ("h1 h2 h3 h4", "", "h1 h2 h3 h4", RolloutPolicy(1, 2, 2), [("h1",), ("h2", "h3"), ("h4",)], False),
    # one host already down (and pending): it goes first, as the canary, costing nothing
    ("h1 h2 h3", "h3", "h1 h2 h3", RolloutPolicy(1, 1, 2), [("h3",), ("h1",), ("h2",)], False),
    # the down host does not wait behind the wave bound's other ready hosts: it fills the wave
    ("h1 h2 h3 h4", "h4", "h1 h2 h3 h4", RolloutPolicy(0, 2, 3), [("h4",), ("h1",), ("h2",), ("h3",)], False),
    # one host down and not pending (its own fault, no change for it): the others can never go
    ("h1 h2 h3", "h1", "h2 h3", RolloutPolicy(1, 1, 2), [()], True),
    # already below the floor: only the down pending host may restart, then the rest is blocked
    ("h1 h2 h3 h4", "h1 h4", "h2 h3 h4", RolloutPolicy(0, 1, 3), [("h4",), ()], True),
    # no budget: the plain waves
    ("h1 h2 h3 h4 h5 h6", "h2", "h1 h2 h3 h4 h5 h6", RolloutPolicy(1, 2),
     [("h1",), ("h2", "h3"), ("h4", "h5"), ("h6",)], False),
    # two canaries, bound 1, floor 2 of 4
    ("h1 h2 h3 h4", "", "h1 h2 h3 h4", RolloutPolicy(2, 1, 2), [("h1",), ("h2",), ("h3",), ("h4",)], False),
])
def test_waves_under_the_budget(members: str, down: str, pending: str, policy: RolloutPolicy,
                                want: list[tuple[str, ...]], blocked: bool) -> None:
    steps = forecast_steps(group(members, down), pending.split(), policy)
    assert waves(steps) == want
    assert steps[-1].blocked is blocked


def test_the_canary_label_waits_and_says_why_while_a_down_host_goes_first() -> None:
    members = group("gpu-1 gpu-2 gpu-3", down="gpu-3", why="unhealthy")
    pending = order_hosts(["gpu-1", "gpu-2", "gpu-3"], {"gpu-1": {"canary": "true"}})
    step = next_step(members, pending, RolloutPolicy(1, 1, 2), canaries_left=1)
    assert step == Step(go=("gpu-3",), canary=True, waits=(
        Wait("gpu-1", "min_available = 2: 2 of 3 hosts ready (gpu-3 unhealthy); restarting gpu-1 would leave 1"),
        Wait("gpu-2", "min_available = 2: 2 of 3 hosts ready (gpu-3 unhealthy); restarting gpu-2 would leave 1"),
    ), ready=2, members=3, floor=2)
    assert step.describe() == (
        "canary: gpu-3 (2 of 3 ready, min_available = 2); gpu-1 waits: min_available = 2: 2 of 3 hosts ready "
        "(gpu-3 unhealthy); restarting gpu-1 would leave 1; gpu-2 waits: min_available = 2: 2 of 3 hosts ready "
        "(gpu-3 unhealthy); restarting gpu-2 would leave 1")


def test_a_blocked_group_names_every_waiting_host_and_the_hosts_that_are_down() -> None:
    step = next_step(group("a b c", down="a", why="GpuFault"), ["b", "c"], RolloutPolicy(0, 1, 2), canaries_left=0)
    assert step.blocked and step.go == ()
    assert step.describe() == (
        "blocked: 2 of 3 ready, min_available = 2; b waits: min_available = 2: 2 of 3 hosts ready (a GpuFault); "
        "restarting b would leave 1; c waits: min_available = 2: 2 of 3 hosts ready (a GpuFault); restarting c "
        "would leave 1")


def test_a_wave_that_already_takes_a_host_says_so_in_the_wait() -> None:
    step = next_step(group("a b c d"), ["a", "b", "c"], RolloutPolicy(0, 3, 3), canaries_left=0)
    assert step.go == ("a",)
    assert step.waits[0] == Wait("b", "min_available = 3: 4 of 4 hosts ready, a restarting in this wave; "
                                      "restarting b would leave 2")


def test_a_member_not_read_counts_as_not_ready() -> None:
    members = [Member("a", True), Member("b", False, "not read"), Member("c", True)]
    step = next_step(members, ["a", "c"], RolloutPolicy(0, 1, 2), canaries_left=0)
    assert step.blocked and "(b not read)" in step.waits[0].why


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 9), pending=st.sets(st.integers(1, 9), min_size=2), canary=st.integers(0, 4),
       bound=st.one_of(st.integers(1, 5), st.sampled_from(["25%", "50%", "100%"])),
       down=st.sets(st.integers(1, 9)), labelled=st.sets(st.integers(1, 9)))
def test_without_a_budget_the_waves_are_plan_waves(n: int, pending: set[int], canary: int, bound: int | str,
                                                  down: set[int], labelled: set[int]) -> None:
    names = [f"h{i}" for i in range(1, n + 1)]
    todo = [f"h{i}" for i in sorted(pending) if i <= n]
    if len(todo) < 2:
        return
    labels = {f"h{i}": {"canary": "true"} for i in labelled}
    policy = RolloutPolicy(canary, bound)
    members = [Member(h, int(h[1:]) not in down) for h in names]
    steps = forecast_steps(members, order_hosts(todo, labels), policy)
    assert [(s.go, s.canary) for s in steps] == [(w.hosts, w.canary) for w in plan_waves(todo, labels, policy, n)]


@settings(max_examples=300, deadline=None)
@given(n=st.integers(2, 9), floor=st.integers(1, 8), canary=st.integers(0, 3), bound=st.integers(1, 4),
       down=st.sets(st.integers(1, 9)), pending=st.sets(st.integers(1, 9), min_size=1))
def test_the_budget_never_takes_the_group_below_its_floor(n: int, floor: int, canary: int, bound: int,
                                                          down: set[int], pending: set[int]) -> None:
    names = [f"h{i}" for i in range(1, n + 1)]
    state = {h: int(h[1:]) not in down for h in names}
    todo = [h for h in names if int(h[1:]) in pending]
    policy = RolloutPolicy(canary, bound, floor)
    for step in forecast_steps([Member(h, r) for h, r in state.items()], todo, policy):
        ready_before = sum(state.values())
        taken = sum(1 for h in step.go if state[h])
        assert len(step.go) <= bound
        assert taken == 0 or ready_before - taken >= floor       # ready hosts go only within the budget
        assert not step.blocked or all(state[w.host] for w in step.waits)
        for h in step.go:
            state[h] = True                                      # back, ready, before the next wave
