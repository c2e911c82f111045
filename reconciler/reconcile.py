"""One host: connect -> observe -> plan -> apply -> watch health -> roll back. The fleet: all
hosts, concurrently, bounded.

Level-based: every run observes afresh. The host's per-service record is the memory that makes
rollback safe across runs and controllers:

    hash, revision                  what was last applied
    last_good_revision, last_good_hash   what last passed health here
    quarantine {hash, revision, reason, quote, rollback_failed}
                                    a rendered state that failed here; never re-applied until
                                    the rendered state changes (a new commit) or --retry

One host failing never stops the others: every host ends with a HostResult.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from .apply import apply_plan, stop_service, write_records
from .errors import HostError, ReconcilerError
from .facts import HostFacts, observe_command, parse_observation
from .health import Outcome, Phase, watch_service
from .plan import HostPlan, Kind, plan_host
from .spec import DesiredState, HostSpec, ServiceSpec
from .transport import SSHTransport, Transport

Connector = Callable[[HostSpec], Awaitable[Transport]]
# Renders the desired state at another revision (for rollback); None when it cannot.
RenderAt = Callable[[str], DesiredState | None]
HostPhase = Callable[[str, str, str, float, float], None]   # host, service, phase, elapsed, timeout

# Exit-code order of host statuses: the worst decides.
STATUS_CODE = {"in-sync": 0, "converged": 0, "would-change": 2, "rolled-back": 3, "quarantined": 3, "failed": 4}


@dataclass
class ServiceEvent:
    """What happened to one service in this run (for reports, status and history)."""

    service: str
    action: str                     # deploy | rollback | quarantined | held
    revision: str
    content_hash: str
    outcome: Outcome | None = None
    note: str = ""
    quote: str | None = None        # for quarantined/held: the journal line recorded at the failure

    def to_json(self) -> dict:
        return {"service": self.service, "action": self.action, "revision": self.revision,
                "content_hash": self.content_hash, "note": self.note, "quote": self.quote,
                "outcome": self.outcome.to_json() if self.outcome else None}


@dataclass
class HostResult:
    """The outcome for one host.

    status: in-sync | would-change | converged | rolled-back | quarantined | failed
    """

    host: str
    address: str
    status: str
    plan: HostPlan | None = None
    reason: str | None = None          # CamelCase, for failures
    message: str | None = None
    seconds: float = 0.0
    events: list[ServiceEvent] = field(default_factory=list)
    running: dict[str, str | None] = field(default_factory=dict)   # service -> revision running

    def worsen(self, status: str, reason: str | None = None, message: str | None = None) -> None:
        if STATUS_CODE[status] >= STATUS_CODE.get(self.status, 0):
            self.status = status
            if reason:
                self.reason, self.message = reason, message

    def to_json(self) -> dict:
        return {
            "host": self.host, "address": self.address, "status": self.status,
            "reason": self.reason, "message": self.message, "seconds": round(self.seconds, 3),
            "summary": self.plan.summary() if self.plan else None,
            "actions": [a.to_json() for a in self.plan.actions] if self.plan else [],
            "events": [e.to_json() for e in self.events],
            "running": self.running,
        }


@dataclass
class FleetResult:
    revision: str
    dry_run: bool
    hosts: list[HostResult] = field(default_factory=list)

    @property
    def failed(self) -> list[HostResult]:
        return [h for h in self.hosts if h.status == "failed"]

    def exit_code(self) -> int:
        """0 converged/in sync, 2 dry-run found changes, 3 rolled back / on last good, 4 failed."""
        code = max((STATUS_CODE.get(h.status, 4) for h in self.hosts), default=0)
        if code == 2 and not self.dry_run:
            return 0
        return code

    def to_json(self) -> dict:
        return {"revision": self.revision, "short": self.revision[:7], "dry_run": self.dry_run,
                "exit_code": self.exit_code(), "hosts": [h.to_json() for h in self.hosts]}


def ssh_connector(identity: str | None = None, connect_timeout: float = 10.0) -> Connector:
    async def connect(host: HostSpec) -> Transport:
        return await SSHTransport.connect(host.name, host.ssh, identity=identity, connect_timeout=connect_timeout)
    return connect


async def observe(t: Transport, host: HostSpec) -> HostFacts:
    """Read everything the planner needs from the host, in one round trip."""
    cmd, token = observe_command(list(host.services))
    res = await t.run(cmd, check=True, timeout=30, what="observe")
    return parse_observation(res.stdout, token, host.name)


def _service_at(render_at: RenderAt | None, rev: str | None, host: str, name: str) -> ServiceSpec | None:
    if not rev or render_at is None:
        return None
    state = render_at(rev)
    h = state.hosts.get(host) if state else None
    return h.services.get(name) if h else None


@dataclass
class _Target:
    """The service spec this run converges to, and why (desired, or last good in quarantine)."""

    spec: ServiceSpec
    revision: str
    substituted: bool = False


def resolve_targets(host: HostSpec, facts: HostFacts, revision: str, render_at: RenderAt | None,
                    retry: bool) -> tuple[HostSpec, dict[str, _Target], frozenset[str], list[ServiceEvent]]:
    """Swap quarantined desired services for their last good version (or hold them)."""
    services: dict[str, ServiceSpec] = {}
    targets: dict[str, _Target] = {}
    hold: set[str] = set()
    events: list[ServiceEvent] = []
    for name, svc in host.services.items():
        rec = (facts.services.get(name).record if name in facts.services else None) or {}
        q = rec.get("quarantine") or {}
        if q.get("hash") == svc.content_hash() and not retry:
            good_rev = rec.get("last_good_revision")
            good = None if q.get("rollback_failed") else _service_at(render_at, good_rev, host.name, name)
            if good is not None and good.content_hash() == rec.get("last_good_hash"):
                services[name] = good
                targets[name] = _Target(good, good_rev, substituted=True)
                note = (f"desired {q.get('revision', '?')[:7]} quarantined ({q.get('reason')}), "
                        f"running {good_rev[:7]}")
                events.append(ServiceEvent(name, "quarantined", revision, svc.content_hash(), note=note,
                                           quote=q.get("quote")))
            else:
                services[name] = svc
                hold.add(name)
                why = "rollback failed" if q.get("rollback_failed") else "no last good revision"
                note = (f"desired {q.get('revision', '?')[:7]} quarantined ({q.get('reason')}); {why}: "
                        f"left stopped until a new commit changes it or --retry")
                events.append(ServiceEvent(name, "held", revision, svc.content_hash(), note=note,
                                           quote=q.get("quote")))
        else:
            services[name] = svc
            targets[name] = _Target(svc, revision)
    eff = HostSpec(host.name, host.ssh, services, host.labels, host.source)
    return eff, targets, frozenset(hold), events


def unverified(host: HostSpec, facts: HostFacts, hold: frozenset[str]) -> frozenset[str]:
    """Services whose applied version matches the desired one but never passed health here."""
    out = set()
    for name, svc in host.services.items():
        f = facts.services.get(name)
        rec = (f.record if f else None) or {}
        q = rec.get("quarantine") or {}
        if (name not in hold and rec.get("hash") == svc.content_hash() and
                rec.get("last_good_hash") != rec["hash"] and q.get("hash") != rec["hash"]):
            out.add(name)
    return frozenset(out)


class _HostRun:
    """Mutable state of one host's run: the transport, the records, the result."""

    def __init__(self, t: Transport, host: HostSpec, facts: HostFacts, result: HostResult,
                 on_phase: HostPhase | None):
        self.t, self.host, self.result = t, host, result
        self.records: dict[str, dict] = {n: dict(s.record) for n, s in facts.services.items() if s.record}
        self.dirty: set[str] = set()
        self.on_phase = on_phase

    def phase(self) -> Phase:
        def cb(service: str, phase: str, elapsed: float, timeout: float) -> None:
            if self.on_phase:
                self.on_phase(self.host.name, service, phase, elapsed, timeout)
        return cb

    def update(self, name: str, **fields) -> None:
        rec = self.records.setdefault(name, {})
        for k, v in fields.items():
            if v is None:
                rec.pop(k, None)
            else:
                rec[k] = v
        self.dirty.add(name)

    async def apply_and_watch(self, plan: HostPlan, facts: HostFacts, specs: dict[str, ServiceSpec],
                              verify: frozenset[str] = frozenset()) -> dict[str, Outcome]:
        """Apply a plan, then watch every service it started or restarted, concurrently.

        `verify` names services applied earlier but never seen healthy (a run killed during its
        health wait): they are watched again without a restart, so the next run converges.
        """
        applied_at = await apply_plan(self.t, plan)
        since = applied_at or time.time()
        for name, rec in plan.records.items():
            # what was applied changes; last good and quarantine stay as this run knows them
            self.records[name] = {**self.records.get(name, {}), "hash": rec["hash"], "revision": rec["revision"]}
        for name in plan.dropped_records:
            self.records.pop(name, None)
        started = [a for a in plan.actions if a.kind in (Kind.START, Kind.RESTART) and a.service in specs]

        async def one(kind: Kind, name: str) -> tuple[str, Outcome]:
            f = facts.services.get(name)
            base = 0 if kind is Kind.START or f is None else int(f.props.get("NRestarts", "0") or 0)
            return name, await watch_service(self.t, name, specs[name].health, baseline_restarts=base,
                                             since_epoch=since - 1, on_phase=self.phase())
        todo = [(a.kind, a.service) for a in started if a.service]
        todo += [(Kind.RECORD, n) for n in sorted(verify - {n for _, n in todo})]
        if applied_at is None and verify:
            since = time.time() - 3600   # the deploy began in an earlier run
        pairs = await asyncio.gather(*(one(kind, name) for kind, name in todo))
        return dict(pairs)


async def reconcile_host(host: HostSpec, revision: str, connect: Connector, *, dry_run: bool,
                         render_at: RenderAt | None = None, retry: bool = False,
                         on_phase: HostPhase | None = None) -> HostResult:
    """Converge one host (or, with dry_run, only plan it). Never raises for host failures."""
    started = time.monotonic()
    result = HostResult(host.name, host.ssh.address, "in-sync")
    t: Transport | None = None
    try:
        t = await connect(host)
        facts = await observe(t, host)
        eff, targets, hold, events = resolve_targets(host, facts, revision, render_at, retry)
        result.events.extend(events)
        plan = plan_host(eff, facts, revision, hold)
        result.plan = plan
        for e in events:
            result.worsen("quarantined" if e.action == "quarantined" else "failed",
                          "Quarantined" if e.action == "quarantined" else "QuarantinedNoRollback", e.note)
        if dry_run:
            if plan.changes:
                result.worsen("would-change")
        else:
            run = _HostRun(t, host, facts, result, on_phase)
            outcomes = await run.apply_and_watch(plan, facts, eff.services, unverified(eff, facts, hold))
            if plan.changes and result.status == "in-sync":
                result.status = "converged"
            for name, out in sorted(outcomes.items()):
                await _settle(run, name, out, targets[name], facts, render_at)
            await write_records(t, {n: run.records[n] for n in run.dirty if n in run.records})
            result.running = {n: run.records.get(n, {}).get("revision") for n in host.services}
    except HostError as e:
        result.status, result.reason, result.message = "failed", e.reason, e.message
    except ReconcilerError as e:
        result.status, result.reason, result.message = "failed", "Failed", str(e)
    finally:
        if t is not None:
            await t.close()
        result.seconds = time.monotonic() - started
    return result


async def _settle(run: _HostRun, name: str, out: Outcome, target: _Target, facts: HostFacts,
                  render_at: RenderAt | None) -> None:
    """Record a health outcome; on failure stop the unit, quarantine it and roll back."""
    res, spec = run.result, target.spec
    action = "rollback" if target.substituted else "deploy"
    res.events.append(ServiceEvent(name, action, target.revision, spec.content_hash(), out))
    if out.healthy:
        run.update(name, last_good_revision=target.revision, last_good_hash=spec.content_hash(),
                   quarantine=None if not target.substituted else run.records.get(name, {}).get("quarantine"))
        return
    await stop_service(run.t, name)
    prior = (facts.services[name].record or {}) if name in facts.services else {}
    quarantine = {"hash": spec.content_hash(), "revision": target.revision, "reason": out.reason,
                  "quote": out.quote, "at": int(time.time())}
    if target.substituted:
        # The last good version itself failed: stop, and don't flap between versions.
        old_q = prior.get("quarantine") or {}
        run.update(name, quarantine={**old_q, "rollback_failed": True})
        res.worsen("failed", "RollbackFailed", f"{name}: last good {target.revision[:7]} failed too: {out.message}")
        return
    run.update(name, quarantine=quarantine)
    good_rev, good_hash = prior.get("last_good_revision"), prior.get("last_good_hash")
    good = _service_at(render_at, good_rev, run.host.name, name)
    if good is None or good.content_hash() != good_hash or good_hash == spec.content_hash():
        why = "first deploy failed" if not good_rev else f"last good {str(good_rev)[:7]} cannot be rendered"
        res.worsen("failed", "FirstDeployFailed" if not good_rev else "RollbackFailed",
                   f"{name}: {out.reason}: {out.quote or out.message}; {why}; service left stopped")
        return
    # Roll back this service alone: every other service is held as it is.
    after = await observe(run.t, run.host)
    others = frozenset(run.host.services) - {name}
    rb_host = HostSpec(run.host.name, run.host.ssh, {**run.host.services, name: good}, run.host.labels)
    rb_plan = plan_host(rb_host, after, good_rev, others)
    outs = await run.apply_and_watch(rb_plan, after, {name: good})
    rb = outs.get(name)
    res.events.append(ServiceEvent(name, "rollback", good_rev, good_hash, rb))
    if rb is not None and rb.healthy:
        run.update(name, last_good_revision=good_rev, last_good_hash=good_hash)
        res.worsen("rolled-back", "RolledBack",
                   f"{name}: {out.reason}: {out.quote or out.message}; rolled back to {good_rev[:7]}")
    else:
        await stop_service(run.t, name)
        run.update(name, quarantine={**quarantine, "rollback_failed": True})
        res.worsen("failed", "RollbackFailed",
                   f"{name}: {out.reason}: {out.quote or out.message}; rollback to {good_rev[:7]} failed too"
                   + (f": {rb.quote or rb.message}" if rb else ""))


async def reconcile_fleet(state: DesiredState, connect: Connector, *, dry_run: bool = False,
                          concurrency: int | None = None, hosts: list[str] | None = None,
                          render_at: RenderAt | None = None, retry: bool = False,
                          on_phase: HostPhase | None = None) -> FleetResult:
    """Reconcile every selected host concurrently (at most `concurrency` at once)."""
    sem = asyncio.Semaphore(concurrency or state.settings.concurrency)
    selected = [h for n, h in sorted(state.hosts.items()) if not hosts or n in hosts]

    async def one(h: HostSpec) -> HostResult:
        async with sem:
            return await reconcile_host(h, state.revision, connect, dry_run=dry_run, render_at=render_at,
                                        retry=retry, on_phase=on_phase)

    results = await asyncio.gather(*(one(h) for h in selected))
    return FleetResult(state.revision, dry_run, list(results))
