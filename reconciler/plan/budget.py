"""PURE: which hosts of a rollout group may restart next without taking the group below its
`min_available`, and why the others wait (issue 42). The rule, with an example, is in
docs/drain.md ("The budget: min_available").

No I/O, no clock. The caller reads, before each wave, which members of the group are ready now
(serving: the engine's readiness and, with a drain, in the balancer's rotation); a member it
could not read counts as not ready. The pending hosts come in wave order (plan/rollout.py
`order_hosts`: canaries first). Without min_available the waves are exactly plan/rollout.py's
`plan_waves`.

loop/waves.py asks `next_step` before each wave instead of walking the precomputed waves; the
dry run prints `forecast_steps`.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from ..desired.spec import RolloutPolicy


class Member(msgspec.Struct, frozen=True):
    """One host of the group as read before a wave: ready (serving), or why not ("down",
    "unhealthy", "GpuFault", "unreachable", "not read" ...)."""

    name: str
    ready: bool
    why: str | None = None


class Wait(msgspec.Struct, frozen=True):
    """A pending host that cannot restart now without breaking the budget, and why."""

    host: str
    why: str


class Step(msgspec.Struct, frozen=True):
    """The next wave: the hosts that restart together, and the hosts that wait for the budget."""

    go: tuple[str, ...]
    canary: bool
    waits: tuple[Wait, ...] = ()
    ready: int = 0                   # members ready before the wave
    members: int = 0
    floor: int | None = None         # min_available

    @property
    def blocked(self) -> bool:
        """No pending host can go: the rollout cannot go on within the budget."""
        return not self.go and bool(self.waits)

    def describe(self) -> str:
        """One line for the run's report or a dry run."""
        head = f"{self.ready} of {self.members} ready" + (f", min_available = {self.floor}" if self.floor else "")
        if self.blocked:
            return f"blocked: {head}; " + "; ".join(f"{w.host} waits: {w.why}" for w in self.waits)
        wave = f"{'canary' if self.canary else 'wave'}: {', '.join(self.go)}"
        return f"{wave} ({head})" + "".join(f"; {w.host} waits: {w.why}" for w in self.waits)


def next_step(members: Sequence[Member], pending: Sequence[str], policy: RolloutPolicy, *,
              canaries_left: int) -> Step:
    """The next wave of one group: `pending` are the hosts still to restart, in wave order
    (canaries first); `canaries_left` how many of the policy's canaries have not gone yet."""
    ready = {m.name for m in members if m.ready}
    floor = policy.min_available or 0
    spare = len(ready) - floor               # ready hosts that may go now (< 0: below the floor already)
    canary = canaries_left > 0
    bound = policy.bound(max(len(members), len(pending)))
    limit = min(bound, canaries_left) if canary else bound
    not_ready = tuple(m for m in members if not m.ready)
    go: list[str] = []
    waits: list[Wait] = []
    for host in pending:
        if len(go) >= limit:
            break
        if host not in ready:
            go.append(host)                  # serves nothing now: restarting it costs the budget nothing
        elif spare > 0:
            go.append(host)
            spare -= 1
        else:
            waits.append(Wait(host, _why(host, len(ready), len(members), floor, go, ready, not_ready)))
    return Step(tuple(go), canary and bool(go), tuple(waits), len(ready), len(members), policy.min_available)


def _why(host: str, ready: int, members: int, floor: int, going: list[str], ready_set: set[str],
         not_ready: tuple[Member, ...]) -> str:
    """Why a ready host waits: what is ready, what is not and why, what it would leave."""
    left = ready - sum(1 for h in going if h in ready_set) - 1
    down = ", ".join(f"{m.name} {m.why or 'not ready'}" for m in not_ready)
    also = f", {', '.join(going)} restarting in this wave" if going else ""
    return (f"min_available = {floor}: {ready} of {members} hosts ready" + (f" ({down})" if down else "")
            + f"{also}; restarting {host} would leave {left}")


def forecast_steps(members: Sequence[Member], pending: Sequence[str], policy: RolloutPolicy) -> tuple[Step, ...]:
    """Every wave of the group as a dry run foresees it: each wave's hosts come back ready, the
    other members stay as they are now. Ends with a blocked step when the budget stops it."""
    state = {m.name: m for m in members}
    left, canaries = list(pending), policy.canary
    steps: list[Step] = []
    while left:
        step = next_step(list(state.values()), left, policy, canaries_left=canaries)
        steps.append(step)
        if not step.go:
            break
        for h in step.go:
            state[h] = Member(h, True)
        left = [h for h in left if h not in step.go]
        canaries = max(0, canaries - len(step.go)) if step.canary else canaries
    return tuple(steps)
