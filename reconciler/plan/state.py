"""PURE: desired state x observed facts x the host's records -> the actions for one host.

No I/O, no clock, no globals. Like Flux's helm-controller, every service is first sorted into
one `State` (`classify`), and its actions are then chosen from that state alone
(`actions.plan_host`). Every decision after a failure lives here too: substituting the last good
version, holding a service stopped, re-verifying a deploy whose verdict was lost, recording a
fleet-wide quarantine, the model fetch and the GPU-gated restart are all actions with a typed
`Reason`, so `--dry-run` shows each of them.

    state                  actions
    New                    [fetch] intent, write, reload, [wait GPUs], enable, start, record, watch
    Changed / Drifted      [fetch] intent, write/remove, reload, restart (or stop, wait GPUs,
                           start), record, watch
    Stopped                [wait GPUs] start, record, watch
    Pending                watch again (re-verify); re-apply first if the deploy was cut short
    InSync                 nothing (enable when the unit wants it)
    Quarantined            converge to the last good version (reason SubstituteLastGood), or
                           nothing when it already runs there; a hold marker either way
    QuarantinedNoLastGood  stop it if it runs; hold
    RollbackFailed         stop it if it runs; hold
    RolloutHalted          nothing: a halted rollout never reached it (the halt is recorded)
    Adopt                  keep the original, then as Changed
    Foreign                nothing: a unit the reconciler did not install
    Blocked                nothing: pre-flight or systemd refused it (nothing is written)
    Deferred               nothing in this pass: a rollout wave converges it
    Orphan                 stop, disable, remove (or put an adopted original back)
    Inconclusive           nothing: MAX_UNJUDGED watches of the deploy came to no verdict (systemd
                           could not start its process, or refused its starts); not quarantined

A deploy whose watch came to no verdict (`Pending.unjudged`) is started again when it is not up
(reason StartAgain), or watched again when systemd brought it up by itself. Files a killed run
left half-made (`.reconciler-tmp.*`) are removed under the host lock (reason StaleTempFile).

What happens after a health verdict is `records.judge` (pure as well): the verdict is recorded
at once, and the next plan on fresh facts picks the rollback or the hold from the new state.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from ..desired.spec import HostSpec, ServiceSpec
from .facts import HostFacts, ServiceFacts
from .files import desired_files, foreign_dropins, legacy_env_dropin, secret_blocks, secret_changes
from .gpuhealth import GpuFault
from .layout import env_path, envfile_path
from .model import Block, Context, ModelFetch, Reason, ServicePlan, State, Target
from .records import MAX_UNJUDGED, Pending, Quarantine, Result, ServiceRecord


def live_quarantine(recorded: Quarantine | None, fleet: Quarantine | None, want: str) -> Quarantine | None:
    """The quarantine in force for a service whose desired content hash is `want`: the one
    recorded on the host, the fleet-wide one (a halted rollout), or both merged (the record wins,
    the fleet fills in what it lacks, e.g. where the rollout halted). None when neither matches."""
    rec = recorded if recorded is not None and recorded.hash == want else None
    flt = fleet if fleet is not None and fleet.hash == want else None
    return rec.merged(flt) if rec is not None else flt


class Sync(msgspec.Struct, frozen=True):
    """How the host compares with one target version of a service."""

    files: tuple[tuple[str, str | None, str | None], ...]   # (path, have, want) that differ
    dropins: tuple[tuple[str, str], ...]                     # foreign drop-ins to remove
    secrets: tuple[tuple[str, str], ...]                     # (NAME, what) to deliver again
    applied: bool          # the record says this version's files were applied
    running: bool
    pending: Pending | None  # an unfinished deploy of exactly this version
    verified: bool         # this version passed health here
    # The env as Environment= lines of exactly the desired values, where the env file should be:
    # the files move (write, daemon-reload), the process, which has that env already, stays.
    moved_env: tuple[tuple[str, str | None, str | None], ...] = ()

    @property
    def files_differ(self) -> bool:
        return bool(self.files or self.dropins or self.secrets)

    @property
    def drifted(self) -> bool:
        """What differs is a change on the host (not only a secret rotated or added in git)."""
        return bool(self.files or self.dropins) or any(w == "missing on the host" for _, w in self.secrets)


def _have(f: ServiceFacts | None, path: str) -> str | None:
    if f is None:
        return None
    if path.endswith(".service"):
        return f.unit_text
    if path == envfile_path(f.name):
        return f.envfile_text
    return f.env_text if path == env_path(f.name) else f.dropins.get(path)


def sync_with(target: Target, f: ServiceFacts | None, observed: Mapping[str, str | None]) -> Sync:
    rec = (f.record if f else None) or ServiceRecord()
    files = [(path, have, want) for path, want in desired_files(target.spec).items()
             if (have := _have(f, path)) != want]
    pending = rec.pending if rec.pending is not None and rec.pending.hash == target.hash else None
    moved: list[tuple[str, str | None, str | None]] = []
    env_files = {env_path(target.spec.name), envfile_path(target.spec.name)}
    if f is not None and files and {p for p, _, _ in files} <= env_files and f.envfile_text is None \
            and target.spec.env and f.env_text == legacy_env_dropin(target.spec.env):
        moved, files = files, []
    return Sync(files=tuple(files), moved_env=tuple(moved), dropins=tuple(foreign_dropins(target.spec, f).items()),
                 secrets=secret_changes(target.spec, rec, observed),
                 applied=rec.hash == target.hash, running=f is not None and f.running, pending=pending,
                 verified=rec.last_good_hash == target.hash)


def is_up(f: ServiceFacts | None) -> bool:
    """Up, or on its way up by a start job: not failed, stopped, or waiting out a restart."""
    return f is not None and f.unit.up


def _absent(f: ServiceFacts | None) -> bool:
    return f is None or (f.unit_text is None and f.env_text is None and f.envfile_text is None and not f.managed)


def _sync_state(s: Sync, f: ServiceFacts | None) -> State:
    """The state of a desired (not substituted) version from the file comparison."""
    if _absent(f):
        return State.NEW
    if s.pending is not None:
        return State.PENDING
    if s.files_differ:
        return State.DRIFTED if s.applied and s.drifted else State.CHANGED
    if not s.applied:
        return State.CHANGED          # files match but the running process may predate them
    if not s.running:
        return State.STOPPED
    if not s.verified:
        return State.PENDING          # applied, never judged (a record from before pending existed)
    return State.IN_SYNC


def classify(name: str, svc: ServiceSpec, f: ServiceFacts | None, host: str,
             ctx: Context, observed: Mapping[str, str | None] | None = None) -> ServicePlan:
    """Sort one desired service into its State (Flux's DetermineReleaseState); pick its target."""
    if name in ctx.deferred:
        return ServicePlan(name, State.DEFERRED)
    rec = (f.record if f else None) or ServiceRecord()
    foreign = f.foreign_path() if f is not None else None
    if foreign is not None and not svc.adopt:
        return ServicePlan(name, State.FOREIGN, result=Result.FAILED, reason=Reason.FOREIGN,
                           note=f"{foreign} was not installed by the reconciler: left untouched "
                                f"(set adopt = true on the service to take it over)")
    desired = Target(svc, ctx.revision)
    q = None if ctx.retry else live_quarantine(rec.quarantine, ctx.fleet_quarantine.get(name), svc.content_hash())
    if q is not None:
        rev7 = q.revision[:7] or "?"
        why = q.why(host)
        if q.rollback_failed:
            return ServicePlan(name, State.ROLLBACK_FAILED, result=Result.FAILED, reason=Reason.ROLLBACK_FAILED,
                               note=f"desired {rev7} quarantined ({why}); its rollback failed too: left stopped "
                                    f"until a new commit changes it or --retry", quote=q.quote)
        good = ctx.last_good.get(name)
        if good is not None and rec.last_good_revision and rec.last_good_hash == good.content_hash() \
                and good.content_hash() != svc.content_hash():
            target = Target(good, rec.last_good_revision, rollback=True)
            return ServicePlan(name, State.QUARANTINED, target, result=Result.QUARANTINED, reason=Reason.QUARANTINED,
                               note=f"desired {rev7} quarantined ({why}), running {rec.last_good_revision[:7]}",
                               quote=q.quote)
        if q.halted_at and q.halted_at != host:
            return ServicePlan(name, State.HALTED, result=Result.QUARANTINED, reason=Reason.ROLLOUT_HALTED,
                               note=f"desired {rev7} quarantined ({why}); left as it is until a new commit "
                                    f"changes it or --retry", quote=q.quote)
        good_rev = rec.last_good_revision
        what = f"last good {good_rev[:7]} cannot be rendered" if good_rev else "first deploy failed"
        return ServicePlan(name, State.QUARANTINED_NO_GOOD, result=Result.FAILED, reason=Reason.NO_ROLLBACK,
                           note=f"desired {rev7} quarantined ({why}); {what}: left stopped until a new commit "
                                f"changes it or --retry", quote=q.quote, first_deploy=not good_rev)
    pend = rec.pending
    if (pend is not None and pend.hash == desired.hash and pend.started and pend.unjudged is not None
            and pend.attempts >= MAX_UNJUDGED and not ctx.retry):
        return ServicePlan(name, State.INCONCLUSIVE, result=Result.FAILED, reason=Reason.INCONCLUSIVE,
                           note=f"no verdict on {pend.revision[:7]} after {pend.attempts} tries ({pend.unjudged}); "
                                f"not quarantined: left as it is until a new commit changes it or --retry")
    if foreign is not None:
        return ServicePlan(name, State.ADOPT, desired, result=Result.CONVERGED,
                           note=f"adopting {foreign} (the original is kept and put back when the service "
                                f"leaves the desired state)")
    s = sync_with(desired, f, observed or {})
    state = _sync_state(s, f)
    in_sync = state is State.IN_SYNC and not s.moved_env
    return ServicePlan(name, state, desired, result=Result.IN_SYNC if in_sync else Result.CONVERGED)


def fetch_refused(fetch: ModelFetch) -> str | None:
    """PURE: why a model's fetch may not run (None: it may): the file system it goes to has less
    room than the model needs (model.size_gb, else its index's total_size; unknown: it runs)."""
    m = fetch.model
    need = m.size_gb * 1e9 if m.size_gb else fetch.total_size
    if need and fetch.free_bytes is not None and fetch.free_bytes < need:
        return (f"model-fetch: not enough disk for {m.id} at {m.path}: needs {need / 1e9:.1f} GB, "
                f"{fetch.free_bytes / 1e9:.1f} GB free")
    return None


def blocks_of(sp: ServicePlan, ctx: Context, observed: Mapping[str, str | None],
              gpu: GpuFault | None) -> tuple[Block, ...]:
    """PURE: why a service may not (re)start now, first reason first: the host's GPU fault (the
    host's, not the version's: nothing starts until the GPUs read healthy), pre-flight's blocks,
    the GPU gate's answer earlier in this run (its GPUs stayed busy after the stop), a model
    fetch the disk cannot hold, a secret that is not there."""
    blocks = list(ctx.checks.blocked.get(sp.name, ()))
    if gpu is not None:
        blocks.insert(0, Block(Reason.GPU_FAULT, f"not started: the host's {gpu.why()} (the revision is not judged; "
                                                 f"cleared by the next healthy GPU reading)"))
    if sp.name in ctx.checks.gate:
        blocks.append(Block(Reason.GPU_BUSY, ctx.checks.gate[sp.name]))
    if sp.target is not None:
        fetch = ctx.checks.fetch.get(sp.name)
        refused = fetch_refused(fetch) if fetch is not None and not sp.target.rollback else None
        if refused:
            blocks.append(Block(Reason.MODEL_FETCH_FAILED, f"{sp.name}: {refused}"))
        blocks += secret_blocks(sp.target.spec, observed)
    return tuple(blocks)


def blocked_plan(sp: ServicePlan, blocks: tuple[Block, ...], quote: str | None = None) -> ServicePlan:
    """A service that `blocks` keep from starting: Blocked, for the first one's reason; nothing
    is written for it. `quote`: the line that says why (the GPU fault's), else the plan's own."""
    reason = blocks[0].reason
    # Pre-flight messages name their service ("m: ..."); the result names it once already.
    note = " | ".join(b.message.removeprefix(f"{sp.name}: ") for b in blocks)
    if sp.state is State.QUARANTINED:
        note = f"{sp.note}; the last good version cannot start: {note}"
    return ServicePlan(sp.name, State.BLOCKED, None, result=Result.FAILED, reason=reason, note=note,
                       quote=quote or sp.quote)


def needs_last_good(desired: HostSpec, facts: HostFacts, ctx: Context) -> dict[str, str]:
    """Service -> the last good revision to render, for services that a live quarantine may make
    substitute (the caller renders them from git and passes them in Context.last_good)."""
    out: dict[str, str] = {}
    for name, svc in desired.services.items():
        f = facts.services.get(name)
        rec = f.record if f is not None else None
        if rec is None or not rec.last_good_revision or ctx.retry:
            continue
        if live_quarantine(rec.quarantine, ctx.fleet_quarantine.get(name), svc.content_hash()) is not None:
            out[name] = rec.last_good_revision
    return out
