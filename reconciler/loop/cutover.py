"""One host's cutover around a restart (issue 42): out of rotation and drained before the stop,
judged by its answers after a healthy start, back into rotation only then, and what each step
cost. The decisions are plan/drain.py's and plan/smoke.py's; the calls are host/rotation.py's
and host/smoke.py's; this module strings them around loop/host_run.py's apply and watch.

    drain    before the apply script that stops or restarts a service with a drain declared:
             record the leave on the host (layout.ROTATION_DIR/NAME.left), leave, then wait for
             its work in flight (a leave that fails ends the host's run with DrainFailed,
             before anything stopped)
    judge    after a healthy verdict: the smoke test, when one is declared; a wrong answer is
             the verdict instead (WrongAnswer), recorded, rolled back and quarantined like a
             crash loop by the next round's plan
    rejoin   after a healthy, judged verdict of a service that left rotation in this run (the
             rollback's too): back in, and until the balancer serves it, when that can be asked;
             then the record of the leave is removed
    rejoin_recorded   a plan's REJOIN steps (plan/rejoin.py): a leave recorded by a run killed
             before its rejoin, of a service that runs healthy and is not restarted now

A service leaves rotation once per run (a rollback, and a server started from stopped, rejoin as
docs/drain.md says: what a restart does). Each service's step times are kept here (`steps`)
and, on a healthy verdict, in its record on the host: the forecast's measurements.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection

from ..clock import REAL, Clock
from ..desired.spec import ServiceSpec
from ..errors import HostError
from ..host.apply import remove_state_file, write_state_file
from ..host.health import Outcome
from ..host.transport import Transport
from ..plan.drain import StepKind
from ..plan.forecast import unavailable_seconds
from ..plan.layout import ROTATION_DIR
from ..plan.model import HostPlan, Kind
from ..reasons import Reason
from ..values import replace


class DrainError(HostError):
    """A host could not leave rotation before a restart: nothing was stopped."""

    reason = Reason.DRAIN_FAILED


def draining(plan: HostPlan) -> list[tuple[str, ServiceSpec]]:
    """PURE: the services this plan stops or restarts (they run now) that declare a drain, with
    the spec whose drain they leave by (the version the plan converges to)."""
    out: list[tuple[str, ServiceSpec]] = []
    for a in plan.actions:
        if a.kind not in (Kind.STOP, Kind.RESTART) or a.service is None or any(n == a.service for n, _ in out):
            continue
        sp = plan.services.get(a.service)
        spec = sp.target.spec if sp is not None and sp.target is not None else None
        if spec is not None and spec.drain is not None:
            out.append((a.service, spec))
    return out


class Cutover:
    """The drain, smoke test and rejoin of one host's run, and the step times they measured."""

    def __init__(self, t: Transport, *, clock: Clock = REAL, allowed: Collection[str] = (),
                 rotation_dir: str = ROTATION_DIR) -> None:
        self.t, self.clock, self.allowed, self.rotation_dir = t, clock, allowed, rotation_dir
        self.left: set[str] = set()                         # out of rotation now, left in this run
        self.steps: dict[str, dict[str, float]] = {}         # service -> step -> seconds
        self.notes: list[str] = []
        self.stopping: dict[str, float] = {}                  # service -> when its stop began (clock)
        self.failed_requests: dict[str, float] = {}           # service -> in flight when the drain gave up

    async def drain(self, plan: HostPlan) -> None:
        """apply_plan's drain hook: leave and drain every service the plan is about to stop."""
        from ..host import rotation  # httpx (and what it imports) loads when a drain runs
        for name, spec in draining(plan):
            if name in self.left:
                continue
            d = spec.drain
            assert d is not None
            # recorded before the leave: a run killed from here on leaves the record for the next
            left = json.dumps({"revision": plan.revision, "at": int(time.time())}) + "\n"
            await write_state_file(self.t, self.marker(name), left, what=f"record the leave of {name}")
            out = await rotation.leave_and_drain(self.t, d, clock=self.clock, allowed=self.allowed)
            steps = self.steps.setdefault(name, {})
            steps[StepKind.LEAVE] = out.leave_seconds
            if not out.left:
                raise DrainError(self.t.host, f"{name}: {out.message}; nothing was stopped")
            self.left.add(name)
            steps[StepKind.DRAIN] = out.drain_seconds
            if out.inflight:
                self.failed_requests[name] = out.inflight
            self.notes.append(f"{name}: left rotation; {out.message}")
        for name, _ in draining(plan):
            self.stopping[name] = self.clock.now()

    def applied(self, plan: HostPlan) -> None:
        """The apply script ran: its stop and start, measured from the end of the drain."""
        now = self.clock.now()
        for name in {a.service for a in plan.actions if a.kind in (Kind.STOP, Kind.RESTART, Kind.START) and a.service}:
            began = self.stopping.pop(name, None)
            if began is not None:
                # one script stops and starts (the GPU gate between its parts): the whole of it is
                # `stop`; `start` and `wait-gpus` are inside it, measured as 0 on their own
                steps = self.steps.setdefault(name, {})
                steps[StepKind.STOP], steps[StepKind.START] = now - began, 0.0
                if any(a.kind is Kind.WAIT_GPUS and a.service == name for a in plan.actions):
                    steps[StepKind.WAIT_GPUS] = 0.0

    async def judge(self, spec: ServiceSpec, out: Outcome) -> Outcome:
        """After the health verdict: a healthy server answers the smoke test, else its verdict
        is the smoke test's (WrongAnswer, SlowAnswer, SmokeFailed)."""
        if out.healthy:
            self.steps.setdefault(spec.name, {})[StepKind.READY] = out.seconds
        if not out.healthy or spec.smoke is None:
            return out
        from ..host.smoke import ask
        verdict, seconds = await ask(self.t, spec.smoke, clock=self.clock)
        self.steps.setdefault(spec.name, {})[StepKind.SMOKE] = seconds
        if verdict.healthy:
            return replace(out, message=f"{out.message}; smoke test: {verdict.message}")
        assert verdict.reason is not None
        return replace(out, healthy=False, reason=verdict.reason, message=verdict.message, quote=verdict.quote)

    async def rejoin(self, spec: ServiceSpec, *, restarted: bool = True) -> str | None:
        """After a healthy, judged verdict: back into rotation (whether it left in this run or
        was out already: a new server that is judged serves), and until the balancer serves it
        when that can be asked; then its leave's record is removed. None when it is back (or
        has no drain); else why not. `restarted=False`: a REJOIN step, no restart to measure."""
        d = spec.drain
        if d is None:
            return None
        from ..host import rotation
        back = await rotation.rejoin(self.t, d, clock=self.clock, allowed=self.allowed)
        if restarted:       # a restart's cost (the forecast's measurements); a REJOIN step has none
            steps = self.steps.setdefault(spec.name, {})
            steps[StepKind.REJOIN] = back.rejoin_seconds
            if d.serving is not None:
                steps[StepKind.SERVING] = back.serving_seconds
        if not back.ok:
            return back.message
        await remove_state_file(self.t, self.marker(spec.name), what=f"remove the leave of {spec.name}")
        self.left.discard(spec.name)
        self.notes.append(f"{spec.name}: {back.message}; unavailable {unavailable_seconds(steps):.1f}s" if restarted
                          else f"{spec.name}: {back.message} (left by a run that did not finish; not restarted)")
        return None

    async def rejoin_recorded(self, plan: HostPlan) -> list[str]:
        """The plan's REJOIN steps: each service back into rotation (its leave's record removed),
        without a restart. Why each that could not rejoin did not (it stays out, recorded)."""
        failed: list[str] = []
        for a in plan.actions:
            sp = plan.services.get(a.service or "")
            if a.kind is not Kind.REJOIN or sp is None or sp.target is None:
                continue
            if (why := await self.rejoin(sp.target.spec, restarted=False)) is not None:
                failed.append(f"{sp.name}: {why}; still out of rotation (its leave stays recorded)")
        return failed

    def marker(self, name: str) -> str:
        """Where the service's leave of rotation is recorded on the host."""
        return f"{self.rotation_dir}/{name}.left"

    def measured(self, name: str) -> dict[str, float]:
        """The step times of the service's restart in this run (for its record)."""
        return {str(k): round(v, 3) for k, v in self.steps.get(name, {}).items()}
