"""One `reconcile pull` run on a host, against itself.

    fetch      the host's clone of the repo (a local path as is; a URL mirrored and fetched)
    load       the desired state at the branch head; find this host in it (--host, else its hostname)
    choose     with [pull] waves: the revision this host's wave may deploy now (schedule.choose),
               from the branch's history, the host's applied revision and the earlier waves'
               reports; without waves: the head
    report     pending, when it moves to a new revision and a later wave reads its reports
    reconcile  run_fleet over a LocalTransport, this host only: the same survey, host lock,
               revision safety, planner, pre-flight, health watch, rollback, quarantine and
               records as a controller's run of `reconcile --host NAME`
    report     its verdict on that revision (ok / bad / inconclusive) for the later waves
    record     /var/lib/reconciler/pull.json: what this run chose and why

Age secrets decrypt only with an identity on the host (--age-identity): docs/pull.md, "Secrets".

Trust (desired/trust.py TrustPolicy, from the command line): which URLs, heads, wave choices and
rollback targets it refuses or passes over, and the fallback to the newest signed first-parent
ancestor of an unsigned head: docs/pull.md, "Whom a host trusts".
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pygit2

from ..desired import source
from ..desired.cache import load_desired
from ..desired.gitauth import GitAuth
from ..desired.spec import DesiredState, HostSpec
from ..desired.trust import RevisionRefused, TrustPolicy, url_credentials
from ..errors import ConfigError, SourceError
from ..host import lock, programs
from ..host.apply import write_state_file
from ..host.transport import LocalTransport, Transport
from ..loop.fleet import run_fleet
from ..loop.options import Connector, HostPhase, RunIO, RunOptions, confirm_margin_from
from ..loop.results import FleetResult, HostResult
from ..loop.revision import open_revision
from ..plan.facts.host_record import HostRecordRead
from ..plan.layout import STATE_DIR
from ..plan.records import SUPERSEDED
from ..redact import redact, redact_data
from . import _git
from .schedule import (
    PENDING_MARGIN,
    Choice,
    Report,
    Skip,
    Standing,
    choose,
    earlier_hosts,
    publishes,
    standing_of,
    wave_of,
)

DEFAULT_DIR = Path(f"{STATE_DIR}/pull")
RECORD = f"{STATE_DIR}/pull.json"
MAX_TRIES = 5            # older candidates tried when a chosen revision cannot be loaded
FALLBACK = 100           # first-parent ancestors of a refused branch head searched for a signed one


class PullOptions(msgspec.Struct, frozen=True):
    """What `reconcile pull` was asked to do (the CLI's options)."""

    repo: str
    rev: str | None = None
    path: str = ""
    host: str | None = None
    workdir: Path = DEFAULT_DIR
    age_identity: str | None = None
    retry: bool = False
    allow_rewind: bool = False
    lock_wait: float = lock.WAIT
    dry_run: bool = False
    publish: bool = True
    trust: TrustPolicy = msgspec.field(default_factory=TrustPolicy)    # --allowed-signers / --allow-unsigned, transport
    ssh_key: str | None = None          # --ssh-identity: the host's deploy key for an ssh:// repo
    known_hosts: str | None = None      # --known-hosts: the git server's host key (else ~/.ssh/known_hosts)

    @property
    def auth(self) -> GitAuth:
        """How the fetch (and the notes' push) authenticates (desired/gitauth.py)."""
        return GitAuth(self.ssh_key, self.known_hosts)

    def run_options(self, host: str) -> RunOptions:
        """The run on this host: the one fleet run, limited to it."""
        return RunOptions(repo=self.repo, rev=self.rev, path=self.path, hosts=(host,), dry_run=self.dry_run,
                          retry=self.retry, allow_rewind=self.allow_rewind, lock_wait=self.lock_wait,
                          age_identity=self.age_identity, confirm_margin=confirm_margin_from(), trust=self.trust)

    def check_source(self) -> None:
        """Refuse (RevisionRefused) a repo URL that is plaintext (unless allowed) or carries a
        credential (it would be in the units, in `ps` and in `systemctl show`, which every
        local user reads), before anything is fetched."""
        self.trust.check_url(self.repo)
        creds = url_credentials(self.repo)
        if creds is not None:
            shown = source.shown_url(self.repo)
            raise RevisionRefused("CredentialsInUrl", f"--repo {shown}: the URL carries {creds}; it "
                                  "would be readable by every local user (units, ps, systemctl show). Give the host a "
                                  "read-only deploy key or a git credential helper instead")

    def trust_line(self) -> str:
        """What this run's trust policy lets deploy, in words (every run says it)."""
        if self.trust.require_signed:
            return self.trust.describe()
        return ("unsigned revisions are accepted (--allow-unsigned): whoever can write the repo is root on this "
                "host")


class PullOutcome(msgspec.Struct):
    """One pull run: what it chose, what the reconcile did, what it reported."""

    host: str
    head: str
    wave: str | None
    choice: Choice
    result: FleetResult | None = None
    reported: list[str] = msgspec.field(default_factory=list)
    warnings: list[str] = msgspec.field(default_factory=list)
    moved: bool = False            # a local repo's branch moved during the run: run again
    signer: str | None = None      # who signed the head (None: the run accepts unsigned revisions)
    fallback: str | None = None    # the branch head was refused: which signed ancestor is followed, why

    def exit_code(self) -> int:
        return self.result.exit_code() if self.result is not None else 0

    def to_json(self) -> dict[str, Any]:
        return redact_data({
            "host": self.host, "head": self.head, "wave": self.wave, "target": self.choice.revision,
            "why": self.choice.why, "skipped": [{"revision": s.revision, "why": s.why} for s in self.choice.skipped],
            "signer": self.signer, "fallback": self.fallback, "reported": self.reported, "warnings": self.warnings,
            "exit_code": self.exit_code(),
            "result": self.result.to_json() if self.result is not None else None})


async def connect_local(host: HostSpec) -> Transport:
    """The Connector for the host the run is on: commands in a local shell, health probes to its
    own addresses, the host lock held by a local process."""
    return LocalTransport(host.name)


def this_host(state: DesiredState, name: str | None) -> str:
    """The host file this run is for: --host, else the hostname (or its first label)."""
    if name:
        if name not in state.hosts:
            raise SourceError(f"--host {name}: no hosts/{name}.toml at {state.short} "
                              f"(hosts: {', '.join(sorted(state.hosts)) or 'none'})")
        return name
    hostname = socket.gethostname()
    for candidate in (hostname, hostname.split(".", 1)[0]):
        if candidate in state.hosts:
            return candidate
    raise SourceError(f"this host's name {hostname!r} has no hosts/<name>.toml at {state.short}; pass --host NAME "
                      f"(hosts: {', '.join(sorted(state.hosts)) or 'none'})")


def signed_head(repo: pygit2.Repository, head: source.Snapshot,
                opts: PullOptions) -> tuple[source.Snapshot, str | None, str | None]:
    """The commit a run follows, its signer, and (when it is not the branch head) why, in words.
    The branch head when the trust policy lets it deploy; else, when the run follows a branch
    (no --rev), its newest first-parent ancestor that the policy lets deploy, among FALLBACK:
    a forge's merge commit (signed by the forge, or not at all) then leaves the hosts on the last
    signed commit instead of halting every one of them. RevisionRefused (the head's) when none
    is, or for a --rev that is refused. Only trees of verified commits are read."""
    try:
        return head, opts.trust.verify(repo, head.revision), None
    except RevisionRefused as refused:
        if opts.rev is not None:
            raise
        for c in _git.history(head.commit, FALLBACK + 1)[1:]:
            try:
                signer = opts.trust.verify(repo, c.revision)
            except RevisionRefused:
                continue
            snap = source.snapshot(repo, c.revision, opts.path)
            return snap, signer, (f"the branch head {head.short} is refused ({refused.reason}: {refused}); "
                                  f"following {snap.short}, its newest first-parent ancestor signed by a trusted key")
        raise RevisionRefused(refused.reason, f"{refused}; nor is any of its {FALLBACK} newest first-parent "
                                              f"ancestors signed by a trusted key") from None


def _deadline(host: HostSpec, lock_wait: float) -> float:
    """How long a deploy of this host may take before its pending report goes stale: the longest
    fetch, start-up and stable window of its services, the lock wait, and a margin."""
    longest = max((s.health.startup_timeout + s.health.stable_for
                   + (s.model.fetch_timeout if s.model is not None and s.model.fetch else 0.0)
                   for s in host.services.values()), default=0.0)
    return longest + lock_wait + PENDING_MARGIN


async def _applied(t: Transport) -> str | None:
    """The revision the host last applied (its host record), None where it has none."""
    rec = await programs.run(t, HostRecordRead(), timeout=30, what="read host record")
    return rec.applied_revision if rec is not None else None


def _choose(repo: pygit2.Repository, head: source.Snapshot, state: DesiredState, name: str, applied: str | None,
            opts: PullOptions, *, now: int | None = None
            ) -> tuple[Choice, int | None, dict[str, tuple[source.Snapshot, DesiredState]]]:
    """The revision to reconcile, the host's wave, and the snapshots loaded on the way. `now`:
    the wall clock's seconds (the commits' ages; a test gives its own)."""
    loaded = {head.revision: (head, state)}
    waves = state.settings.pull_waves
    wave = wave_of(state.hosts[name].labels, waves)
    if wave is None:
        return Choice(head.revision, f"{head.short} is the branch head (no [pull] waves in fleet.toml)"), None, loaded
    chain = _git.history(head.commit)
    earlier = earlier_hosts({h: s.labels for h, s in state.hosts.items()}, waves, wave)
    reports = _git.read_reports(repo, earlier, {c.revision for c in chain})
    unusable: dict[str, str] = {}
    now = int(time.time()) if now is None else now
    for attempt in range(MAX_TRIES + 1):
        if attempt < MAX_TRIES:
            choice = choose(chain, applied, wave=wave, waves=waves, now=now, reports=reports, unusable=unusable)
        else:       # enough broken commits: stay where the host is
            tried = tuple(Skip(r, why) for r, why in unusable.items())
            choice = Choice(applied, f"staying at {applied[:7]}: the newer commits tried cannot be loaded", tried) \
                if applied else Choice(None, "no commit tried could be loaded", tried)
        rev = choice.revision
        if rev is None or rev in loaded:
            return choice, wave, loaded
        try:
            opts.trust.verify(repo, rev)
        except RevisionRefused as e:
            if rev == applied:         # never older than the applied revision: nothing may deploy
                return Choice(None, f"staying put: the applied revision {rev[:7]} is refused ({e.reason}: {e})",
                              choice.skipped), wave, loaded
            unusable[rev] = f"refused ({e.reason}: {e})"
            continue
        try:
            snap = source.snapshot(repo, rev, opts.path)
            at = load_desired(snap)
        except (ConfigError, SourceError) as e:
            if rev == applied:
                raise
            unusable[rev] = f"cannot be loaded ({str(e).splitlines()[0]})"
            continue
        if name not in at.hosts:
            if rev == applied:
                return Choice(None, f"{name} has no host file at its applied revision {rev[:7]}", choice.skipped), \
                    wave, loaded
            unusable[rev] = f"{name} has no host file at {rev[:7]}"
            continue
        loaded[rev] = (snap, at)
        return choice, wave, loaded
    raise AssertionError("unreachable")     # the last attempt always returns or raises


async def pull_once(opts: PullOptions, *, on_phase: HostPhase | None = None, connect: Connector | None = None,
                    on_choice: Callable[[PullOutcome], None] | None = None) -> PullOutcome:
    """One pull run (see the module docstring). Raises ConfigError or SourceError for bad input
    (nothing applied); a host failure is in the outcome's result, as for any run. on_choice is
    told what the run chose before it reconciles (a deploy may then take minutes)."""
    local = not source.is_url(opts.repo)
    opts.check_source()
    repo = _git.open_clone(opts.repo, opts.workdir, opts.auth)
    branch_head = source.snapshot(repo, opts.rev, opts.path)
    # verified before its tree is read; an unsigned head: its newest signed first-parent ancestor
    head, signer, fallback = signed_head(repo, branch_head, opts)
    state = load_desired(head)
    name = this_host(state, opts.host)
    connect = connect or connect_local
    probe = await connect(state.hosts[name])
    try:
        applied = await _applied(probe)
    finally:
        await probe.close()
    choice, wave, loaded = _choose(repo, head, state, name, applied, opts)
    waves = state.settings.pull_waves
    out = PullOutcome(name, head.revision, waves[wave].name if wave is not None else None, choice, signer=signer,
                      fallback=fallback)
    if not opts.trust.require_signed:
        out.warnings.append(opts.trust_line())
    if on_choice is not None:
        on_choice(out)
    if choice.revision is not None:
        report = publishes(wave, waves) and opts.publish and not opts.dry_run
        await _reconcile(out, repo, loaded[choice.revision], applied, report, opts, on_phase, connect, local)
    if not opts.dry_run:
        await _record(connect, state.hosts[name], out)
        if local:
            try:
                out.moved = source.snapshot(repo, opts.rev, opts.path).revision != branch_head.revision
            except SourceError:
                out.moved = False
    return out


async def _reconcile(out: PullOutcome, repo: pygit2.Repository, loaded: tuple[source.Snapshot, DesiredState],
                     applied: str | None, report: bool, opts: PullOptions, on_phase: HostPhase | None,
                     connect: Connector, local: bool) -> None:
    """Reconcile this host at the chosen revision, reporting pending before and the verdict after
    (when a later wave reads them)."""
    snap, target = loaded
    name, rev = out.host, snap.revision
    host = target.hosts[name]
    if report and rev != applied:
        now = int(time.time())
        pending = Report(name, rev, Standing.PENDING, wave=out.wave or "", at=now,
                         until=now + int(_deadline(host, opts.lock_wait)))
        _say(out, repo, pending, push=not local, auth=opts.auth)
    run = opts.run_options(name)
    opened = open_revision(snap, run, state=target)
    out.result = await run_fleet(opened, run, RunIO(connect=connect, on_phase=on_phase))
    out.warnings.extend(f"refused to roll back to {r[:7]}: {why}" for r, why in opened.refused.items())
    r = out.result.hosts[0]
    failed = next((e.outcome for e in r.events if e.outcome is not None and not e.outcome.healthy
                   and e.outcome.reason != SUPERSEDED), None)
    if report:
        standing = standing_of(r.status, failed_health=failed is not None)
        reason = "" if standing is Standing.OK else failed.reason if failed is not None else _held_reason(r)
        _say(out, repo, Report(name, rev, standing, wave=out.wave or "", reason=reason, at=int(time.time()),
                               services={n: str(s) for n, s in (r.plan.states.items() if r.plan else ())}),
             push=not local, auth=opts.auth)


def _held_reason(r: HostResult) -> str:
    """Why a host that changed nothing this run is still bad: the reason its records keep for a
    quarantined version (CrashLoop, not the generic Quarantined), else the run's own reason."""
    if r.facts is not None:
        for _, f in sorted(r.facts.services.items()):
            q = f.record.quarantine if f.record is not None else None
            if q is not None:
                return (q.cause or q.reason) if q.reason == "RolloutHalted" else q.reason
    return r.reason or ""


def _say(out: PullOutcome, repo: pygit2.Repository, report: Report, *, push: bool, auth: GitAuth) -> None:
    try:
        said = _git.publish(repo, report, push=push, auth=auth)
    except _git.PublishError as e:
        out.warnings.append(f"report not published: {e}")
    else:
        if said is not None:
            out.reported.append(said)


async def _record(connect: Connector, host: HostSpec, out: PullOutcome) -> None:
    """/var/lib/reconciler/pull.json: the last pull run's choice, for a person on the host and
    for whoever reads the host's records."""
    data = {"host": out.host, "wave": out.wave, "head": out.head, "fallback": out.fallback,
            "target": out.choice.revision,
            "why": out.choice.why, "skipped": [{"revision": s.revision, "why": s.why} for s in out.choice.skipped[:5]],
            "exit_code": out.exit_code(), "at": int(time.time()),
            "status": str(out.result.hosts[0].status) if out.result is not None and out.result.hosts else None}
    text = redact(json.dumps(redact_data(data), sort_keys=True)) + "\n"
    t = await connect(host)
    try:
        await write_state_file(t, RECORD, text, what="write pull record")
    except Exception as e:           # the run is done; a record it could not write is a warning
        out.warnings.append(f"could not write {RECORD}: {e}")
    finally:
        await t.close()
