"""One host: connect -> observe -> plan -> apply -> watch health -> roll back. The fleet: every
host observed and planned first, then converged, with the hosts that share a service definition
rolled out in waves (canary first, at most max_unavailable at once, halting at the first failure).

Level-based: every run observes afresh. The host's per-service record is the memory that makes
rollback safe across runs and controllers:

    hash, revision                  what was last applied
    last_good_revision, last_good_hash   what last passed health here
    quarantine {hash, revision, reason, quote, rollback_failed}
                                    a rendered state that failed here; never re-applied until
                                    the rendered state changes (a new commit) or --retry

One host failing never stops the others: every host ends with a HostResult.

The fleet run (reconcile_fleet) in passes, never two at once on one host:

    survey      connect, observe, plan every selected host (what a dry-run shows)
    quarantine  a group whose rollout halted earlier stays halted (rollout.quarantine_cover)
    waves       rollout.plan_rollouts: per group, which hosts restart together
    free pass   every host converges, leaving its waved services untouched
    wave pass   per group, wave by wave: the wave's hosts converge that one service; a failure
                halts the group and quarantines the change on every host it left untouched
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from collections.abc import Mapping
from typing import Awaitable, Callable

from .apply import stop_service, write_records
from .gate import gated_apply, preflight_host
from .gpu import GpuFacts
from .preflight import RuleSet
from .errors import HostError, ReconcilerError, SourceError
from .facts import HostFacts, observe_command, parse_observation
from .health import Outcome, Phase, watch_service
from .notify import Notifier
from .plan import ORDER, HostPlan, Kind, State, plan_host
from .rollout import Halt, RolloutResult, Wave, group_members, natural_key, plan_rollouts, quarantine_cover
from .schema import LABEL
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
    facts: HostFacts | None = field(default=None, repr=False, compare=False)   # what the plan saw
    notes: list[str] = field(default_factory=list)      # pre-flight warnings, GPU gate notes

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
            "notes": self.notes,
            "running": self.running,
        }


@dataclass
class FleetResult:
    revision: str
    dry_run: bool
    hosts: list[HostResult] = field(default_factory=list)
    rollouts: list[RolloutResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)     # e.g. a webhook that did not answer

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
                "exit_code": self.exit_code(), "hosts": [h.to_json() for h in self.hosts],
                "rollouts": [r.to_json() for r in self.rollouts], "warnings": self.warnings}


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
    quarantine: dict | None = None     # the quarantine that made it substitute (recorded or fleet-wide)


def live_quarantine(recorded: dict | None, fleet: dict | None, want: str) -> dict | None:
    """The quarantine in force for a service whose desired content hash is `want`: the one
    recorded on the host, the fleet-wide one (a halted rollout), or both merged (the record wins,
    the fleet fills in what it lacks, e.g. where the rollout halted). None when neither matches."""
    rec = recorded if recorded and recorded.get("hash") == want else None
    flt = fleet if fleet and fleet.get("hash") == want else None
    if rec and flt:
        return {**flt, **rec}
    return rec or flt


def _quarantine_why(q: dict, host: str) -> str:
    """Why a version is quarantined, for notes: the failure, or where its rollout halted."""
    at = q.get("halted_at")
    if not at:
        return str(q.get("reason"))
    if at == host:
        return f"{q.get('reason')}; its rollout halted here"
    return f"rollout halted at {halt_where(at, bool(q.get('canary')), q.get('wave'))}: {q.get('cause')}"


def halt_where(host: str, canary: bool, wave: object) -> str:
    """Where a rollout halted, in words: 'canary gpu-3' or 'gpu-7 (wave 3)'."""
    return f"canary {host}" if canary else f"{host} (wave {wave})"


def resolve_targets(host: HostSpec, facts: HostFacts, revision: str, render_at: RenderAt | None,
                    retry: bool, fleet: Mapping[str, dict] | None = None,
                    ) -> tuple[HostSpec, dict[str, _Target], frozenset[str], list[ServiceEvent]]:
    """Swap quarantined desired services for their last good version (or hold them).

    `fleet` adds quarantines decided for the whole fleet (a halted rollout) to those recorded on
    the host; they act exactly like recorded ones.
    """
    services: dict[str, ServiceSpec] = {}
    targets: dict[str, _Target] = {}
    hold: set[str] = set()
    events: list[ServiceEvent] = []
    for name, svc in host.services.items():
        rec = (facts.services.get(name).record if name in facts.services else None) or {}
        q = live_quarantine(rec.get("quarantine"), (fleet or {}).get(name), svc.content_hash())
        if q is not None and not retry:
            good_rev = rec.get("last_good_revision")
            good = None if q.get("rollback_failed") else _service_at(render_at, good_rev, host.name, name)
            why_q = _quarantine_why(q, host.name)
            if good is not None and good.content_hash() == rec.get("last_good_hash"):
                services[name] = good
                targets[name] = _Target(good, good_rev, substituted=True, quarantine=q)
                note = f"desired {q.get('revision', '?')[:7]} quarantined ({why_q}), running {good_rev[:7]}"
                events.append(ServiceEvent(name, "quarantined", revision, svc.content_hash(), note=note,
                                           quote=q.get("quote")))
            else:
                services[name] = svc
                hold.add(name)
                rev7 = q.get('revision', '?')[:7]
                if q.get("halted_at") and q.get("halted_at") != host.name:
                    # Never restarted by the halted rollout, and no last good to swap in: whatever
                    # runs here keeps running, untouched.
                    action = "quarantined"
                    note = f"desired {rev7} quarantined ({why_q}); left as it is until a new commit changes it or --retry"
                else:
                    action = "held"
                    why = "rollback failed" if q.get("rollback_failed") else "no last good revision"
                    note = (f"desired {rev7} quarantined ({why_q}); {why}: "
                            f"left stopped until a new commit changes it or --retry")
                events.append(ServiceEvent(name, action, revision, svc.content_hash(), note=note,
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
                 on_phase: HostPhase | None, gpu: GpuFacts | None = None):
        self.t, self.host, self.result = t, host, result
        self.records: dict[str, dict] = {n: dict(s.record) for n, s in facts.services.items() if s.record}
        self.dirty: set[str] = set()
        self.on_phase = on_phase
        self.gpu = gpu          # None or a host without nvidia-smi: restarts need no GPU gate

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
        gate = await gated_apply(self.t, plan, facts, self.host, self.gpu)
        applied_at = gate.applied_at
        since = applied_at or time.time()
        self.result.notes.extend(gate.notes)
        for name, why in gate.blocked.items():
            self.result.events.append(ServiceEvent(name, "blocked", plan.revision, specs[name].content_hash(),
                                                   note=why))
            self.result.worsen("failed", "GpuBusy", f"{name}: {why}")
        gated = {a.service for a in plan.actions if a.kind is Kind.RESTART} if self.gpu and self.gpu.has_nvidia_smi \
            else set()
        for name, rec in plan.records.items():
            # what was applied changes; last good and quarantine stay as this run knows them
            self.records[name] = {**self.records.get(name, {}), "hash": rec["hash"], "revision": rec["revision"]}
        for name in plan.dropped_records:
            self.records.pop(name, None)
        started = [a for a in plan.actions if a.kind in (Kind.START, Kind.RESTART) and a.service in specs
                   and a.service not in gate.blocked]

        async def one(kind: Kind, name: str) -> tuple[str, Outcome]:
            f = facts.services.get(name)
            # start (also a gated stop+start) resets NRestarts to 0; restart keeps it (SYSTEMD.md)
            fresh = kind is Kind.START or name in gated or f is None
            base = 0 if fresh else int(f.props.get("NRestarts", "0") or 0)
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
                         on_phase: HostPhase | None = None, hold: frozenset[str] = frozenset(),
                         quarantine: Mapping[str, dict] | None = None, transport: Transport | None = None,
                         facts: HostFacts | None = None, rules: RuleSet | None = None) -> HostResult:
    """Converge one host (or, with dry_run, only plan it). Never raises for host failures.

    For the fleet's passes: `hold` names services left exactly as they are in this pass (another
    pass, a rollout wave, takes care of them); `quarantine` adds fleet-wide quarantines
    (service -> record) that act like recorded ones and are written into the host's records;
    `transport` reuses an open connection (the caller closes it); `facts` skips observing.
    `rules`: run the pre-flight (rules against the model's real config.json, model presence,
    GPUs) before anything starts; a service that fails it is held, and nothing of it is written.
    """
    started = time.monotonic()
    result = HostResult(host.name, host.ssh.address, "in-sync")
    t: Transport | None = transport
    try:
        if t is None:
            t = await connect(host)
        if facts is None:
            facts = await observe(t, host)
        result.facts = facts
        fleet_q = {n: q for n, q in (quarantine or {}).items() if n in host.services and n not in hold}
        eff, targets, held, events = resolve_targets(host, facts, revision, render_at, retry, fleet_q)
        events = [e for e in events if e.service not in hold]
        hold = held | hold
        result.events.extend(events)
        plan = plan_host(eff, facts, revision, hold)
        gpu = None
        starting = {a.service for a in plan.actions if a.kind in (Kind.START, Kind.RESTART) and a.service}
        if rules is not None and starting:
            progress = (lambda svc, ph, el, to: on_phase(host.name, svc, ph, el, to)) if on_phase else None
            pf = await preflight_host(t, eff, starting, rules, progress, allow_fetch=not dry_run)
            gpu = pf.gpu
            result.notes.extend(pf.warnings)
            if pf.blocked:
                hold = hold | frozenset(pf.blocked)
                plan = plan_host(eff, facts, revision, hold)
                if not plan.changes:
                    plan = replace(plan, actions=())    # a blocked deploy writes nothing, not even the record
                for name, reasons in sorted(pf.blocked.items()):
                    note = "pre-flight blocked the deploy: " + " | ".join(reasons)
                    result.events.append(ServiceEvent(name, "blocked", revision, eff.services[name].content_hash(),
                                                      note=note))
                    result.worsen("failed", "PreflightFailed", f"{name}: " + " | ".join(reasons))
        result.plan = plan
        for e in events:
            result.worsen("quarantined" if e.action == "quarantined" else "failed",
                          "Quarantined" if e.action == "quarantined" else "QuarantinedNoRollback", e.note)
        if dry_run:
            if plan.changes:
                result.worsen("would-change")
        else:
            run = _HostRun(t, host, facts, result, on_phase, gpu)
            outcomes = await run.apply_and_watch(plan, facts, eff.services, unverified(eff, facts, hold))
            if plan.changes and result.status == "in-sync":
                result.status = "converged"
            for name, out in sorted(outcomes.items()):
                await _settle(run, name, out, targets[name], facts, render_at)
            for name, q in fleet_q.items():
                # Record a fleet-wide quarantine on the host (only for a service installed here:
                # a record is what puts a service in the inventory), so another controller and
                # the next run see it without the fleet having to derive it again.
                rec = run.records.get(name)
                if rec is not None:
                    want = live_quarantine(rec.get("quarantine"), q, host.services[name].content_hash())
                    if want is not None and want != rec.get("quarantine"):
                        run.update(name, quarantine=want)
            await write_records(t, {n: run.records[n] for n in run.dirty if n in run.records})
            result.running = {n: run.records.get(n, {}).get("revision") for n in host.services}
    except HostError as e:
        result.status, result.reason, result.message = "failed", e.reason, e.message
    except ReconcilerError as e:
        result.status, result.reason, result.message = "failed", "Failed", str(e)
    finally:
        if t is not None and transport is None:
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
        old_q = target.quarantine or prior.get("quarantine") or {}
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
                          on_phase: HostPhase | None = None, notifier: Notifier | None = None,
                          rules: RuleSet | None = None) -> FleetResult:
    """Reconcile every selected host (at most `concurrency` at once), rolling shared services
    out in waves; with dry_run, only survey and plan them (the waves included).

    hosts: the selected host names (None: all). notifier: where rollout events go (default:
    fleet.toml [notify], never on a dry run). rules: the pre-flight rule pack (None: no pre-flight).
    """
    if notifier is None and not dry_run and state.settings.notify is not None:
        notifier = Notifier(state.settings.notify)
    run = _FleetRun(state, connect, dry_run=dry_run, concurrency=concurrency or state.settings.concurrency,
                    selected=hosts, render_at=render_at, retry=retry, on_phase=on_phase, notifier=notifier,
                    rules=rules)
    return await run.run()


def select_hosts(state: DesiredState, names: list[str] | None, labels: list[str] | None) -> list[str] | None:
    """The hosts a run is limited to: any of `names` (--host) and, of those, the ones carrying
    every label KEY=VALUE (--label, repeatable: AND). None: no selector, every host.

    Raises SourceError (exit 1, nothing applied) for an unknown name, a malformed label or a
    selection that matches no host, so a typo never turns into "nothing to do".
    """
    if not names and not labels:
        return None
    unknown = sorted(set(names or []) - set(state.hosts))
    if unknown:
        raise SourceError(f"unknown host(s) {', '.join(unknown)} at {state.short} "
                          f"(known: {', '.join(sorted(state.hosts, key=natural_key))})")
    wanted: dict[str, str] = {}
    for item in labels or []:
        key, sep, value = item.partition("=")
        if not sep or not LABEL.match(key) or not LABEL.match(value):
            raise SourceError(f"--label expects KEY=VALUE (letters, digits, '_', '.', '-'), got {item!r}")
        if wanted.get(key, value) != value:
            raise SourceError(f"--label {key}= given twice with different values: no host can match both")
        wanted[key] = value
    chosen = [n for n, h in sorted(state.hosts.items(), key=lambda kv: natural_key(kv[0]))
              if (not names or n in names) and all(h.labels.get(k) == v for k, v in wanted.items())]
    if not chosen:
        have = sorted({f"{k}={v}" for h in state.hosts.values() for k, v in h.labels.items()})
        raise SourceError(f"no host matches {' '.join('--label ' + k + '=' + v for k, v in wanted.items())}"
                          + (f" among {', '.join(sorted(names or []))}" if names else "")
                          + f" at {state.short} (labels in use: {', '.join(have) or 'none'})")
    return chosen


# How bad a host status is, to merge the results of several passes on one host.
_RANK = {"in-sync": 0, "converged": 1, "would-change": 2, "quarantined": 3, "rolled-back": 4, "failed": 5}


def merge_plans(a: HostPlan | None, b: HostPlan | None) -> HostPlan | None:
    """Two passes' plans on one host as one (for reports): actions in the order they ran; a
    service's state is the one from the pass that did not hold it."""
    if a is None or b is None:
        return a or b
    states = dict(a.states)
    for name, st in b.states.items():
        if st is not State.HELD or name not in states:
            states[name] = st
    # Every pass ends by recording the revision: one such line says it.
    actions = a.actions + tuple(x for x in b.actions if x.kind is not Kind.RECORD or
                                not any(y.kind is Kind.RECORD for y in a.actions))
    return HostPlan(a.host, b.revision, tuple(sorted(actions, key=lambda x: ORDER[x.kind])), states,
                    {**a.records, **b.records}, a.dropped_records + b.dropped_records)


def merge_result(into: HostResult, r: HostResult) -> None:
    """Fold one pass's result into a host's result: the worst status wins; failures add up."""
    into.events.extend(r.events)
    into.notes.extend(n for n in r.notes if n not in into.notes)
    into.plan = merge_plans(into.plan, r.plan)
    into.running.update(r.running)
    into.facts = r.facts or into.facts
    into.seconds += r.seconds
    if _RANK[r.status] > _RANK[into.status]:
        into.status, into.reason, into.message = r.status, r.reason, r.message
    elif r.status == into.status and r.message and r.message != into.message and _RANK[r.status] >= 3:
        into.message = f"{into.message}; {r.message}" if into.message else r.message


def restarting(r: HostResult) -> set[str]:
    """Services a surveyed host would restart or start with their desired version (not those
    swapped for last good, which are repairs, not a rollout)."""
    if r.plan is None:
        return set()
    swapped = {e.service for e in r.events if e.action in ("quarantined", "held")}
    return set(r.plan.restarts) - swapped


class _FleetRun:
    """One fleet run: the open connections, the per-host results and locks, the rollouts."""

    def __init__(self, state: DesiredState, connect: Connector, *, dry_run: bool, concurrency: int,
                 selected: list[str] | None, render_at: RenderAt | None, retry: bool,
                 on_phase: HostPhase | None, notifier: Notifier | None, rules: RuleSet | None = None):
        self.state, self.connect, self.dry_run, self.rules = state, connect, dry_run, rules
        self.render_at, self.retry, self.on_phase, self.notifier = render_at, retry, on_phase, notifier
        self.sem = asyncio.Semaphore(concurrency)
        self.hosts = [h for n, h in sorted(state.hosts.items(), key=lambda kv: natural_key(kv[0]))
                      if selected is None or n in selected]
        self.transports: dict[str, Transport] = {}
        self.results: dict[str, HostResult] = {}
        self.locks = {h.name: asyncio.Lock() for h in self.hosts}
        self.fleet_q: dict[str, dict[str, dict]] = {}      # host -> service -> fleet-wide quarantine
        self.passed: set[str] = set()                      # hosts whose result is a pass's, not the survey's

    async def run(self) -> FleetResult:
        rollouts: list[RolloutResult] = []
        try:
            await asyncio.gather(*(self._survey(h) for h in self.hosts))
            if not self.retry:
                await self._apply_halts()
            restarts = {n: restarting(r) for n, r in self.results.items()}
            rollouts = [RolloutResult(p) for p in plan_rollouts(self.state, restarts)]
            if not self.dry_run:
                waved: dict[str, set[str]] = {}
                for ro in rollouts:
                    for h in ro.plan.pending:
                        waved.setdefault(h, set()).add(ro.plan.group.service)
                await asyncio.gather(
                    *(self._pass(h, hold=frozenset(waved.get(h.name, ())), fresh=False)
                      for h in self.hosts if h.name in self.transports),
                    *(self._rollout(ro) for ro in rollouts))
        finally:
            await asyncio.gather(*(self._close(t) for t in self.transports.values()))
        res = FleetResult(self.state.revision, self.dry_run, [self.results[h.name] for h in self.hosts],
                          rollouts)
        if self.notifier is not None:
            await asyncio.to_thread(self.notifier.close)
            res.warnings.extend(self.notifier.failures)
        return res

    @staticmethod
    async def _close(t: Transport) -> None:
        try:
            await t.close()
        except Exception:  # a connection that already broke has nothing left to close
            pass

    # -- survey --

    async def _survey(self, h: HostSpec) -> None:
        """Connect, observe and plan one host (a dry-run pass); keep the connection open."""
        async with self.sem:
            t0 = time.monotonic()
            try:
                t = await self.connect(h)
            except ReconcilerError as e:
                reason = e.reason if isinstance(e, HostError) else "Failed"
                message = e.message if isinstance(e, HostError) else str(e)
                self.results[h.name] = HostResult(h.name, h.ssh.address, "failed", reason=reason, message=message,
                                                  seconds=time.monotonic() - t0)
                return
            self.transports[h.name] = t
            r = await reconcile_host(h, self.state.revision, self.connect, dry_run=True, render_at=self.render_at,
                                     retry=self.retry, transport=t, rules=self.rules)
            self.results[h.name] = r
            if r.status == "failed" and r.plan is None:
                # It could not even be observed: report it, and leave it out of every pass.
                self.transports.pop(h.name, None)
                await self._close(t)

    async def _apply_halts(self) -> None:
        """Keep halted rollouts halted: extend each group's live halt to members that hold no
        record of it (rollout.quarantine_cover), and re-plan those members with it."""
        for key, members in group_members(self.state).items():
            svc = key.service
            desired, halts = {}, []
            for h in members:
                r = self.results.get(h)
                if r is None or r.facts is None:
                    continue
                want = self.state.hosts[h].services[svc].content_hash()
                f = r.facts.services.get(svc)
                q = live_quarantine((f.record or {}).get("quarantine") if f else None, None, want)
                if q is not None:
                    halts.append(Halt(h, q))
                elif svc in restarting(r):
                    desired[h] = want
            if not halts or not desired:
                continue
            for h, q in quarantine_cover(key, desired, halts, self.state.revision, self._hash_at).items():
                self.fleet_q.setdefault(h, {})[svc] = q
        for name, qs in self.fleet_q.items():
            host, old = self.state.hosts[name], self.results[name]
            r = await reconcile_host(host, self.state.revision, self.connect, dry_run=True, render_at=self.render_at,
                                     retry=self.retry, quarantine=qs, transport=self.transports[name],
                                     facts=old.facts, rules=self.rules)
            r.seconds += old.seconds
            self.results[name] = r

    def _hash_at(self, revision: str, host: str, service: str) -> str | None:
        spec = _service_at(self.render_at, revision, host, service)
        return spec.content_hash() if spec is not None else None

    # -- passes --

    async def _pass(self, h: HostSpec, *, hold: frozenset[str], fresh: bool,
                    quarantine: Mapping[str, dict] | None = None) -> HostResult:
        """One converge pass on one host, never two at once on it; folded into its result."""
        async with self.locks[h.name]:
            async with self.sem:
                t = self.transports[h.name]
                before = self.results[h.name]
                qs = {**self.fleet_q.get(h.name, {}), **(quarantine or {})}
                r = await reconcile_host(h, self.state.revision, self.connect, dry_run=False,
                                         render_at=self.render_at, retry=self.retry, on_phase=self.on_phase,
                                         hold=hold, quarantine=qs, transport=t, facts=None if fresh else before.facts,
                                         rules=self.rules)
            if h.name not in self.passed:
                # The survey's result was a plan, not an outcome: the first pass replaces it.
                self.passed.add(h.name)
                r.seconds += before.seconds
                self.results[h.name] = r
            else:
                merge_result(before, r)
            self._notify_failures(h.name, r)
            return r

    def _notify_failures(self, host: str, r: HostResult) -> None:
        if self.notifier is None:
            return
        for i, e in enumerate(r.events):
            if e.action != "deploy" or e.outcome is None or e.outcome.healthy:
                continue
            rb = next((x for x in r.events[i + 1:] if x.service == e.service and x.action == "rollback"), None)
            ok = rb is not None and rb.outcome is not None and rb.outcome.healthy
            self.notifier.send("rollback", host=host, service=e.service, revision=e.revision, short=e.revision[:7],
                               reason=e.outcome.reason, message=e.outcome.message, journal_line=e.outcome.quote,
                               result="rolled-back" if ok else "failed",
                               rolled_back_to=rb.revision if rb is not None and ok else None)

    # -- rollouts --

    async def _rollout(self, ro: RolloutResult) -> None:
        """Run one group's waves; halt at the first wave with a failure."""
        p, t0 = ro.plan, time.monotonic()
        svc = p.group.service
        ro.status = "running"
        self._send("rollout.start", ro, hosts=list(p.pending), waves=[w.to_json() for w in p.waves])
        by_name = {h.name: h for h in self.hosts}
        for wave in p.waves:
            others = {h: frozenset(by_name[h].services) - {svc} for h in wave.hosts}
            results = await asyncio.gather(*(self._pass(by_name[h], hold=others[h], fresh=True) for h in wave.hosts))
            failed: list[tuple[str, str, str, str | None]] = []     # host, reason, message, quote
            for h, r in zip(wave.hosts, results):
                bad = next((e.outcome for e in r.events if e.service == svc and e.action == "deploy"
                            and e.outcome is not None and not e.outcome.healthy), None)
                if bad is not None:
                    failed.append((h, bad.reason, bad.message, bad.quote))
                elif r.status == "failed" and r.plan is None:
                    ro.skipped += (h,)       # not observed: nothing was changed there, nothing to judge
                elif r.status == "failed":
                    failed.append((h, r.reason or "Failed", r.message or "", None))
            ro.waves_done = wave.number
            if failed:
                await self._halt(ro, wave, failed)
                ro.seconds = time.monotonic() - t0
                return
        ro.status = "done"
        ro.seconds = time.monotonic() - t0
        self._send("rollout.finish", ro, hosts=list(p.pending), seconds=round(ro.seconds, 2))

    async def _halt(self, ro: RolloutResult, wave: Wave, failed: list[tuple[str, str, str, str | None]]) -> None:
        """Stop the group: quarantine this revision's content of the service on the failed hosts
        (marking where it halted) and on every host of the later waves, which stay untouched."""
        p, svc, rev = ro.plan, ro.plan.group.service, self.state.revision
        host, reason, message, quote = failed[0]
        ro.status, ro.halted_at, ro.halted_wave = "halted", host, wave.number
        ro.reason, ro.message, ro.quote = reason, message, quote
        ro.untouched = p.after(wave)
        base = {"revision": rev, "reason": "RolloutHalted", "halted_at": host, "canary": wave.canary,
                "wave": wave.number, "cause": reason, "quote": quote, "at": int(time.time())}
        by_name = {h.name: h for h in self.hosts}
        where = halt_where(host, wave.canary, wave.number)
        left = f"{len(ro.untouched)} host{'s' * (len(ro.untouched) != 1)} left untouched"

        async def mark(name: str, is_failed: bool) -> None:
            spec = by_name[name]
            q = {**base, "hash": spec.services[svc].content_hash()}
            if is_failed:
                q["reason"] = reason     # its own failure (a recorded quarantine, if any, wins anyway)
            hold = frozenset(spec.services) - {svc}
            r = await self._pass(spec, hold=hold, fresh=True, quarantine={svc: q})
            res = self.results[name]
            if is_failed:
                res.message = (res.message + "; " if res.message else "") + f"rollout halted here, {left}"
            elif r.status == "quarantined" and r.message and res.message and r.message in res.message:
                # Say it in the rollout's words; the journal line is in the event (status shows
                # it as the quote), not repeated here. Other services' messages stay.
                res.reason = "RolloutHalted" if res.reason == "Quarantined" else res.reason
                res.message = res.message.replace(
                    r.message, f"{svc}: rollout halted at {where}: {reason}; not restarted, "
                               f"still running {str(res.running.get(svc) or '?')[:7]}")

        await asyncio.gather(*(mark(h, True) for h, *_ in failed), *(mark(h, False) for h in ro.untouched))
        self._send("rollout.halt", ro, host=host, wave=wave.number, in_canary=wave.canary, reason=reason,
                   message=message, journal_line=quote, untouched=list(ro.untouched),
                   failed=[h for h, *_ in failed])

    def _send(self, event: str, ro: RolloutResult, **fields: object) -> None:
        if self.notifier is not None:
            p = ro.plan
            self.notifier.send(event, service=p.group.service, definition=p.group.definition,
                               revision=self.state.revision, short=self.state.revision[:7],
                               policy={"canary": p.policy.canary, "max_unavailable": p.policy.max_unavailable,
                                       "bound": p.bound}, **fields)
