"""One host: observe -> plan -> apply -> watch -> record, until the plan has nothing left to do.

Level-based: every round observes afresh and asks the pure planner (plan.py) what to do; this
module decides nothing about failures. A health verdict is recorded on the host at once, by
itself (records.judge), and the next round's plan picks the follow-up from the new state: the
last good version substituted (a rollback), or the service held stopped. A run that dies at any
point leaves on the host what the next run needs to end in the same place: the `pending` intent
(watch it again, or finish it), or the verdict (roll back, or hold).

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
from dataclasses import replace
from typing import TYPE_CHECKING

from .. import faults
from ..desired.spec import HostSpec, ServiceSpec
from ..errors import HostError, ReconcilerError
from ..host import lock
from ..host.apply import Applied, apply_plan, write_gpu_fault, write_record
from ..host.gpu import gpu_facts
from ..host.health import Outcome, Phase, SystemdWatch, inconclusive, watch_service
from ..host.transport import SSHTransport, Transport
from ..plan.actions import plan_host
from ..plan.facts import HostFacts, observe_command, parse_observation
from ..plan.files import secret_files
from ..plan.gpuhealth import GPU_FAULT, blames_gpu, mark_note, recorded_after, start_fault
from ..plan.model import Action, Context, HostPlan, Kind
from ..plan.records import SUPERSEDED, Pending, Quarantine, Result, ServiceRecord, Verdict, judge
from ..plan.state import needs_last_good
from ..reasons import Reason
from ..shell import ShCommand
from .options import Connector, RunIO, RunOptions
from .preview import engine_check
from .results import Event, HostResult, ServiceEvent, Step, fold, host_failure, merge_plans, running_after
from .revision import Revision

if TYPE_CHECKING:     # checks.py (pre-flight, the rule pack, the GPU gate) loads when a plan starts something
    from .checks import Preflight

MAX_ROUNDS = 6


def ssh_connector(identity: str | None = None, connect_timeout: float = 10.0) -> Connector:
    """Connects to a host over SSH (a new connection each time: the daemon's pool keeps them)."""
    async def connect(host: HostSpec) -> Transport:
        return await SSHTransport.connect(host.name, host.ssh, identity=identity, connect_timeout=connect_timeout)
    return connect


def observation(host: HostSpec, *, secrets: bool = True) -> tuple[ShCommand, str]:
    """The command that reads everything the planner needs from the host, and its token.
    `secrets=False`: without the keyed hashes of secret files (the one part that may write on
    the host: its hash key, made on first use), for a read-only look."""
    return observe_command(list(host.services), secret_files=secret_files(host) if secrets else None)


async def observe(t: Transport, host: HostSpec, *, secrets: bool = True) -> HostFacts:
    """Read everything the planner needs from the host, in one round trip."""
    cmd, token = observation(host, secrets=secrets)
    res = await t.run(cmd, check=True, timeout=30, what="observe")
    return parse_observation(res.stdout, token, host.name)


async def lock_and_observe(t: Transport, host: HostSpec, wait: float,
                           look: HostFacts | None = None) -> tuple[lock.HostLock, HostFacts | None]:
    """Take the host's lock and read it under the lock, in one round trip (the holder runs the
    observation once it holds the lock). The facts are None when that reading did not come back
    whole: the caller observes again by itself (and meets the error there).

    look: facts read just before, without the lock. When no run held the lock while they were
    read and none took it since (its count has not moved), they are the facts under the lock
    too: the holder reads nothing, and they come back as they are."""
    cmd, token = observation(host)
    since = look.lock_count if look is not None else None
    held = await lock.acquire(t, wait=wait, then=(cmd, f"{token} END"), since=since)
    if held.same:
        return held, look
    if held.output is None:
        return held, None
    try:
        return held, parse_observation(held.output, token, host.name)
    except ReconcilerError:
        return held, None


# ---- results ------------------------------------------------------------------------------------

# ---- one host -----------------------------------------------------------------------------------


class _HostRun:
    """One host's run: the open transport, the revision, the run's options, and what the rounds found."""

    def __init__(self, host: HostSpec, rev: Revision, opts: RunOptions, io: RunIO, t: Transport,
                 result: HostResult, *, deferred: frozenset[str], fleet_quarantine: Mapping[str, Quarantine],
                 check: bool = True, reuse: Preflight | None = None):
        self.host, self.rev, self.opts, self.io, self.t, self.result = host, rev, opts, io, t, result
        self.revision = rev.revision
        self.check, self.reuse = check, reuse
        self.retry, self.deferred = opts.retry, deferred
        self.fleet_q = {n: q for n, q in fleet_quarantine.items() if n in host.services and n not in deferred}
        self.preflight: Preflight | None = None
        self.facts: HostFacts | None = None
        self.systemd = SystemdWatch(t)      # every health watch on this host: one round trip per tick

    def _context(self, facts: HostFacts, pf: Preflight | None = None) -> Context:
        ctx = Context(self.revision, fleet_quarantine=self.fleet_q, deferred=self.deferred, retry=self.retry,
                      confirm_margin=self.opts.confirm_margin)
        wanted = needs_last_good(self.host, facts, ctx)
        last_good: dict[str, ServiceSpec | None] = {}
        for name, rev in wanted.items():
            state = self.rev.render_at(rev) if self.rev.render_at is not None else None
            h = state.hosts.get(self.host.name) if state is not None else None
            last_good[name] = h.services.get(name) if h is not None else None
        return replace(ctx, last_good=last_good, checks=pf.checks() if pf is not None else ctx.checks)

    async def plan(self, facts: HostFacts, *, fetched: Mapping[str, str | None] | None = None) -> HostPlan:
        """Plan, then run the host-side pre-flight for what that plan starts, and plan again with
        its findings (blocked services, fetches, the GPU gate)."""
        plan = plan_host(self.host, facts, self._context(facts))
        self.preflight = None       # this plan's own pre-flight, if it starts anything
        if not any(a.kind in (Kind.START, Kind.RESTART, Kind.WRITE) for a in plan.actions) or not self.check:
            return plan
        if self.reuse is not None and fetched is None:
            # The survey's pre-flight, of these same facts: a pass that did not look again
            # does not check again (a wave's pass, which looks again, checks again too).
            pf, self.reuse = self.reuse, None
        else:
            from .checks import preflight_host
            rules = self.rev.rules() if self.rev.rules is not None else None
            engine = engine_check(self.opts.dry_run, self.opts.engine_check, self.rev.signer)
            pf = await preflight_host(self.t, self.host, plan, facts, rules, fetched=fetched, engine=engine)
        self.preflight = self.result.checked = pf
        self.result.notes.extend(w for w in pf.warnings if w not in self.result.notes)
        return plan_host(self.host, facts, self._context(facts, pf))

    def _progress(self) -> Phase:
        def cb(service: str, phase: str, elapsed: float, timeout: float) -> None:
            if self.io.on_phase:
                self.io.on_phase(self.host.name, service, phase, elapsed, timeout)
        return cb

    async def fetch(self, plan: HostPlan, facts: HostFacts) -> HostPlan:
        """Run the plan's model fetches (before anything stops), then plan again: the fetched
        models are judged as they are now, and a failed fetch blocks its service."""
        fetched: dict[str, str | None] = {}
        for a in plan.actions:
            sp = plan.services.get(a.service or "")
            if a.kind is not Kind.FETCH or sp is None or sp.target is None or sp.target.spec.model is None:
                continue
            m = sp.target.spec.model
            if m.path in fetched:
                continue
            models = self.preflight.models if self.preflight else {}
            from .fetch import fetch_model
            fetched[m.path] = await fetch_model(self.t, sp.name, m, models.get(m.path), self._progress())
            self.result.notes.append(fetched[m.path] or f"fetched {m.id} into {m.path}")
        return await self.plan(facts, fetched=fetched)

    async def execute(self, plan: HostPlan, facts: HostFacts) -> bool:
        """Apply one plan and judge what it started. True when every verdict was healthy."""
        self.facts = facts
        gpu = self.preflight.gpu if self.preflight is not None else None
        from .checks import gpu_waiter
        waiter = gpu_waiter(self.t, plan, facts, gpu, self.result.notes) if gpu is not None and gpu.has_nvidia_smi \
            else None
        await self._record_gpu(facts)
        faults.hit("before-apply")
        applied = await apply_plan(self.t, plan, now=int(time.time()), gpu_wait=waiter)
        self.systemd.seed(applied.shown, applied.shown_at)
        faults.hit("after-apply")
        for name, why in sorted(applied.skipped.items()):
            sp = plan.services[name]
            self.result.events.append(ServiceEvent(name, Event.BLOCKED, plan.revision,
                                                   sp.target.hash if sp.target else "", note=why))
            self.result.worsen(Result.FAILED, Reason.GPU_BUSY, f"{name}: {why}")
            await self._record_gate_block(plan, name, why)
        watches = [a for a in plan.watches if a.service not in applied.skipped]
        if not watches:
            return True
        verdicts = await asyncio.gather(*(self.watch(a, plan, applied) for a in watches))
        return all(verdicts)

    async def watch(self, a: Action, plan: HostPlan, applied: Applied) -> bool:
        """Watch one service to a verdict and record it on the host at once."""
        w, name = a.watch, a.service
        assert w is not None and name is not None
        sp = plan.services[name]
        assert sp.target is not None
        failure = applied.failed(name)
        since = (w.since - 300) if w.since else (applied.host_clock or time.time()) - 1
        if w.reverify:
            self.result.notes.append(f"{name}: {w.revision[:7]} has no verdict yet (a run was cut short): "
                                     f"watching it again")
        faults.hit("in-rollback-watch" if w.rollback else "in-watch")
        loading = functools.partial(self.io.on_progress, self.host.name) if self.io.on_progress else None
        out = await watch_service(self.t, name, sp.target.spec.health, baseline_restarts=w.baseline_restarts,
                                  since_epoch=since, on_phase=self._progress(),
                                  baseline_invocation=w.baseline_invocation,
                                  baseline_active_enter=w.baseline_active_enter,
                                  start_error=failure.message if failure else None, cancel=self.io.supersede,
                                  systemd=self.systemd, on_progress=loading)
        try:
            out = await self._blame_gpu(out, name, w.revision, since)
        except ReconcilerError:
            raise
        except Exception as e:        # the GPU reading raised: whose the failure was is not known
            out = inconclusive(name, f"the GPU reading after {out.reason}", e, out.seconds)
        kind = Event.ROLLBACK if w.rollback else Event.REVERIFY if w.reverify else Event.DEPLOY
        self.result.events.append(ServiceEvent(name, kind, w.revision, w.hash, out))
        rec = next((r for x in plan.actions if x.kind is Kind.RECORD and x.service == name
                    and (r := x.record) is not None), None)
        base = rec or self._record(name)
        judged = judge(base, hash=w.hash, revision=w.revision, rollback=w.rollback,
                       verdict=Verdict(out.healthy, out.reason, out.quote, out.message), now=int(time.time()),
                       fleet=self.fleet_q.get(name))
        unjudged = judged.record.pending is not None       # no verdict: the switch stays armed
        await write_record(self.t, name, judged.record, stop=judged.stop, disarm=not unjudged or judged.stop)
        faults.hit("after-verdict")
        if out.reason == GPU_FAULT:
            self.result.notes.append(f"{name}: {w.revision[:7]} not judged: {out.message}; nothing starts on this "
                                     f"host until its GPUs read healthy")
            return False
        if unjudged:
            self.result.notes.append(f"{name}: no verdict on {w.revision[:7]} ({out.reason}: {out.message}); "
                                     f"starting it again")
            return False
        if out.reason == SUPERSEDED:
            self.result.notes.append(f"{name}: {w.revision[:7]} superseded by a newer revision during its health "
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
        return replace(out, reason=GPU_FAULT, quote=fault.quote,
                       message=f"GpuFault: the start failed ({out.reason}: {out.message}) while the host's GPUs "
                               f"were sick: {fault.quote}")

    async def _record_gate_block(self, plan: HostPlan, name: str, why: str) -> None:
        """The GPUs stayed busy, so the start did not happen: the record says so (pending, not
        started), and the next run gates the start again."""
        sp = plan.services[name]
        intent = next((a.record for a in plan.actions if a.kind is Kind.INTENT and a.service == name), None)
        rec = intent or self._record(name)
        if sp.target is None:
            return
        pending = rec.pending or Pending(hash=sp.target.hash, revision=sp.target.revision,
                                         rollback=sp.target.rollback, replaces_hash=rec.hash,
                                         replaces_revision=rec.revision, at=int(time.time()))
        await write_record(self.t, name, replace(rec, pending=replace(pending, started=False, blocked=why)))

    def _record(self, name: str) -> ServiceRecord:
        f = self.facts.services.get(name) if self.facts else None
        return (f.record if f is not None else None) or ServiceRecord()


async def reconcile_host(host: HostSpec, rev: Revision, opts: RunOptions, io: RunIO = RunIO(), *,
                         dry_run: bool | None = None, hold: frozenset[str] = frozenset(),
                         quarantine: Mapping[str, Quarantine] | None = None, transport: Transport | None = None,
                         facts: HostFacts | None = None, check: bool = True,
                         checked: Preflight | None = None) -> HostResult:
    """Converge one host to `rev` (or, dry run, only plan it). Never raises for host failures.

    `dry_run`: this pass only plans (default: the run's own `opts.dry_run`). For the fleet's
    passes: `hold` names services another pass converges (a rollout wave); `quarantine` adds
    fleet-wide quarantines (service -> a halted rollout) that act like recorded ones and are
    written into the host's records; `transport` reuses an open connection (the caller closes
    it); `facts` skips the first observation. `check=False` plans without the host-side
    pre-flight (a first look that only decides whether the host needs its lock); `checked` is a
    pre-flight already run on these `facts`.
    """
    dry_run = opts.dry_run if dry_run is None else dry_run
    started = time.monotonic()
    result = HostResult(host.name, host.ssh.address)
    if facts is None:
        checked = None          # a pre-flight is reused only with the facts it was run on
    t: Transport | None = transport
    held: lock.HostLock | None = None
    connect = io.connect or ssh_connector(opts.identity)
    step = Step.CONNECT
    try:
        if t is None:
            t = await connect(host)
            if not dry_run:
                step = Step.LOCK
                held, locked = await lock_and_observe(t, host, opts.lock_wait)
                t = held.over(t)        # the run's commands through the holder's shell
                facts = facts or locked
        if facts is None:
            step = Step.OBSERVE
            facts = await observe(t, host)
        result.facts = facts
        run = _HostRun(host, rev, opts, io, t, result, deferred=hold, fleet_quarantine=quarantine or {},
                       check=check, reuse=checked)
        step = Step.PREFLIGHT
        plan = await run.plan(facts)
        result.plan = plan
        if not dry_run:
            # The door's report shows this plan before it is applied (report.PhaseView).
            if io.on_planned is not None and plan.changes:
                io.on_planned(result)
            for rnd in range(MAX_ROUNDS):
                if rnd:
                    run.retry = False     # --retry is one more try: the first round's, not every round's
                    step = Step.OBSERVE
                    facts = await observe(t, host)
                    step = Step.PREFLIGHT
                    plan = await run.plan(facts)
                    result.plan = merge_plans(result.plan, plan)
                if not plan.actions:
                    break
                if any(a.kind is Kind.FETCH for a in plan.actions):
                    step = Step.PREFLIGHT      # the fetches report their failures; the model is checked again
                    plan = await run.fetch(plan, facts)
                    result.plan = plan if rnd == 0 else merge_plans(result.plan, plan)
                step = Step.APPLY
                if await run.execute(plan, facts):
                    break
        fold(result, plan, dry_run)
        if not dry_run:
            result.running = {n: running_after(plan, facts, n) for n in host.services}
    except HostError as e:
        result.status, result.reason, result.message = Result.FAILED, host_failure(e, step), e.message
    except ReconcilerError as e:
        result.status, result.reason, result.message = Result.FAILED, Reason.FAILED, str(e)
    finally:
        if held is not None:
            await held.release()
        if t is not None and transport is None:
            await t.close()
        result.seconds = time.monotonic() - started
    return result


