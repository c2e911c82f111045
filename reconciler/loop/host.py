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
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING, TypeAlias

from .. import faults
from ..desired.spec import DesiredState, HostSpec, ServiceSpec
from ..errors import CommandError, HostError, ReconcilerError
from ..host import lock
from ..host.apply import Applied, apply_plan, write_record
from ..host.health import Outcome, Phase, SystemdWatch, watch_service
from ..host.transport import SSHTransport, Transport
from ..plan.facts import HostFacts, observe_command, parse_observation
from ..plan.planner import (
    Action,
    Context,
    HostPlan,
    Kind,
    Reason,
    ServicePlan,
    State,
    needs_last_good,
    plan_host,
    secret_files,
)
from ..plan.records import NO_VERDICT, SUPERSEDED, Pending, Quarantine, Result, ServiceRecord, Verdict, judge

if TYPE_CHECKING:     # gate.py (pre-flight, the rule pack, the GPU gate) loads when a plan starts something
    from ..preflight import RuleSet
    from .checks import Preflight

Connector = Callable[[HostSpec], Awaitable[Transport]]
# Renders the desired state at another revision (for rollback); None when it cannot.
RenderAt = Callable[[str], DesiredState | None]
HostPhase = Callable[[str, str, str, float, float], None]   # host, service, phase, elapsed, timeout
# The pre-flight rule pack, or a function that loads it on first use (a run that starts nothing
# never parses it).
Rules: TypeAlias = "RuleSet | Callable[[], RuleSet] | None"

MAX_ROUNDS = 6


class Event(StrEnum):
    """What happened to one service in a run (reports, the store, metrics)."""

    DEPLOY = "deploy"            # the desired version was started and judged
    ROLLBACK = "rollback"        # the last good version was started in its place and judged
    REVERIFY = "reverify"        # a version without a verdict was watched again and judged
    QUARANTINED = "quarantined"  # the desired version is quarantined; the last good runs (or is left as is)
    HELD = "held"                # quarantined with nothing to run: left stopped
    BLOCKED = "blocked"          # pre-flight or systemd refused it; nothing was written
    FOREIGN = "foreign"          # a unit the reconciler did not install: left untouched


@dataclass
class ServiceEvent:
    """What happened to one service in this run (for reports, status and history)."""

    service: str
    action: str                     # an Event
    revision: str
    content_hash: str
    outcome: Outcome | None = None
    note: str = ""
    quote: str | None = None        # for quarantined/held: the journal line recorded at the failure

    def to_json(self) -> dict[str, object]:
        return {"service": self.service, "action": str(self.action), "revision": self.revision,
                "content_hash": self.content_hash, "note": self.note, "quote": self.quote,
                "outcome": self.outcome.to_json() if self.outcome else None}


@dataclass
class HostResult:
    """The outcome for one host: the worst of its services (records.Result ranks them)."""

    host: str
    address: str
    status: Result = Result.IN_SYNC
    plan: HostPlan | None = None
    reason: str | None = None          # CamelCase, for failures
    message: str | None = None
    seconds: float = 0.0
    events: list[ServiceEvent] = field(default_factory=list)
    running: dict[str, str | None] = field(default_factory=dict)   # service -> revision running
    facts: HostFacts | None = field(default=None, repr=False, compare=False)   # what the plan saw
    notes: list[str] = field(default_factory=list)      # pre-flight warnings, GPU gate notes
    checked: Preflight | None = field(default=None, repr=False, compare=False)   # the last pre-flight

    def worsen(self, status: Result, reason: str | None = None, message: str | None = None) -> None:
        """Keep the worst status; messages of equally bad failures add up."""
        status = Result(status)
        if status.rank > Result(self.status).rank:
            self.status, self.reason, self.message = status, reason, message
        elif status == self.status and message and status.rank >= Result.QUARANTINED.rank:
            self.reason = self.reason or reason
            if message != self.message and (not self.message or message not in self.message):
                self.message = f"{self.message}; {message}" if self.message else message

    def to_json(self) -> dict[str, object]:
        return {
            "host": self.host, "address": self.address, "status": str(self.status),
            "reason": self.reason, "message": self.message, "seconds": round(self.seconds, 3),
            "summary": self.plan.summary() if self.plan else None,
            "actions": [a.to_json() for a in self.plan.actions if a.kind not in (Kind.INTENT, Kind.RECORD)]
            if self.plan else [],
            "states": {n: str(s) for n, s in self.plan.states.items()} if self.plan else {},
            "events": [e.to_json() for e in self.events],
            "notes": self.notes,
            "running": self.running,
        }


def ssh_connector(identity: str | None = None, connect_timeout: float = 10.0) -> Connector:
    """Connects to a host over SSH (a new connection each time: the daemon's pool keeps them)."""
    async def connect(host: HostSpec) -> Transport:
        return await SSHTransport.connect(host.name, host.ssh, identity=identity, connect_timeout=connect_timeout)
    return connect


def observation(host: HostSpec) -> tuple[str, str]:
    """The command that reads everything the planner needs from the host, and its token."""
    return observe_command(list(host.services), secret_files=secret_files(host))


async def observe(t: Transport, host: HostSpec) -> HostFacts:
    """Read everything the planner needs from the host, in one round trip."""
    cmd, token = observation(host)
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

_STATE_EVENT = {State.QUARANTINED: Event.QUARANTINED, State.HALTED: Event.QUARANTINED,
                State.QUARANTINED_NO_GOOD: Event.HELD, State.ROLLBACK_FAILED: Event.HELD,
                State.BLOCKED: Event.BLOCKED, State.FOREIGN: Event.FOREIGN, State.INCONCLUSIVE: Event.HELD}


def confirm_margin() -> float | None:
    """Seconds the dead-man's switch adds to a deploy's start-up timeout and stable_for before it
    fires: $RECONCILER_CONFIRM_MARGIN (default 60; "off" disarms the switch altogether)."""
    raw = os.environ.get("RECONCILER_CONFIRM_MARGIN", "").strip().lower()
    if raw == "off":
        return None
    try:
        return max(0.0, float(raw)) if raw else 60.0
    except ValueError:
        return 60.0


def service_result(sp: ServicePlan, events: list[ServiceEvent], dry_run: bool,
                   changes: bool) -> tuple[Result, str | None, str | None]:
    """PURE: what one service's run comes to (result, reason, message), from its state and the
    verdicts of this run. The one place that turns verdicts into a host's result."""
    judged = [e for e in events if e.outcome is not None and e.outcome.reason not in NO_VERDICT]
    failed = next((e for e in judged if e.action != Event.ROLLBACK and e.outcome and not e.outcome.healthy), None)
    rollback = next((e for e in judged if e.action == Event.ROLLBACK), None)
    if failed is not None:
        return _after_failure(sp, failed, rollback)
    if rollback is not None and rollback.outcome is not None:
        if rollback.outcome.healthy:
            return Result.ROLLED_BACK, "RolledBack", f"{sp.name}: {sp.note or 'running the last good version'}"
        return (Result.FAILED, "RollbackFailed",
                f"{sp.name}: last good {rollback.revision[:7]} failed too: {rollback.outcome.message}")
    last = next((e.outcome for e in reversed(events) if e.outcome is not None), None)
    if last is not None and last.reason in NO_VERDICT - {SUPERSEDED} and sp.state is not State.INCONCLUSIVE:
        # the run ended on a watch without a verdict (its rounds ran out): not done
        return Result.FAILED, last.reason, f"{sp.name}: {last.message}"
    if sp.result.rank >= Result.QUARANTINED.rank:
        return sp.result, sp.reason or None, f"{sp.name}: {sp.note}" if sp.note else sp.name
    if dry_run and changes:
        return Result.WOULD_CHANGE, None, None
    return sp.result if changes else Result.IN_SYNC, None, None


def _after_failure(sp: ServicePlan, failed: ServiceEvent,
                   rollback: ServiceEvent | None) -> tuple[Result, str | None, str | None]:
    """A deploy (or re-verify) failed in this run: rolled back, rollback failed, or nothing to
    roll back to."""
    o = failed.outcome
    assert o is not None
    head = f"{sp.name}: {o.reason}: {o.quote or o.message}"
    rb = rollback.outcome if rollback is not None else None
    if rollback is not None and rb is not None:
        if rb.healthy:
            return Result.ROLLED_BACK, "RolledBack", f"{head}; rolled back to {rollback.revision[:7]}"
        return (Result.FAILED, "RollbackFailed",
                f"{head}; rollback to {rollback.revision[:7]} failed too: {rb.quote or rb.message}")
    if sp.state is State.QUARANTINED_NO_GOOD and "first deploy failed" in sp.note:
        return Result.FAILED, "FirstDeployFailed", f"{head}; first deploy failed; service left stopped"
    return Result.FAILED, "RollbackFailed", f"{head}; {sp.note or 'no rollback possible'}"


def _fold(result: HostResult, plan: HostPlan, dry_run: bool) -> None:
    """Fold every service of the final plan, with this run's events, into the host's result."""
    for name, sp in sorted(plan.services.items()):
        evs = [e for e in result.events if e.service == name]
        if sp.state in _STATE_EVENT and not any(e.outcome is not None for e in evs):
            result.events.append(ServiceEvent(name, _STATE_EVENT[sp.state], plan.revision, "", note=sp.note,
                                              quote=sp.quote))
        changes = any(a.service == name and a.kind.mutating for a in plan.actions) or any(
            e.outcome is not None for e in evs)
        status, reason, message = service_result(sp, evs, dry_run, changes)
        result.worsen(status, reason, message)
    if not dry_run and plan.dropped_records and result.status is Result.IN_SYNC:
        result.status = Result.CONVERGED
    if result.status is Result.IN_SYNC and any(a.reason is Reason.STALE_TEMP for a in plan.actions):
        # a killed run's temp files: changes of the host's own, with no service
        result.status = Result.WOULD_CHANGE if dry_run else Result.CONVERGED


# ---- one host -----------------------------------------------------------------------------------


class _HostRun:
    """One host's run: the open transport, the desired state, and what the rounds found."""

    def __init__(self, host: HostSpec, revision: str, t: Transport, result: HostResult, *,
                 render_at: RenderAt | None, retry: bool, deferred: frozenset[str],
                 fleet_quarantine: Mapping[str, Quarantine], rules: Rules,
                 on_phase: HostPhase | None, supersede: asyncio.Event | None = None,
                 check: bool = True, reuse: Preflight | None = None):
        self.host, self.revision, self.t, self.result = host, revision, t, result
        self.check, self.reuse = check, reuse
        self.render_at, self.retry, self.deferred = render_at, retry, deferred
        self.fleet_q = {n: q for n, q in fleet_quarantine.items() if n in host.services and n not in deferred}
        self.rules, self.on_phase, self.supersede = rules, on_phase, supersede
        self.preflight: Preflight | None = None
        self.facts: HostFacts | None = None
        self.systemd = SystemdWatch(t)      # every health watch on this host: one round trip per tick

    def _context(self, facts: HostFacts, pf: Preflight | None = None) -> Context:
        ctx = Context(self.revision, fleet_quarantine=self.fleet_q, deferred=self.deferred, retry=self.retry,
                      confirm_margin=confirm_margin())
        wanted = needs_last_good(self.host, facts, ctx)
        last_good: dict[str, ServiceSpec | None] = {}
        for name, rev in wanted.items():
            state = self.render_at(rev) if self.render_at is not None else None
            h = state.hosts.get(self.host.name) if state is not None else None
            last_good[name] = h.services.get(name) if h is not None else None
        return replace(ctx, last_good=last_good, checks=pf.checks() if pf is not None else ctx.checks)

    async def plan(self, facts: HostFacts, *, fetched: Mapping[str, str | None] | None = None) -> HostPlan:
        """Plan, then run the host-side pre-flight for what that plan starts, and plan again with
        its findings (blocked services, fetches, the GPU gate)."""
        plan = plan_host(self.host, facts, self._context(facts))
        if not any(a.kind in (Kind.START, Kind.RESTART, Kind.WRITE) for a in plan.actions) or not self.check:
            return plan
        if self.reuse is not None and fetched is None:
            # The survey's pre-flight, of these same facts: a pass that did not look again
            # does not check again (a wave's pass, which looks again, checks again too).
            pf, self.reuse = self.reuse, None
        else:
            from .checks import preflight_host
            rules = self.rules() if callable(self.rules) else self.rules
            pf = await preflight_host(self.t, self.host, plan, facts, rules, fetched=fetched)
        self.preflight = self.result.checked = pf
        self.result.notes.extend(w for w in pf.warnings if w not in self.result.notes)
        return plan_host(self.host, facts, self._context(facts, pf))

    def _progress(self) -> Phase:
        def cb(service: str, phase: str, elapsed: float, timeout: float) -> None:
            if self.on_phase:
                self.on_phase(self.host.name, service, phase, elapsed, timeout)
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
            from .checks import fetch_model
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
        faults.hit("before-apply")
        applied = await apply_plan(self.t, plan, now=int(time.time()), gpu_wait=waiter)
        self.systemd.seed(applied.shown, applied.shown_at)
        faults.hit("after-apply")
        for name, why in sorted(applied.skipped.items()):
            sp = plan.services[name]
            self.result.events.append(ServiceEvent(name, Event.BLOCKED, plan.revision,
                                                   sp.target.hash if sp.target else "", note=why))
            self.result.worsen(Result.FAILED, "GpuBusy", f"{name}: {why}")
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
        out = await watch_service(self.t, name, sp.target.spec.health, baseline_restarts=w.baseline_restarts,
                                  since_epoch=since, on_phase=self._progress(),
                                  baseline_invocation=w.baseline_invocation,
                                  baseline_active_enter=w.baseline_active_enter,
                                  start_error=failure.message if failure else None, cancel=self.supersede,
                                  systemd=self.systemd)
        kind = Event.ROLLBACK if w.rollback else Event.REVERIFY if w.reverify else Event.DEPLOY
        self.result.events.append(ServiceEvent(name, kind, w.revision, w.hash, out))
        rec = next((r for x in plan.actions if x.kind is Kind.RECORD and x.service == name
                    and (r := x.record) is not None), None)
        base = rec or self._record(name)
        judged = judge(base, hash=w.hash, revision=w.revision, rollback=w.rollback,
                       verdict=Verdict(out.healthy, out.reason, out.quote, out.message), now=int(time.time()),
                       fleet=self.fleet_q.get(name))
        unjudged = judged.record.pending is not None       # no verdict: the switch stays armed
        await write_record(self.t, name, judged.record, stop=judged.stop, disarm=not unjudged)
        faults.hit("after-verdict")
        if unjudged:
            self.result.notes.append(f"{name}: no verdict on {w.revision[:7]} ({out.reason}: {out.message}); "
                                     f"starting it again")
            return False
        if out.reason == SUPERSEDED:
            self.result.notes.append(f"{name}: {w.revision[:7]} superseded by a newer revision during its health "
                                     f"wait (no verdict: neither last good nor quarantined)")
            return True         # nothing to follow up here: the newer revision's run takes over
        return out.healthy

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


async def reconcile_host(host: HostSpec, revision: str, connect: Connector, *, dry_run: bool,
                         render_at: RenderAt | None = None, retry: bool = False,
                         on_phase: HostPhase | None = None, hold: frozenset[str] = frozenset(),
                         quarantine: Mapping[str, Quarantine] | None = None, transport: Transport | None = None,
                         facts: HostFacts | None = None, rules: Rules = None,
                         supersede: asyncio.Event | None = None, check: bool = True,
                         checked: Preflight | None = None) -> HostResult:
    """Converge one host (or, with dry_run, only plan it). Never raises for host failures.

    For the fleet's passes: `hold` names services another pass converges (a rollout wave);
    `quarantine` adds fleet-wide quarantines (service -> a halted rollout) that act like recorded
    ones and are written into the host's records; `transport` reuses an open connection (the
    caller closes it); `facts` skips the first observation. `rules`: the pre-flight rule pack (or
    a function that loads it, called when pre-flight first runs).
    `supersede`: set when a newer revision arrives; health waits then end without a verdict.
    `check=False` plans without the host-side pre-flight (a first look that only decides
    whether the host needs its lock); `checked` is a pre-flight already run on these `facts`.
    """
    started = time.monotonic()
    result = HostResult(host.name, host.ssh.address)
    if facts is None:
        checked = None          # a pre-flight is reused only with the facts it was run on
    t: Transport | None = transport
    held: lock.HostLock | None = None
    try:
        if t is None:
            t = await connect(host)
            if not dry_run:
                held, locked = await lock_and_observe(t, host, lock.WAIT)
                t = held.over(t)        # the run's commands through the holder's shell
                facts = facts or locked
        if facts is None:
            facts = await observe(t, host)
        result.facts = facts
        run = _HostRun(host, revision, t, result, render_at=render_at, retry=retry, deferred=hold,
                       fleet_quarantine=quarantine or {}, rules=rules, on_phase=on_phase, supersede=supersede,
                       check=check, reuse=checked)
        plan = await run.plan(facts)
        result.plan = plan
        if not dry_run:
            # An observer that prints plans (report.PhaseView) shows this one before it is applied.
            planned = getattr(on_phase, "planned", None)
            if planned is not None and plan.changes:
                planned(result)
            for rnd in range(MAX_ROUNDS):
                if rnd:
                    run.retry = False     # --retry is one more try: the first round's, not every round's
                    facts = await observe(t, host)
                    plan = await run.plan(facts)
                    result.plan = merge_plans(result.plan, plan)
                if not plan.actions:
                    break
                if any(a.kind is Kind.FETCH for a in plan.actions):
                    plan = await run.fetch(plan, facts)
                    result.plan = plan if rnd == 0 else merge_plans(result.plan, plan)
                if await run.execute(plan, facts):
                    break
        _fold(result, plan, dry_run)
        if not dry_run:
            result.running = {n: running_after(plan, facts, n) for n in host.services}
    except HostError as e:
        result.status, result.reason, result.message = Result.FAILED, e.reason, e.message
        if isinstance(e, CommandError) and e.what not in ("observe", "pre-flight"):
            result.reason = "ApplyFailed"
    except ReconcilerError as e:
        result.status, result.reason, result.message = Result.FAILED, "Failed", str(e)
    finally:
        if held is not None:
            await held.release()
        if t is not None and transport is None:
            await t.close()
        result.seconds = time.monotonic() - started
    return result


def running_after(plan: HostPlan, facts: HostFacts, name: str) -> str | None:
    """The revision a service runs after this run (as far as the last plan knows)."""
    sp = plan.services.get(name)
    if sp is None or sp.state in (State.QUARANTINED_NO_GOOD, State.ROLLBACK_FAILED, State.FOREIGN):
        return None
    if sp.target is not None:
        return sp.target.revision
    f = facts.services.get(name)
    return f.record.revision if f is not None and f.record is not None else None


def merge_plans(a: HostPlan | None, b: HostPlan | None) -> HostPlan | None:
    """Two plans on one host as one (several rounds or passes, for reports): actions in the order
    they ran; a service's plan is the later one, unless that one deferred it to another pass."""
    if a is None or b is None:
        return a or b
    services = dict(a.services)
    for name, sp in b.services.items():
        if sp.state is not State.DEFERRED or name not in services:
            services[name] = sp
    # Every pass ends by recording the revision: one such line says it.
    actions = a.actions + tuple(x for x in b.actions if not (x.kind is Kind.RECORD and x.service is None and
                                                             any(y.kind is Kind.RECORD and y.service is None
                                                                 for y in a.actions)))
    return HostPlan(a.host, b.revision, actions, services, a.dropped_records + b.dropped_records)
