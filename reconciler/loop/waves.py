"""A rollout's waves as they go (issue 42): the plan's own (plan/rollout.py `plan_waves`), or,
for a group with `min_available`, the budget's next step (plan/budget.py `next_step`) asked
before each wave from what each member reads now: ready (serving), or why not. When a member
is ready: docs/drain.md (the budget: min_available); the budget counts what serves, not what the
rollout touched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING

from ..clock import REAL, Clock
from ..desired.spec import DesiredState, ServiceSpec
from ..host import programs
from ..host.health import first_miss, http_probe
from ..host.transport import Transport
from ..plan.budget import Member, Step, forecast_steps, next_step
from ..plan.drain import a_preview_may_ask
from ..plan.facts.show import UnitShow
from ..plan.rollout import RolloutPlan, RolloutResult, Wave
from ..values import replace

if TYPE_CHECKING:
    from .results import HostResult

ReadMembers = Callable[[], Awaitable[Sequence[Member]]]
# A blocked budget is read again a few times before the rollout ends: a host that just rejoined
# may not be counted by the balancer's next health check yet.
BLOCKED_READS = 4
BLOCKED_WAIT = 1.0


# GET a URL from the host behind a transport, with a CA bundle: (status, body) or (None, why)
HostGet = Callable[[Transport, str, "str | None"], Awaitable[tuple["int | None", str]]]


async def read_member(name: str, t: Transport | None, spec: ServiceSpec, *, sick: bool = False,
                      allowed: Collection[str] = (), get: HostGet = http_probe, preview: bool = False) -> Member:
    """One member of a group as it is now: ready, or why not. `get`: how a URL is read from the
    host (a test's own). `preview` (a dry run): the balancer is asked only by a call that runs
    nothing of the revision (plan/drain.a_preview_may_ask); another counts the member by its
    readiness alone."""
    from ..host import rotation  # httpx loads when a budget is read, not at start-up
    from .preflight import ready_probes
    if t is None:
        return Member(name, False, "not read (not reached in this run)")
    if sick:
        return Member(name, False, "GpuFault")
    try:
        probes, _ = ready_probes(spec, None, {})        # the engine's own readiness, as the watch reads it
        if probes:
            if (why := await first_miss(probes, lambda url: get(t, url, spec.health.ca_pem))) is not None:
                return Member(name, False, f"unhealthy ({why})")
        else:
            unit = f"{spec.name}.service"
            shown = await programs.run(t, UnitShow([unit], "Id,ActiveState"), timeout=30, what="is-active")
            state = shown.get(unit, {}).get("ActiveState") or "not loaded"
            if state != "active":
                return Member(name, False, f"down ({state})")
        if spec.drain is not None and (not preview or a_preview_may_ask(spec.drain.serving)) \
                and await rotation.serving(t, spec.drain, allowed=allowed) is False:
            return Member(name, False, "out of rotation")
    except Exception as e:      # a read that failed says "not ready", never stops the rollout
        return Member(name, False, f"not read ({type(e).__name__})")
    return Member(name, True)


def members_reader(p: RolloutPlan, state: DesiredState, transports: Mapping[str, Transport],
                   results: Mapping[str, HostResult], allowed: Collection[str], *,
                   preview: bool = False) -> ReadMembers | None:
    """How the budget reads a group's members before each wave (a dry run's: `preview`); None
    without min_available."""
    if p.policy.min_available is None:
        return None
    svc = p.group.service

    def sick(h: str) -> bool:
        r = results.get(h)
        return r is not None and r.facts is not None and r.facts.gpu_fault is not None

    async def read() -> Sequence[Member]:       # every member's read, at once
        return await asyncio.gather(*(read_member(h, transports.get(h), state.hosts[h].services[svc], sick=sick(h),
                                                  allowed=allowed, preview=preview) for h in p.members))
    return read


async def foresee(ro: RolloutResult, read: ReadMembers | None) -> None:
    """A dry run's budget: every wave as it would go from what the members read now."""
    if read is not None:
        steps = forecast_steps(await read(), ro.plan.pending, ro.plan.policy)
        ro.budget = tuple(s.describe() for s in steps)


def waits(waves: Waves, results: Mapping[str, HostResult]) -> None:
    """Say, on each waiting host's result, why it waits for the budget."""
    for w in waves.step.waits if waves.step is not None else ():
        note = f"{waves.plan.group.service}: waits: {w.why}"
        if w.host in results and note not in results[w.host].notes:
            results[w.host].notes.append(note)


class Waves:
    """The waves of one group's rollout, one at a time. Without a budget (`read` None) they are
    the plan's; with one, each is the budget's next step from a fresh read of the members."""

    def __init__(self, plan: RolloutPlan, read: ReadMembers | None, clock: Clock = REAL) -> None:
        self.plan, self.read, self.clock = plan, read, clock
        self.left = list(plan.pending)
        self.canaries = plan.policy.canary
        self.done: list[Wave] = []
        self.step: Step | None = None            # the budget's last step (what it said, who waits)
        self.said: list[str] = []                # each step's description, in order

    async def next(self) -> Wave | None:
        """The next wave (None: no host left, or the budget is blocked: `blocked`)."""
        if not self.left:
            return None
        number = len(self.done) + 1
        if self.read is None:
            return self.plan.waves[number - 1] if number <= len(self.plan.waves) else None
        for attempt in range(BLOCKED_READS):
            if attempt:
                await self.clock.sleep(BLOCKED_WAIT)
            members = await self.read()
            self.step = next_step(members, self.left, self.plan.policy, canaries_left=self.canaries)
            if not self.step.blocked:
                break
        assert self.step is not None
        self.said.append(self.step.describe())
        if not self.step.go:
            return None
        return Wave(number, self.step.go, self.step.canary)

    @property
    def blocked(self) -> bool:
        """The budget let no pending host go: the rollout cannot go on."""
        return self.step is not None and self.step.blocked and bool(self.left)

    def went(self, wave: Wave) -> None:
        """A wave ran (its hosts were restarted and judged)."""
        self.done.append(wave)
        self.left = [h for h in self.left if h not in wave.hosts]
        if wave.canary:
            self.canaries = max(0, self.canaries - len(wave.hosts))

    def as_run(self, current: Wave | None = None) -> RolloutPlan:
        """The plan with the waves as they ran (and the one running now, and the hosts left as one
        last wave): what a halt leaves untouched, what the report shows."""
        if self.read is None:
            return self.plan
        waves = [*self.done] + ([current] if current is not None and current not in self.done else [])
        rest = [h for h in self.left if current is None or h not in current.hosts]
        if rest:
            waves.append(Wave(len(waves) + 1, tuple(rest), False))
        return replace(self.plan, waves=tuple(waves))
