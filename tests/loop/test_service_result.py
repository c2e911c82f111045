"""`reconcile.service_result`: what one service's run comes to, from its final state and the
verdicts of this run (pure), as a table."""

from __future__ import annotations

import pytest

from reconciler.errors import CommandError, ConnectError, HostError, ObserveError
from reconciler.host.health import Outcome
from reconciler.host.lock import LockedError
from reconciler.loop.results import Event, RunPhase, ServiceEvent, host_failure, service_result
from reconciler.plan.model import ServicePlan, State
from reconciler.plan.records import Result
from reconciler.reasons import Reason

REV = "a" * 40


def ev(action: Event, reason: str, healthy: bool = False, message: str = "m") -> ServiceEvent:
    return ServiceEvent("m", action, REV, "h", Outcome("m", healthy, reason, message))


PENDING = ServicePlan("m", State.PENDING, result=Result.CONVERGED)
CHANGED = ServicePlan("m", State.CHANGED, result=Result.CONVERGED)   # the plan a run executed last
HELD = ServicePlan("m", State.INCONCLUSIVE, result=Result.FAILED, reason="Inconclusive", note="no verdict ...")
NO_GOOD = ServicePlan("m", State.QUARANTINED_NO_GOOD, result=Result.FAILED, note="desired q; first deploy failed",
                      first_deploy=True)
# the same state whose last good cannot be rendered: no first deploy (the words say nothing to the result)
NO_RENDER = ServicePlan("m", State.QUARANTINED_NO_GOOD, result=Result.FAILED,
                        note="desired q; first deploy failed (the words of a note decide nothing)")
GPU_BLOCKED = ServicePlan("m", State.BLOCKED, result=Result.FAILED, reason="GpuFault", note="not started: ...")


@pytest.mark.parametrize("sp,events,want", [
    (CHANGED, [ev(Event.DEPLOY, "Healthy", True)], (Result.CONVERGED, None)),
    # no verdict, then started again and healthy: converged, not a failure
    (CHANGED, [ev(Event.DEPLOY, "Inconclusive"), ev(Event.DEPLOY, "Healthy", True)], (Result.CONVERGED, None)),
    (CHANGED, [ev(Event.DEPLOY, "StartLimitHit"), ev(Event.REVERIFY, "Healthy", True)], (Result.CONVERGED, None)),
    # the rounds ran out on a watch without a verdict: failed, never "converged"
    (PENDING, [ev(Event.DEPLOY, "Inconclusive"), ev(Event.DEPLOY, "Inconclusive")],
     (Result.FAILED, "Inconclusive")),
    # ... or the planner holds it after MAX_UNJUDGED of them: its own reason and note
    (HELD, [ev(Event.DEPLOY, "Inconclusive")] * 3, (Result.FAILED, "Inconclusive")),
    # a real failure after a watch without a verdict is still that failure, and the rollback counts
    (CHANGED, [ev(Event.DEPLOY, "Inconclusive"), ev(Event.DEPLOY, "CrashLoop"),
               ev(Event.ROLLBACK, "Healthy", True)], (Result.ROLLED_BACK, "RolledBack")),
    (CHANGED, [ev(Event.DEPLOY, "CrashLoop"), ev(Event.ROLLBACK, "Inconclusive"),
               ev(Event.ROLLBACK, "Healthy", True)], (Result.ROLLED_BACK, "RolledBack")),
    (NO_GOOD, [ev(Event.DEPLOY, "CrashLoop")], (Result.FAILED, "FirstDeployFailed")),
    (NO_RENDER, [ev(Event.DEPLOY, "CrashLoop")], (Result.FAILED, "RollbackFailed")),
    # a start that failed with the host's GPUs sick: the host's failure, never a rollback's or the
    # version's ("RollbackFailed", "FirstDeployFailed"), whether the next round was blocked or not
    (GPU_BLOCKED, [ev(Event.DEPLOY, "GpuFault")], (Result.FAILED, "GpuFault")),
    (PENDING, [ev(Event.DEPLOY, "GpuFault")], (Result.FAILED, "GpuFault")),
    (NO_GOOD, [ev(Event.DEPLOY, "GpuFault")], (Result.FAILED, "GpuFault")),
    (GPU_BLOCKED, [], (Result.FAILED, "GpuFault")),           # blocked before any start
    # a newer revision ended the wait: no verdict, and nothing failed
    (CHANGED, [ev(Event.DEPLOY, "Superseded")], (Result.CONVERGED, None)),
])
def test_service_result(sp: ServicePlan, events: list[ServiceEvent], want: tuple[Result, str | None]) -> None:
    result, reason, _message = service_result(sp, events, dry_run=False, changes=True)
    assert (result, reason) == want


def test_a_rollout_says_which_hosts_it_did_not_count_for_their_gpus() -> None:
    from rich.console import Console

    from reconciler.desired.spec import RolloutPolicy
    from reconciler.loop.report import print_rollouts
    from reconciler.loop.results import FleetResult
    from reconciler.plan.rollout import GroupKey, RolloutPlan, RolloutResult, plan_waves
    policy = RolloutPolicy(canary=1, max_unavailable=1)
    waves = plan_waves(["gpu-1", "gpu-2"], {}, policy, 2)
    ro = RolloutResult(RolloutPlan(GroupKey("m", "qwen"), policy, ("gpu-1", "gpu-2"), ("gpu-1", "gpu-2"), 1, waves),
                       status="done", waves_done=2, excused=("gpu-1",))
    console = Console(record=True, width=200)
    print_rollouts(console, FleetResult(REV, False, [], [ro]))
    text = console.export_text()
    assert "done: 2 hosts in 2 waves" in text
    assert "not counted against it (GpuFault: the host's GPUs, not the change): gpu-1" in text


def test_a_rollout_halted_by_a_gpu_fault_says_why_it_counted() -> None:
    from rich.console import Console

    from reconciler.desired.spec import RolloutPolicy
    from reconciler.loop.report import print_rollouts
    from reconciler.loop.results import FleetResult
    from reconciler.plan.rollout import GroupKey, RolloutPlan, RolloutResult, plan_waves
    policy = RolloutPolicy(canary=1, max_unavailable=1)
    waves = plan_waves(["gpu-1", "gpu-2"], {}, policy, 2)
    plan = RolloutPlan(GroupKey("m", "qwen"), policy, ("gpu-1", "gpu-2"), ("gpu-1", "gpu-2"), 1, waves)
    why = "the canary's start failed while its GPUs were sick (ECC): a revision can provoke a GPU fault, ..."
    for reason, message, shown in (("GpuFault", why, True), ("CrashLoop", "exited 3 times", False)):
        ro = RolloutResult(plan, status="halted", waves_done=1, halted_at="gpu-1", halted_wave=1, reason=reason,
                           message=message, quote="ECC", untouched=("gpu-2",))
        console = Console(record=True, width=200)
        print_rollouts(console, FleetResult(REV, False, [], [ro]))
        text = console.export_text()
        assert f"halted at gpu-1 (wave 1, canary): {reason}\n    journal: ECC\n" in text
        assert (f"    journal: ECC\n    {why}\n" in text) is shown and "exited 3 times" not in text


COMMAND = CommandError("h1", "anything at all", 1, "boom")     # what it ran says nothing of the reason


@pytest.mark.parametrize("error, step, want", [
    # a command that only read the host keeps its own reason
    (COMMAND, RunPhase.OBSERVE, Reason.COMMAND_FAILED),
    (COMMAND, RunPhase.PREFLIGHT, Reason.COMMAND_FAILED),
    # one that failed while the run changed the host (or locked it) is the apply's
    (COMMAND, RunPhase.APPLY, Reason.APPLY_FAILED),
    # every other host error keeps its own, wherever it happened
    (ObserveError("h1", "garbled"), RunPhase.APPLY, Reason.OBSERVE_FAILED),
    (ConnectError("h1", "dropped"), RunPhase.APPLY, Reason.UNREACHABLE),
    (LockedError("h1", "held by another run"), RunPhase.OBSERVE, Reason.LOCKED),
    (HostError("h1", "?"), RunPhase.APPLY, Reason.HOST_FAILED),
])
def test_a_host_errors_reason(error: HostError, step: RunPhase, want: Reason) -> None:
    assert host_failure(error, step) is want


@pytest.mark.parametrize("text, want", [
    ("CrashLoop", Reason.CRASH_LOOP), ("RolloutHalted", Reason.ROLLOUT_HALTED), ("NotConfirmed", Reason.NOT_CONFIRMED),
    ("SomethingNewer", Reason.FAILED), ("", Reason.FAILED), (None, Reason.FAILED), (3, Reason.FAILED),
])
def test_a_recorded_reason_reads_as_its_member_or_failed(text: object, want: Reason) -> None:
    assert Reason.read(text) is want
    assert want == str(want) and f"{want}" == want.value       # it is its string, in JSON and f-strings alike
