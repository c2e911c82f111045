"""PURE: the actions for each state: `plan_host` sorts every service into its State
(state.classify) and picks that state's actions, in execution order (model.Kind)."""

from __future__ import annotations

from ..desired.spec import HostSpec, ServiceSpec
from ..values import replace
from .confirm import Previous, arm, unit_name
from .facts import HostFacts, ServiceFacts
from .files import (
    describe_secret_changes,
    has_install,
    needs_reload,
    own_files,
    parse_env,
    parse_env_file,
    secret_versions,
    unified_diff,
)
from .gpuhealth import GpuFault, in_force
from .layout import adopted_copy, env_path, envfile_path, secrets_path, unit_path
from .model import ORDER, Action, Context, HostPlan, Kind, Reason, ServicePlan, State, Target, Watch
from .records import Adopted, Pending, Result, ServiceRecord
from .rejoin import rejoins
from .state import Sync, blocked_plan, blocks_of, classify, is_up, live_quarantine, sync_with
from .unit import UnitState


class _Builder:
    """Collects one host's actions while the per-state rules run."""

    def __init__(self, host: HostSpec, facts: HostFacts, ctx: Context):
        self.host, self.facts, self.ctx = host, facts, ctx
        self.short = ctx.revision[:7]
        self.actions: list[Action] = []
        self.reload = False

    def add(self, kind: Kind, reason: Reason, service: str | None = None, **kw: object) -> None:
        self.actions.append(Action(kind, reason, service, **kw))  # type: ignore[arg-type]

    def hold(self, sp: ServicePlan, reason: Reason, f: ServiceFacts | None) -> None:
        """Leave a service as it is (stopped when it must not run), and say why."""
        self.add(Kind.HOLD, reason, sp.name, detail=sp.note)
        rec = f.record if f is not None else None
        if reason is Reason.HOLD_STOPPED and rec is not None and rec.pending is not None:
            self.add(Kind.DISARM, reason, sp.name, detail="its deploy's dead-man's switch")
        if reason is Reason.HOLD_STOPPED and f is not None and (f.running or f.active_state == "failed"):
            self.add(Kind.STOP, reason, sp.name, detail="quarantined with nothing to roll back to: stop it")

    def base_record(self, name: str, f: ServiceFacts | None) -> ServiceRecord:
        """The service's record as this run knows it: the observed one, with a fleet-wide
        quarantine (a halted rollout) merged in, so every record written carries it."""
        rec = (f.record if f is not None else None) or ServiceRecord()
        fleet = self.ctx.fleet_quarantine.get(name)
        if fleet is None or self.ctx.retry or name not in self.host.services:
            return rec
        want = live_quarantine(rec.quarantine, fleet, self.host.services[name].content_hash())
        return replace(rec, quarantine=want) if want is not None else rec

    def record_quarantine(self, sp: ServicePlan, f: ServiceFacts | None) -> None:
        """Persist a fleet-wide quarantine (a halted rollout) in the record of an installed service,
        so another controller and the next run see it without deriving it again. (A plan that
        also deploys the service writes it with the intent, before anything else.)"""
        rec = f.record if f is not None else None
        merged = self.base_record(sp.name, f)
        if rec is not None and merged.quarantine is not None and merged.quarantine != rec.quarantine:
            self.add(Kind.RECORD, Reason.QUARANTINE, sp.name, record=merged,
                     detail=f"record the quarantine of {merged.quarantine.revision[:7]}")

    def converge(self, sp: ServicePlan, f: ServiceFacts | None) -> None:
        """Bring one service to its target version: write, restart, watch (any state with a target)."""
        target = sp.target
        assert target is not None
        s = sync_with(target, f, self.facts.secret_files)
        why_sub = f"substitute last good {target.revision[:7]}: {sp.note}" if target.rollback else ""
        for path, have, want in s.moved_env:
            assert want is not None
            self.add(Kind.WRITE, Reason.ENV_CHANGED, sp.name, path=path, content=want,
                     diff=unified_diff(path, have, want, self.host.name, target.revision[:7]),
                     detail=f"env moved to {envfile_path(sp.name)}, same values: no restart")
            self.reload = True
        if self._nothing_to_apply(sp, target, f, s, why_sub):
            return
        fetch = self.ctx.checks.fetch.get(sp.name)
        if fetch is not None and not target.rollback:
            m = fetch.model
            self.add(Kind.FETCH, Reason.FETCH_MODEL, sp.name, model=m,
                     detail=f"fetch {m.id} into {m.path} first ({m.fetch})")
        rec = self._intent(sp, target, f, s)
        self._files(sp, target, f, s, why_sub)
        self._start(sp, target, f, s, rec, why_sub)

    def _nothing_to_apply(self, sp: ServicePlan, target: Target, f: ServiceFacts | None, s: Sync,
                          why_sub: str) -> bool:
        """The target's files are in place and it runs: at most a re-verify (and an enable)."""
        if s.pending is not None and s.pending.started and not s.files_differ:
            if s.pending.unjudged is not None and not is_up(f):
                return False          # its last watch came to no verdict and it is not up: start it again
            self.add(Kind.WATCH, Reason.REVERIFY, sp.name,
                     watch=self._watch(target, f, reverify=True, since=s.pending.at),
                     detail=why_sub or f"deployed {target.revision[:7]} has no verdict yet: watch it again")
            return True
        if s.pending is None and not s.files_differ and s.applied and s.running:
            if not s.verified and not target.rollback:
                self.add(Kind.WATCH, Reason.REVERIFY, sp.name, watch=self._watch(target, f, reverify=True),
                         detail=f"applied {target.revision[:7]} was never seen healthy: watch it again")
            self._enable(target.spec, f)
            return True
        return False

    def _intent(self, sp: ServicePlan, target: Target, f: ServiceFacts | None, s: Sync) -> ServiceRecord:
        """Record what is about to be deployed before anything changes; returns the record the
        later steps build on (with the adopted originals named, for an adoption)."""
        rec = self.base_record(sp.name, f)
        if sp.state is State.ADOPT and f is not None:
            # Durable first: the intent names the originals (the unit and its drop-ins) before
            # anything is copied or replaced; they are put back when the service leaves git.
            files = ((unit_path(sp.name),) if f.unit_text is not None else ()) + tuple(
                p for p in sorted(f.dropins) if p not in own_files(sp.name))
            rec = replace(rec, adopted=Adopted(files=files, was_enabled=f.enabled, was_active=f.running,
                                               fragment=f.foreign_path(),
                                               masked=f.unit.load_state == "masked"))
        replaces = (s.pending.replaces_hash, s.pending.replaces_revision) if s.pending else (rec.hash, rec.revision)
        tried = s.pending if s.pending is not None and not self.ctx.retry else None
        pending = Pending(hash=target.hash, revision=target.revision, rollback=target.rollback,
                          replaces_hash=replaces[0], replaces_revision=replaces[1],
                          unjudged=tried.unjudged if tried else None, attempts=tried.attempts if tried else 0)
        if s.files_differ or not s.applied or s.pending is not None:
            self.add(Kind.INTENT, Reason.RECORD, sp.name, record=replace(rec, pending=pending),
                     detail=f"pending {target.revision[:7]}")
        if sp.state is State.ADOPT and rec.adopted is not None:
            for path in rec.adopted.files:
                self.add(Kind.ADOPT, Reason.ADOPT, sp.name, path=path, detail=f"keep the original {path}")
        return replace(rec, pending=pending)

    def _files(self, sp: ServicePlan, target: Target, f: ServiceFacts | None, s: Sync, why_sub: str) -> None:
        """Write what differs, remove what must not be there (foreign drop-ins kept aside)."""
        short = target.revision[:7]
        for path, have, want in s.files:
            diff = unified_diff(path, have, want, self.host.name, short)
            if want is None:
                gone = "no secrets any more" if path == secrets_path(sp.name) else "env no longer set"
                self.add(Kind.REMOVE, Reason.ENV_CHANGED, sp.name, path=path, diff=diff, detail=why_sub or gone)
            else:
                reason, detail = self._write_reason(sp.state, path, have, target.spec)
                self.add(Kind.WRITE, reason, sp.name, path=path, content=want, diff=diff, detail=why_sub or detail)
        for path, content in s.dropins:
            self.add(Kind.REMOVE, Reason.FOREIGN_DROPIN, sp.name, path=path,
                     diff=unified_diff(path, content, None, self.host.name, short),
                     detail="drop-in not written by the reconciler (a copy is kept under "
                            "/var/lib/reconciler/removed/); list it in allow_dropins to keep it")
        if s.secrets:
            self.add(Kind.SECRETS, Reason.SECRET_CHANGED, sp.name, secrets=target.spec.secrets,
                     detail=why_sub or describe_secret_changes(s.secrets))
        self.reload |= any(needs_reload(p) for p, _, _ in s.files) or bool(s.dropins) \
            or (f is not None and f.unit.need_daemon_reload)

    def _start(self, sp: ServicePlan, target: Target, f: ServiceFacts | None, s: Sync, rec: ServiceRecord,
               why_sub: str) -> None:
        """(Re)start it (through the GPU gate on a GPU host), record it started, watch it."""
        assert rec.pending is not None
        reason, detail = self._start_reason(sp, s, why_sub)
        gated = self.ctx.checks.gpu_gate
        if gated:
            if s.running:
                self.add(Kind.STOP, Reason.GPU_GATE, sp.name, detail="stop first, start when its GPUs are free")
            if target.spec.gpu_policy == "kill":
                self.add(Kind.KILL_STRAYS, Reason.GPU_GATE, sp.name,
                         detail='kill what else holds the GPUs it claims, after the stop (gpu_policy = "kill")')
            self.add(Kind.WAIT_GPUS, Reason.GPU_GATE, sp.name, detail="wait until the GPUs it claims are released")
        self._arm(sp, target, f, s, rec)
        fresh = f is not None and f.unit.load_state == "not-found" and f.unit.active_state == "inactive"
        self.add(Kind.RESTART if s.running and not gated else Kind.START, reason, sp.name, detail=detail,
                 fresh=fresh)
        self._enable(target.spec, f)
        versions = {n: v for n, v in secret_versions(target.spec, self.facts.secret_files).items() if v}
        started = replace(rec, hash=target.hash, revision=target.revision, secrets=versions,
                          pending=replace(rec.pending, started=True))
        self.add(Kind.RECORD, Reason.RECORD, sp.name, record=started, detail=f"started {target.revision[:7]}")
        self.add(Kind.WATCH, Reason.SUBSTITUTE if target.rollback else Reason.HEALTH, sp.name,
                 watch=self._watch(target, f, fresh=not s.running or gated),
                 detail=why_sub or f"until healthy (start-up timeout {target.spec.health.startup_timeout:.0f}s)")

    def gate_closed(self, sp: ServicePlan, target: Target, f: ServiceFacts | None, why: str) -> None:
        """Its GPUs stayed busy after this run stopped it (the gate's answer, Checks.gate): it was
        not started. Its record says so (pending, not started, and why), so the next run applies
        it again through the gate."""
        rec = self.base_record(sp.name, f)
        pending = rec.pending or Pending(hash=target.hash, revision=target.revision, rollback=target.rollback,
                                         replaces_hash=rec.hash, replaces_revision=rec.revision)
        blocked = replace(pending, started=False, blocked=why)
        if blocked != rec.pending:
            self.add(Kind.RECORD, Reason.GPU_BUSY, sp.name, record=replace(rec, pending=blocked),
                     detail=f"not started: {why}")

    def _arm(self, sp: ServicePlan, target: Target, f: ServiceFacts | None, s: Sync, rec: ServiceRecord) -> None:
        """Arm the deploy's dead-man's switch (not for a rollback: the last good is what it would
        restore). It restores what runs now when that is the verified version, else it stops."""
        if target.rollback or self.ctx.confirm_margin is None:
            return
        h = target.spec.health
        window = int(h.startup_timeout + h.stable_for + self.ctx.confirm_margin)
        previous = None
        if (f is not None and f.unit_text is not None and rec.hash and rec.hash == rec.last_good_hash
                and rec.last_good_revision and sp.state is not State.DRIFTED and not s.dropins):
            previous = Previous(rec.last_good_revision, f.unit_text, f.env_text, envfile_text=f.envfile_text,
                                secrets_text=f.dropins.get(secrets_path(sp.name)), secrets_replaced=bool(s.secrets))
        sw = arm(sp.name, revision=target.revision, new_hash=target.hash, window=window, record=rec,
                 previous=previous)
        what = f"roll back to {sw.restores[:7]}" if sw.restores else "stop it"
        self.add(Kind.ARM, Reason.CONFIRM, sp.name, switch=sw,
                 detail=f"dead-man's switch: {what} {window}s after the controller goes, unless it confirmed")
        # A transient timer (confirm.py), made by the lock's holder if the controller goes:
        # nothing to reset, even after a switch fired.
        self.add(Kind.ARM_TIMER, Reason.CONFIRM, sp.name, switch=sw,
                 detail=f"{unit_name(sp.name)}.timer, if the controller goes")

    def _start_reason(self, sp: ServicePlan, s: Sync, why_sub: str) -> tuple[Reason, str]:
        if why_sub:
            return Reason.SUBSTITUTE, why_sub
        if sp.state is State.NEW:
            return Reason.NEW_SERVICE, "new service"
        if sp.state is State.ADOPT:
            return Reason.ADOPT, sp.note
        if s.pending is not None and s.pending.started and s.pending.unjudged is not None:
            return Reason.START_AGAIN, f"no verdict on {s.pending.revision[:7]} ({s.pending.unjudged}): start it again"
        if s.pending is not None:
            return Reason.INTERRUPTED, f"the deploy of {s.pending.revision[:7]} was cut short: start it again"
        if not s.running:
            return Reason.NOT_RUNNING, "not running"
        if s.files or s.dropins:
            return Reason.UNIT_CHANGED, "unit or env changed"
        if s.secrets:
            return Reason.SECRET_CHANGED, describe_secret_changes(s.secrets)
        return Reason.STALE_PROCESS, "running process predates the applied files"

    def _write_reason(self, state: State, path: str, old: str | None, svc: ServiceSpec) -> tuple[Reason, str]:
        if old is None:
            return Reason.NEW_SERVICE, "new file"
        if state is State.DRIFTED:
            return Reason.DRIFT, "drift: edited on the host, reverting to the revision"
        if path == secrets_path(svc.name):
            return Reason.SECRET_CHANGED, "which secrets it gets, or how"
        if path == envfile_path(svc.name):
            before, after = parse_env_file(old), dict(svc.env)
            keys = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
            return Reason.ENV_CHANGED, f"env changed: {', '.join(keys)}" if keys else "env file changed"
        if path.endswith(".conf"):
            return Reason.ENV_CHANGED, (f"env now read from {envfile_path(svc.name)}" if parse_env(old)
                                        else "env drop-in changed")
        return Reason.UNIT_CHANGED, "unit changed in the revision"

    def _enable(self, spec: ServiceSpec, f: ServiceFacts | None) -> None:
        if has_install(spec.unit_text) and (f is None or not f.enabled):
            self.add(Kind.ENABLE, Reason.START_AT_BOOT, spec.name, detail="start at boot ([Install] section)")

    @staticmethod
    def _watch(target: Target, f: ServiceFacts | None, *, fresh: bool = False, reverify: bool = False,
               since: int | None = None) -> Watch:
        u = f.unit if f is not None else UnitState()
        # A start (also a gated stop + start) resets NRestarts to 0; a restart keeps counting
        # (systemd.service(5), NRestarts=). A re-verify judges from what runs now.
        return Watch(hash=target.hash, revision=target.revision, rollback=target.rollback,
                     baseline_restarts=0 if fresh else u.n_restarts,
                     baseline_invocation="" if reverify else u.invocation_id,
                     baseline_active_enter="" if reverify else u.active_enter or "",
                     reverify=reverify, since=since)

    def orphan(self, name: str, f: ServiceFacts) -> None:
        """A service in the inventory that left the desired state: remove it, or put back what
        was there before it was adopted."""
        rec = f.record or ServiceRecord()
        why = "removed from the desired state"
        if rec.pending is not None:
            self.add(Kind.DISARM, Reason.REMOVED, name, detail="its deploy's dead-man's switch")
        if f.running or f.active_state == "failed":
            self.add(Kind.STOP, Reason.REMOVED, name, detail=why)
        if f.enabled:
            self.add(Kind.DISABLE, Reason.REMOVED, name, detail=why)
        for path, have in ((unit_path(name), f.unit_text), (env_path(name), f.env_text),
                           (envfile_path(name), f.envfile_text),
                           (secrets_path(name), f.dropins.get(secrets_path(name)))):
            if have is not None:
                self.add(Kind.REMOVE, Reason.REMOVED, name, path=path, detail=why,
                         diff=unified_diff(path, have, None, self.host.name, self.short))
                self.reload |= needs_reload(path)
        if rec.secrets:
            self.add(Kind.SECRETS, Reason.REMOVED, name, detail=f"{why}: delete its delivered secrets")
        if rec.adopted is not None:
            for path in rec.adopted.files:
                self.add(Kind.RESTORE, Reason.RESTORE, name, path=path,
                         detail=f"{why}: put back the original it replaced (kept at {adopted_copy(name, path)})")
            if rec.adopted.masked:
                self.add(Kind.RESTORE, Reason.RESTORE_MASK, name, path=unit_path(name),
                         detail=f"{why}: it was masked before it was adopted; mask it again")
            self.reload = True
            if rec.adopted.was_enabled:
                self.add(Kind.ENABLE, Reason.RESTORE, name, detail="the original was enabled")
            if rec.adopted.was_active:
                self.add(Kind.START, Reason.RESTORE, name, detail="the original was running")


# The hold marker each state without a plain target gets (actionForState's first half).
_HOLDS = {State.QUARANTINED_NO_GOOD: Reason.HOLD_STOPPED, State.ROLLBACK_FAILED: Reason.HOLD_STOPPED,
          State.HALTED: Reason.HOLD_HALTED, State.FOREIGN: Reason.FOREIGN, State.BLOCKED: Reason.BLOCKED,
          State.QUARANTINED: Reason.HOLD_LAST_GOOD, State.INCONCLUSIVE: Reason.HOLD_UNJUDGED}
# States whose live quarantine this run must make durable on the host.
_RECORDS_QUARANTINE = frozenset({State.QUARANTINED_NO_GOOD, State.ROLLBACK_FAILED, State.HALTED, State.QUARANTINED})


def _service_plan(b: _Builder, svc: ServiceSpec, f: ServiceFacts | None, gpu: GpuFault | None) -> ServicePlan:
    """One service's state (classify), Blocked when something keeps it from (re)starting
    (state.blocks_of); a start the GPU gate kept from happening earlier in this run is recorded."""
    ctx, observed = b.ctx, b.facts.secret_files
    sp = classify(svc.name, svc, f, b.host.name, ctx, observed)
    blocks = blocks_of(sp, ctx, observed, gpu)
    if not blocks or sp.target is None or sp.state is State.IN_SYNC:
        return sp
    if sp.name in ctx.checks.gate:
        b.gate_closed(sp, sp.target, f, ctx.checks.gate[sp.name])
    return blocked_plan(sp, blocks, gpu.quote if gpu is not None else None)


def _orphans(b: _Builder, facts: HostFacts, services: dict[str, ServicePlan]) -> list[str]:
    """Services in the inventory that left the desired state: removed (returned), or kept while
    a service on the host is blocked (a rename whose new service is refused must not leave
    neither running: the old one goes once the deploy that replaces it is let through)."""
    blocked = sorted(n for n, sp in services.items() if sp.state is State.BLOCKED)
    dropped: list[str] = []
    for name in sorted(facts.inventory - set(b.host.services) - b.ctx.deferred):
        if blocked:
            note = f"removed from the desired state; kept while {', '.join(blocked)} is blocked"
            services[name] = ServicePlan(name, State.ORPHAN, result=Result.IN_SYNC, note=note)
            b.add(Kind.HOLD, Reason.KEEP_ORPHAN, name, detail=note)
            continue
        services[name] = ServicePlan(name, State.ORPHAN, result=Result.CONVERGED)
        dropped.append(name)
        b.orphan(name, facts.services[name])
    return dropped


def plan_host(desired: HostSpec, facts: HostFacts, ctx: Context) -> HostPlan:
    """Compute the actions that converge one host to `desired` at `ctx.revision` (pure)."""
    b = _Builder(desired, facts, ctx)
    services: dict[str, ServicePlan] = {}
    gpu = in_force(facts.gpu_fault, ctx.checks.gpu_health, retry=ctx.retry)
    for name, svc in sorted(desired.services.items()):
        f = facts.services.get(name)
        sp = services[name] = _service_plan(b, svc, f, gpu)
        if sp.state in _HOLDS:
            b.hold(sp, _HOLDS[sp.state], f)
        if sp.state in _RECORDS_QUARANTINE:
            b.record_quarantine(sp, f)
        if sp.target is not None and sp.state is not State.BLOCKED:
            b.converge(sp, f)
    dropped = _orphans(b, facts, services)
    b.actions += rejoins(services, facts.services, b.actions, ctx.deferred)   # a leave a killed run left
    for path in facts.stale_temps:
        b.add(Kind.REMOVE, Reason.STALE_TEMP, path=path,
              detail="temp file an interrupted run left (removed under the host lock)")
    if b.reload:
        b.add(Kind.DAEMON_RELOAD, Reason.RELOAD, detail="unit files changed on disk")
    host_rev = facts.record.applied_revision if facts.record else None
    blocked = any(sp.state is State.BLOCKED for sp in services.values())
    # A revision is recorded as applied when something was applied, or when nothing at it was
    # refused: a blocked deploy writes nothing at all, not even the record.
    # A closed GPU gate stopped a start after its files were applied: that revision is on the host.
    if any(a.kind.mutating for a in b.actions) or dropped or (host_rev != ctx.revision and not blocked) \
            or ctx.checks.gate:
        b.add(Kind.RECORD, Reason.RECORD, detail=f"record revision {b.short} and the inventory")
    actions = sorted(b.actions, key=lambda a: ORDER[a.kind])
    return HostPlan(desired.name, ctx.revision, tuple(actions), services, tuple(dropped))


def starting(plan: HostPlan) -> dict[str, Target]:
    """Services the plan starts or restarts, with the version they start as."""
    out: dict[str, Target] = {}
    for a in plan.actions:
        if a.kind in (Kind.START, Kind.RESTART) and a.service and a.reason is not Reason.RESTORE:
            sp = plan.services.get(a.service)
            if sp is not None and sp.target is not None:
                out[a.service] = sp.target
    return out
