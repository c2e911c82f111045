"""What a run comes to: per service (events, with the health outcome), per host, for the fleet.

PURE: the results and the one place that turns a run's verdicts into a host's result
(`service_result`, `fold`), and how passes over one host add up (`merge_result`, `merge_plans`).
`records.Result` ranks them; the CLI's exit code, the store, the metrics and the report read them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

import msgspec

from ..desired.spec import DesiredState
from ..errors import CommandError, HostError, ReconcilerError
from ..plan.actions import starting
from ..plan.budget import Step
from ..plan.forecast import unavailable_seconds
from ..plan.model import HostPlan, Kind, ServicePlan, State
from ..plan.records import NO_VERDICT, SUPERSEDED, Quarantine, Result
from ..plan.rollout import Halt, HashAt, HostOutcome, RolloutResult, RolloutStatus, group_members, quarantine_cover
from ..reasons import Reason

if TYPE_CHECKING:
    from ..host.health import Outcome
    from ..plan.facts import HostFacts
    from .checks import Preflight


class Event(StrEnum):
    """What happened to one service in a run (reports, the store, metrics)."""

    DEPLOY = "deploy"            # the desired version was started and judged
    ROLLBACK = "rollback"        # the last good version was started in its place and judged
    REVERIFY = "reverify"        # a version without a verdict was watched again and judged
    QUARANTINED = "quarantined"  # the desired version is quarantined; the last good runs (or is left as is)
    HELD = "held"                # quarantined with nothing to run: left stopped
    BLOCKED = "blocked"          # pre-flight or systemd refused it; nothing was written
    FOREIGN = "foreign"          # a unit the reconciler did not install: left untouched


class ServiceEvent(msgspec.Struct):
    """What happened to one service in this run (for reports, status and history)."""

    service: str
    action: Event
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
    reason: Reason | None = None       # for failures
    message: str | None = None
    seconds: float = 0.0
    events: list[ServiceEvent] = field(default_factory=list)
    running: dict[str, str | None] = field(default_factory=dict)   # service -> revision running
    facts: HostFacts | None = field(default=None, repr=False, compare=False)   # what the plan saw
    notes: list[str] = field(default_factory=list)      # pre-flight warnings, GPU gate notes
    checked: Preflight | None = field(default=None, repr=False, compare=False)   # the last pre-flight
    # issue 42: what each restart cost (service -> step -> seconds: loop/cutover.py), and the
    # requests still in flight where a drain gave up (service -> count: they may have failed)
    costs: dict[str, dict[str, float]] = field(default_factory=dict)
    lost: dict[str, float] = field(default_factory=dict)

    def worsen(self, status: Result, reason: Reason | None = None, message: str | None = None) -> None:
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
            "costs": {n: {"unavailable": round(unavailable_seconds(c), 3), "steps": c} for n, c in self.costs.items()},
            "in_flight_at_drain_timeout": self.lost,
        }


class FleetResult(msgspec.Struct):
    revision: str
    dry_run: bool
    hosts: list[HostResult] = msgspec.field(default_factory=list)
    rollouts: list[RolloutResult] = msgspec.field(default_factory=list)
    warnings: list[str] = msgspec.field(default_factory=list)     # e.g. a webhook that did not answer

    @property
    def failed(self) -> list[HostResult]:
        return [h for h in self.hosts if h.status is Result.FAILED]

    def exit_code(self) -> int:
        """0 converged/in sync, 2 dry-run found changes, 3 rolled back / on last good, 4 failed."""
        code = max((Result(h.status).exit_code for h in self.hosts), default=0)
        return 0 if code == 2 and not self.dry_run else code

    def to_json(self) -> dict[str, object]:
        return {"revision": self.revision, "short": self.revision[:7], "dry_run": self.dry_run,
                "exit_code": self.exit_code(), "hosts": [h.to_json() for h in self.hosts],
                "rollouts": [r.to_json() for r in self.rollouts], "warnings": self.warnings}


def merge_result(into: HostResult, r: HostResult) -> None:
    """Fold one pass's result into a host's result: the worst status wins; failures add up."""
    into.events.extend(r.events)
    into.notes.extend(n for n in r.notes if n not in into.notes)
    into.plan = merge_plans(into.plan, r.plan)
    into.running.update({k: v for k, v in r.running.items() if v is not None or k not in into.running})
    into.facts = r.facts or into.facts
    into.costs.update(r.costs)
    into.lost.update(r.lost)
    into.seconds += r.seconds
    into.worsen(Result(r.status), r.reason, r.message)


def failed_result(host: str, address: str, e: ReconcilerError, seconds: float) -> HostResult:
    """A host that could not be reached or read: failed, for the error's reason (Failed for an
    error that is not a host's)."""
    reason, message = (e.reason, e.message) if isinstance(e, HostError) else (Reason.FAILED, str(e))
    return HostResult(host, address, Result.FAILED, reason=reason, message=message, seconds=seconds)


class RunPhase(StrEnum):
    """Where a host's run is: what it was doing when an error ended it (host_failure)."""

    OBSERVE = "observe"
    PREFLIGHT = "pre-flight"     # planning, with the host-side pre-flight's one round trip
    APPLY = "apply"              # fetching, applying, the GPU gate, watching, recording verdicts


def host_failure(e: HostError, step: RunPhase) -> Reason:
    """PURE: the reason a host's result gives for an error that ended its run: a command that
    failed while the run changed the host is ApplyFailed; one that only read it (the
    observation, the pre-flight) keeps its own reason, as does every other host error."""
    if isinstance(e, CommandError) and step not in (RunPhase.OBSERVE, RunPhase.PREFLIGHT):
        return Reason.APPLY_FAILED
    return e.reason


_STATE_EVENT = {State.QUARANTINED: Event.QUARANTINED, State.HALTED: Event.QUARANTINED,
                State.QUARANTINED_NO_GOOD: Event.HELD, State.ROLLBACK_FAILED: Event.HELD,
                State.BLOCKED: Event.BLOCKED, State.FOREIGN: Event.FOREIGN, State.INCONCLUSIVE: Event.HELD}


def service_result(sp: ServicePlan, events: list[ServiceEvent], dry_run: bool,
                   changes: bool) -> tuple[Result, Reason | None, str | None]:
    """PURE: what one service's run comes to (result, reason, message), from its state and the
    verdicts of this run. The one place that turns verdicts into a host's result."""
    judged = [e for e in events if e.outcome is not None and e.outcome.reason not in NO_VERDICT]
    failed = next((e for e in judged if e.action != Event.ROLLBACK and e.outcome and not e.outcome.healthy), None)
    rollback = next((e for e in judged if e.action == Event.ROLLBACK), None)
    if failed is not None:
        return _after_failure(sp, failed, rollback)
    if rollback is not None and rollback.outcome is not None:
        if rollback.outcome.healthy:
            return Result.ROLLED_BACK, Reason.ROLLED_BACK, f"{sp.name}: {sp.note or 'running the last good version'}"
        return (Result.FAILED, Reason.ROLLBACK_FAILED,
                f"{sp.name}: last good {rollback.revision[:7]} failed too: {rollback.outcome.message}")
    return _without_a_failure(sp, events, dry_run, changes)


def _without_a_failure(sp: ServicePlan, events: list[ServiceEvent], dry_run: bool,
                       changes: bool) -> tuple[Result, Reason | None, str | None]:
    """No deploy failed and none was rolled back in this run: a watch that ended with no
    verdict, the planner's own state (quarantined, blocked ...), or changed / in sync."""
    last = next((e.outcome for e in reversed(events) if e.outcome is not None), None)
    if last is not None and last.reason in NO_VERDICT - {SUPERSEDED} and sp.state is not State.INCONCLUSIVE:
        # the run ended on a watch without a verdict (its rounds ran out): not done
        return Result.FAILED, last.reason, f"{sp.name}: {last.message}"
    if sp.result.rank >= Result.QUARANTINED.rank:
        return sp.result, sp.reason, f"{sp.name}: {sp.note}" if sp.note else sp.name
    if dry_run and changes:
        return Result.WOULD_CHANGE, None, None
    return sp.result if changes else Result.IN_SYNC, None, None


def _after_failure(sp: ServicePlan, failed: ServiceEvent,
                   rollback: ServiceEvent | None) -> tuple[Result, Reason | None, str | None]:
    """A deploy (or re-verify) failed in this run: rolled back, rollback failed, or nothing to
    roll back to."""
    o = failed.outcome
    assert o is not None
    head = f"{sp.name}: {o.reason}: {o.quote or o.message}"
    rb = rollback.outcome if rollback is not None else None
    if rollback is not None and rb is not None:
        if rb.healthy:
            return Result.ROLLED_BACK, Reason.ROLLED_BACK, f"{head}; rolled back to {rollback.revision[:7]}"
        return (Result.FAILED, Reason.ROLLBACK_FAILED,
                f"{head}; rollback to {rollback.revision[:7]} failed too: {rb.quote or rb.message}")
    if sp.state is State.QUARANTINED_NO_GOOD and sp.first_deploy:
        return Result.FAILED, Reason.FIRST_DEPLOY_FAILED, f"{head}; first deploy failed; service left stopped"
    return Result.FAILED, Reason.ROLLBACK_FAILED, f"{head}; {sp.note or 'no rollback possible'}"


def fold(result: HostResult, plan: HostPlan, dry_run: bool) -> None:
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
    recorded = any(y.kind is Kind.RECORD and y.service is None for y in a.actions)
    actions = a.actions + tuple(x for x in b.actions if not (recorded and x.kind is Kind.RECORD and x.service is None))
    return HostPlan(a.host, b.revision, actions, services, a.dropped_records + b.dropped_records)


# ---- what a surveyed or converged host means to the fleet run (fleet.py) ----------------------------


def rollback_notices(host: str, r: HostResult) -> list[dict[str, object]]:
    """The webhook notice of each failed deploy of a pass: rolled back (to which revision) or failed."""
    out: list[dict[str, object]] = []
    for i, e in enumerate(r.events):
        if e.action == Event.ROLLBACK or e.outcome is None or e.outcome.healthy:
            continue
        rb = next((x for x in r.events[i + 1:] if x.service == e.service and x.action == Event.ROLLBACK), None)
        ok = rb is not None and rb.outcome is not None and rb.outcome.healthy
        out.append({"host": host, "service": e.service, "revision": e.revision, "short": e.revision[:7],
                    "reason": e.outcome.reason, "message": e.outcome.message, "journal_line": e.outcome.quote,
                    "result": "rolled-back" if ok else "failed",
                    "rolled_back_to": rb.revision if rb is not None and ok else None})
    return out


def restarting(r: HostResult) -> set[str]:
    """Services a surveyed host would restart or start with their desired version (not those
    swapped for last good, which are repairs, not a rollout)."""
    if r.plan is None:
        return set()
    return {n for n, tg in starting(r.plan).items() if not tg.rollback}


def writes(r: HostResult) -> bool:
    """Whether a host's surveyed plan would write anything there (a hold alone does not)."""
    return r.plan is not None and any(a.kind is not Kind.HOLD for a in r.plan.actions)


def wave_outcome(service: str, host: str, r: HostResult) -> HostOutcome:
    """What a wave host's pass made of the group's service, for rollout.judge_wave: its failed
    deploy (started and watched to that verdict), else the host's own failure, else healthy."""
    bad = next((e.outcome for e in r.events if e.service == service and e.action == Event.DEPLOY
                and e.outcome is not None and not e.outcome.healthy), None)
    if bad is not None:
        return HostOutcome(host, bad.reason, bad.message, bad.quote, started=True)
    if r.status is Result.FAILED:
        return HostOutcome(host, r.reason or Reason.FAILED, r.message or "", observed=r.plan is not None)
    return HostOutcome(host)


def fleet_quarantines(state: DesiredState, results: Mapping[str, HostResult],
                      hash_at: HashAt) -> dict[str, dict[str, Quarantine]]:
    """PURE: keep halted rollouts halted: each group's live halt, found on a member's record,
    extended to the members that hold no record of it (rollout.quarantine_cover); host ->
    service -> the quarantine its next plan acts on."""
    out: dict[str, dict[str, Quarantine]] = {}
    for key, members in group_members(state).items():
        svc = key.service
        desired, halts = {}, []
        for h in members:
            r = results.get(h)
            if r is None or r.facts is None:
                continue
            want = state.hosts[h].services[svc].content_hash()
            f = r.facts.services.get(svc)
            q = f.record.quarantine if f is not None and f.record is not None else None
            if q is not None and q.hash == want:
                halts.append(Halt(h, q.to_json()))
            elif svc in restarting(r):
                desired[h] = want
        if not halts or not desired:
            continue
        for h, cover in quarantine_cover(key, desired, halts, state.revision, hash_at).items():
            fq = Quarantine.from_json(cover)
            if fq is not None:
                out.setdefault(h, {})[svc] = fq
    return out


def blocked(ro: RolloutResult, step: Step, left: Sequence[str], results: Mapping[str, HostResult]) -> None:
    """A rollout the budget let go no further (plan/budget.py): it ends BudgetBlocked, naming the
    service and why each host left waits; those hosts were not restarted (the run exits 3)."""
    ro.status = RolloutStatus.HALTED
    ro.reason = Reason.BUDGET_BLOCKED
    ro.message = f"{ro.plan.group.service}: {step.describe()}"
    ro.untouched = tuple(left)
    for h in left:
        r = results.get(h)
        if r is not None:
            r.worsen(Result.QUARANTINED, Reason.BUDGET_BLOCKED,
                     f"{ro.plan.group.service}: not restarted: min_available = {step.floor} could not be kept")
