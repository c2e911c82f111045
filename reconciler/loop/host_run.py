"""One host: observe -> plan -> apply -> watch -> record, until the plan has nothing left to do.

Level-based: every round observes afresh and asks the pure planner (plan/: state.classify,
actions.plan_host) what to do; this module decides nothing. A health verdict is recorded on the
host at once, by itself (records.judge), and the next round's plan picks the follow-up from the
new state: the last good version substituted (a rollback), or the service held stopped. What a
step of this run answered is a fact for the next round's plan too: a model fetch that failed
(pre-flight blocks the service), a GPU gate that stayed closed (Checks.gate: the start is
recorded as blocked). A run that dies at any point leaves on the host what the next run needs to
end in the same place: the `pending` intent (watch it again, or finish it), or the verdict (roll
back, or hold).

    round 1   deploy the desired version          -> verdict: healthy (done) or failed (quarantine)
    round 2   substitute the last good, if any    -> verdict: healthy (rolled back) or failed
    round 3   hold: the service stays stopped     -> nothing left to do

A round never re-applies a version whose verdict was "failed" (the planner sees it quarantined),
so nothing flaps; MAX_ROUNDS is only a backstop.

One host failing never stops the others: every host ends with a HostResult.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import msgspec

from .. import faults
from ..desired.spec import HostSpec, ServiceSpec
from ..errors import HostError, ReconcilerError
from ..host import lock, programs
from ..host.apply import Applied, apply_plan, fetch_model, write_gpu_fault, write_record
from ..host.gpu import gpu_facts
from ..host.health import Outcome, Phase, SystemdWatch, inconclusive, watch_service
from ..host.transport import SSHTransport, Transport
from ..plan.actions import plan_host
from ..plan.facts import HostFacts, Observe
from ..plan.files import secret_files
from ..plan.gpuhealth import blames_gpu, mark_note, recorded_after, start_fault
from ..plan.model import Action, Checks, Context, HostPlan, Kind, Watch
from ..plan.records import Quarantine, Result, ServiceRecord, Verdict, judge
from ..plan.state import needs_last_good
from ..reasons import Reason
from ..values import replace
from .cutover import Cutover
from .options import Connector, RunIO, RunOptions
from .preview import engine_check
from .results import Event, HostResult, RunPhase, ServiceEvent, fold, host_failure, merge_plans, running_after
from .revision import Revision

if TYPE_CHECKING:     # pre-flight (the rule pack) and the GPU gate load when a plan starts something
    from .checks import Preflight

MAX_ROUNDS = 6


def ssh_connector(identity: str | None = None) -> Connector:
    """Connects to a host over SSH (a new connection each time: the daemon's pool keeps them)."""
    async def connect(host: HostSpec) -> Transport:
        return await SSHTransport.connect(host.name, host.ssh, identity=identity)
    return connect


def observation(host: HostSpec, *, secrets: bool = True) -> Observe:
    """The program that reads everything the planner needs from the host. `secrets=False`:
    without the keyed hashes of secret files (the one part that may write on the host: its hash
    key, made on first use), for a read-only look."""
    return Observe(tuple(host.services), tuple(secret_files(host)) if secrets else None)


async def observe(t: Transport, host: HostSpec, *, secrets: bool = True,
                  seen: programs.Seen | None = None) -> HostFacts:
    """Read everything the planner needs from the host, in one round trip (seen: as the last
    reading, where the host answered the same)."""
    return await programs.run(t, observation(host, secrets=secrets), timeout=30, what="observe", seen=seen)


async def lock_and_observe(t: Transport, host: HostSpec, wait: float,
                           look: HostFacts | None = None) -> tuple[lock.HostLock, HostFacts | None]:
    """Take the host's lock and read it under the lock, in one round trip (the holder runs the
    observation once it holds the lock). The facts are None when that reading did not come back
    whole: the caller observes again by itself (and meets the error there).

    look: facts read just before, without the lock. When no run held the lock while they were
    read and none took it since (its count has not moved), they are the facts under the lock
    too: the holder reads nothing, and they come back as they are."""
    program = observation(host)
    since = look.lock_count if look is not None else None
    held = await lock.acquire(t, wait=wait, then=program, since=since)
    if held.same:
        return held, look
    if held.answer is None:
        return held, None
    try:
        return held, program.parse(held.answer)
    except ReconcilerError:
        return held, None


class Pass(msgspec.Struct, frozen=True):
    """One pass of a fleet run over one host (fleet.py: the survey, the look under the lock, a
    halt's re-plan, the free pass, a wave's pass): what it may do and what it starts from."""

    transport: Transport                    # the host's open connection (the caller closes it)
    dry_run: bool = False                   # only plan
    hold: frozenset[str] = frozenset()      # services another pass converges (a rollout wave)
    # fleet-wide quarantines (service -> a halted rollout): they act like recorded ones and are
    # written into the host's records
    quarantine: Mapping[str, Quarantine] = msgspec.field(default_factory=dict)
    facts: HostFacts | None = None          # the host as just read (None: read it first)
    preflight: bool = True                  # False: plan without the host-side pre-flight (a first look)
    checked: Preflight | None = None        # a pre-flight already run on these `facts`


class _HostRun:
    """One host's run: the open transport, the revision, the run's options, and what the rounds found."""

    def __init__(self, host: HostSpec, rev: Revision, opts: RunOptions, io: RunIO, result: HostResult, p: Pass):
        self.host, self.rev, self.opts, self.io, self.t, self.result = host, rev, opts, io, p.transport, result
        self.revision = rev.revision
        self.run_preflight = p.preflight
        self.reuse = p.checked if p.facts is not None else None    # only with the facts it was run on
        self.retry, self.deferred = opts.retry, p.hold
        self.fleet_q = {n: q for n, q in p.quarantine.items() if n in host.services and n not in p.hold}
        self.preflight: Preflight | None = None
        self.facts: HostFacts | None = None
        self.gate: dict[str, str] = {}      # service -> why its GPUs stayed busy after this run stopped it
        self.systemd = SystemdWatch(self.t)      # every health watch on this host: one round trip per tick
        self.cutover = Cutover(self.t, clock=io.clock, allowed=opts.drain_programs)   # drain, smoke, rejoin
        self.on_phase: Phase | None = functools.partial(io.on_phase, host.name) if io.on_phase else None

    def _context(self, facts: HostFacts, pf: Preflight | None = None) -> Context:
        ctx = Context(self.revision, fleet_quarantine=self.fleet_q, deferred=self.deferred, retry=self.retry,
                      confirm_margin=self.opts.confirm_margin)
        wanted = needs_last_good(self.host, facts, ctx)
        last_good = {name: self.rev.spec_at(rev, self.host.name, name) for name, rev in wanted.items()}
        checks = pf.checks() if pf is not None else Checks()
        return replace(ctx, last_good=last_good, checks=replace(checks, gate=dict(self.gate)))

    def _plan(self, facts: HostFacts, ctx: Context) -> HostPlan:
        """plan_host, or the plan this run already made of these very facts in an equal context
        (plan_host is pure): a wave's pass, on the facts its lock found unmoved since the survey,
        plans what the survey planned (two of a changing host's four plans, each a few ms)."""
        made = self.rev.planned.setdefault(self.host.name, [])
        for host, seen, then, plan in made:
            if host is self.host and seen is facts and then == ctx:
                return plan
        plan = plan_host(self.host, facts, ctx)
        made[:] = [*made[-1:], (self.host, facts, ctx, plan)]
        return plan

    async def plan(self, facts: HostFacts, *, fetched: Mapping[str, str | None] | None = None) -> HostPlan:
        """Plan, then run the host-side pre-flight for what that plan starts, and plan again with
        its findings (blocked services, fetches, the GPU gate)."""
        plan = self._plan(facts, self._context(facts))
        self.preflight = None       # this plan's own pre-flight, if it starts anything
        if not any(a.kind in (Kind.START, Kind.RESTART, Kind.WRITE) for a in plan.actions) or not self.run_preflight:
            return plan
        if self.reuse is not None and fetched is None:
            # The survey's pre-flight, of these same facts: a pass that did not look again
            # does not check again (a wave's pass, which looks again, checks again too).
            pf, self.reuse = self.reuse, None
        else:
            from .preflight import preflight_host
            pf = await preflight_host(self.t, self.host, plan, facts, self.rev.rules(), fetched=fetched,
                                      engine=engine_check(self.opts.dry_run, self.opts.engine_check, self.rev.signer))
        self.preflight = self.result.checked = pf
        self.result.notes.extend(w for w in pf.warnings if w not in self.result.notes)
        return self._plan(facts, self._context(facts, pf))

    async def fetch(self, plan: HostPlan, facts: HostFacts) -> HostPlan:
        """Run the plan's model fetches (host/apply.fetch_model: before anything stops), then plan
        again: the fetched models are judged as they are now, and a failed fetch blocks its service."""
        fetched: dict[str, str | None] = {}
        for a in plan.actions:
            if a.kind is not Kind.FETCH or a.model is None or a.model.path in fetched:
                continue
            m = a.model
            fetched[m.path] = await fetch_model(self.t, a, clock=self.io.clock, on_phase=self.on_phase)
            self.result.notes.append(fetched[m.path] or f"fetched {m.id} into {m.path}")
        return await self.plan(facts, fetched=fetched)

    async def execute(self, plan: HostPlan, facts: HostFacts) -> bool:
        """Apply one plan and judge what it started. True when every verdict was healthy."""
        self.facts = facts
        gpu = self.preflight.gpu if self.preflight is not None else None
        gate = None
        if gpu is not None and gpu.has_nvidia_smi:
            from .gpu_gate import GpuGate
            gate = GpuGate(self.t, plan, facts, gpu, clock=self.io.clock)
        await self._record_gpu(facts)
        faults.hit("before-apply")
        try:
            applied = await apply_plan(self.t, plan, now=int(time.time()), gpu_wait=gate, drain=self.cutover.drain)
        finally:
            if gate is not None:
                self.result.notes.extend(gate.notes)
            self.result.notes.extend(n for n in self.cutover.notes if n not in self.result.notes)
        self.cutover.applied(plan)
        self.systemd.seed(applied.shown, applied.shown_at)
        faults.hit("after-apply")
        if applied.skipped:
            # GPUs stayed busy after a stop: nothing past the gate ran. A fact for the next
            # round's plan, which records each such start as blocked and starts the others.
            self.gate.update(applied.skipped)
            return False
        for why in await self.cutover.rejoin_recorded(plan):    # REJOIN: a leave a killed run left
            self.result.worsen(Result.FAILED, Reason.REJOIN_FAILED, why)
        self.result.notes.extend(n for n in self.cutover.notes if n not in self.result.notes)
        if not plan.watches:
            return True
        return all(await asyncio.gather(*(self.watch(a, plan, applied) for a in plan.watches)))

    async def watch(self, a: Action, plan: HostPlan, applied: Applied) -> bool:
        """Watch one service to a verdict and record it on the host at once."""
        w, name = a.watch, a.service
        assert w is not None and name is not None
        since = (w.since - 300) if w.since else (applied.host_clock or time.time()) - 1
        if w.reverify:
            self.result.notes.append(f"{name}: {w.revision[:7]} has no verdict yet (a run was cut short): "
                                     f"watching it again")
        faults.hit("in-rollback-watch" if w.rollback else "in-watch")
        target = plan.services[name].target
        assert target is not None
        out = await self._watched(w, name, target.spec, applied, since)
        out = await self.cutover.judge(target.spec, out)      # a healthy server's answers (smoke test)
        kind = Event.ROLLBACK if w.rollback else Event.REVERIFY if w.reverify else Event.DEPLOY
        self.result.events.append(ServiceEvent(name, kind, w.revision, w.hash, out))
        unjudged, record = await self._recorded(w, name, plan, out)
        if out.healthy and target.spec.drain is not None:
            # back into rotation; the rejoin's own times on its record, for the next forecast
            if (why := await self.cutover.rejoin(target.spec)) is not None:
                self.result.worsen(Result.FAILED, Reason.REJOIN_FAILED, f"{name}: {why}")
            else:
                await write_record(self.t, name, replace(record, steps=self.cutover.measured(name)), disarm=False)
        self.result.notes.extend(n for n in self.cutover.notes if n not in self.result.notes)
        return self._followed(name, w.revision, out, unjudged=unjudged)

    async def _recorded(self, w: Watch, name: str, plan: HostPlan, out: Outcome) -> tuple[bool, ServiceRecord]:
        """The verdict on the host's record at once (records.judge), with the step times a healthy
        start measured: whether the deploy is still unjudged (its dead-man's switch stays armed),
        and the record written."""
        f = self.facts.services.get(name) if self.facts else None
        rec = next((r for x in plan.actions if x.kind is Kind.RECORD and x.service == name
                    and (r := x.record) is not None), None) or (f.record if f is not None else None)
        judged = judge(rec or ServiceRecord(), hash=w.hash, revision=w.revision, rollback=w.rollback,
                       verdict=Verdict(out.healthy, out.reason, out.quote, out.message), now=int(time.time()),
                       fleet=self.fleet_q.get(name))
        unjudged = judged.record.pending is not None       # no verdict: the switch stays armed
        record = replace(judged.record, steps=self.cutover.measured(name) or judged.record.steps) \
            if out.healthy else judged.record              # the host's own step times: the next forecast's
        await write_record(self.t, name, record, stop=judged.stop, disarm=not unjudged or judged.stop)
        faults.hit("after-verdict")
        return unjudged, record

    async def _watched(self, w: Watch, name: str, spec: ServiceSpec, applied: Applied, since: float) -> Outcome:
        """The health watch's outcome for a WATCH step, a GPU's fault blamed where it was one."""
        failure = applied.failed(name)
        loading = functools.partial(self.io.on_progress, self.host.name) if self.io.on_progress else None
        from .preflight import ready_probes
        probes, note = ready_probes(spec, self.facts, self.preflight.versions if self.preflight is not None else {})
        if note is not None and note not in self.result.notes:
            self.result.notes.append(note)
        out = await watch_service(self.t, name, spec.health, baseline_restarts=w.baseline_restarts,
                                  since_epoch=since, on_phase=self.on_phase,
                                  baseline_invocation=w.baseline_invocation,
                                  baseline_active_enter=w.baseline_active_enter,
                                  start_error=failure.message if failure else None, cancel=self.io.supersede,
                                  systemd=self.systemd, on_progress=loading, probes=probes)
        try:
            return await self._blame_gpu(out, name, w.revision, since)
        except ReconcilerError:
            raise
        except Exception as e:        # the GPU reading raised: whose the failure was is not known
            return inconclusive(name, f"the GPU reading after {out.reason}", e, out.seconds)

    def _followed(self, name: str, revision: str, out: Outcome, *, unjudged: bool) -> bool:
        """Whether the service is done with after its recorded verdict (the notes say why not)."""
        if out.reason == Reason.GPU_FAULT:
            self.result.notes.append(f"{name}: {revision[:7]} not judged: {out.message}; nothing starts on this "
                                     f"host until its GPUs read healthy")
            return False
        if unjudged:
            self.result.notes.append(f"{name}: no verdict on {revision[:7]} ({out.reason}: {out.message}); "
                                     f"starting it again")
            return False
        if out.reason == Reason.SUPERSEDED:
            self.result.notes.append(f"{name}: {revision[:7]} superseded by a newer revision during its health "
                                     f"wait (no verdict: neither last good nor quarantined)")
            return True         # nothing to follow up here: the newer revision's run takes over
        return out.healthy

    async def _record_gpu(self, facts: HostFacts) -> None:
        """The host's GPU fault as this plan's pre-flight read it (gpuhealth.recorded_after):
        marked when the GPUs were sick, cleared when they read healthy or the mark expired."""
        reading = self.preflight.gpu.health if self.preflight is not None and self.preflight.gpu else None
        keep = recorded_after(facts.gpu_fault, reading)
        note = mark_note(facts.gpu_fault, keep, reading)
        if note is None:
            return
        await write_gpu_fault(self.t, keep)
        self.result.notes.append(note)

    async def _blame_gpu(self, out: Outcome, name: str, revision: str, since: float) -> Outcome:
        """A failed start on a GPU host: read the GPUs' health without a CUDA context (nvidia-smi
        -q, the kernel log since the start, DCGM). When a fault coincides (gpuhealth.blames_gpu),
        the host is marked GpuFault, the fault line quoted, and the outcome is no verdict on the
        version (records.judge): not quarantined, not a canary's failure."""
        gpu = self.preflight.gpu if self.preflight is not None else None
        if out.healthy or gpu is None or not gpu.has_nvidia_smi:
            return out
        reading = (await gpu_facts(self.t, health_since=int(since))).health
        if reading is None or not blames_gpu(out.reason, out.healthy, reading):
            return out
        fault = start_fault(reading, name, revision)
        await write_gpu_fault(self.t, fault)
        return replace(out, reason=Reason.GPU_FAULT, quote=fault.quote,
                       message=f"GpuFault: the start failed ({out.reason}: {out.message}) while the host's GPUs "
                               f"were sick: {fault.quote}")


async def reconcile_host(host: HostSpec, rev: Revision, opts: RunOptions, io: RunIO, p: Pass) -> HostResult:
    """Converge one host to `rev` over `p.transport` (or, `p.dry_run`, only plan it) in rounds,
    within one pass of the fleet run (`Pass`). Never raises for host failures: the result says them."""
    started = time.monotonic()
    result = HostResult(host.name, host.ssh.address)
    t = p.transport
    step = RunPhase.OBSERVE
    try:
        facts = p.facts if p.facts is not None else await observe(t, host, seen=io.seen)
        result.facts = facts
        run = _HostRun(host, rev, opts, io, result, p)
        step = RunPhase.PREFLIGHT
        plan = await run.plan(facts)
        result.plan = plan
        if not p.dry_run:
            # The door's report shows this plan before it is applied (report.PhaseView).
            if io.on_planned is not None and plan.changes:
                io.on_planned(result)
            for rnd in range(MAX_ROUNDS):
                if rnd:
                    run.retry = False     # --retry is one more try: the first round's, not every round's
                    step = RunPhase.OBSERVE
                    facts = await observe(t, host, seen=io.seen)
                    step = RunPhase.PREFLIGHT
                    plan = await run.plan(facts)
                    result.plan = merge_plans(result.plan, plan)
                if not plan.actions:
                    break
                if any(a.kind is Kind.FETCH for a in plan.actions):
                    step = RunPhase.PREFLIGHT      # a fetch says why it failed; the models are checked again
                    plan = await run.fetch(plan, facts)
                    result.plan = plan if rnd == 0 else merge_plans(result.plan, plan)
                step = RunPhase.APPLY
                if await run.execute(plan, facts):
                    break
        fold(result, plan, p.dry_run)
        result.costs.update({n: run.cutover.measured(n) for n in run.cutover.steps})
        result.lost.update(run.cutover.failed_requests)
        if not p.dry_run:
            result.running = {n: running_after(plan, facts, n) for n in host.services}
    except HostError as e:
        result.status, result.reason, result.message = Result.FAILED, host_failure(e, step), e.message
    except ReconcilerError as e:
        result.status, result.reason, result.message = Result.FAILED, Reason.FAILED, str(e)
    finally:
        result.seconds = time.monotonic() - started
    return result
