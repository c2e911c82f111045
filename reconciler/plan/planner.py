"""PURE: desired state x observed facts x the host's records -> the actions for one host.

No I/O, no clock, no globals. Like Flux's helm-controller, every service is first sorted into
one `State` (`classify`), and its actions are then chosen from that state alone
(`_actions_for`). Every decision after a failure lives here too: substituting the last good
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

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

from ..desired.spec import HostSpec, SecretSpec, ServiceSpec
from .confirm import Previous, Switch, arm, unit_name
from .facts import (
    UNIT_DIR,
    HostFacts,
    ServiceFacts,
    adopted_copy,
    cred_env_path,
    cred_path,
    env_path,
    envfile_path,
    secrets_path,
    unit_path,
)
from .records import MAX_UNJUDGED, Adopted, Pending, Quarantine, Result, ServiceRecord

ENV_HEADER = "# Managed by reconciler from git; edits on this host are reverted.\n"
_SECRETISH = re.compile(r"TOKEN|SECRET|PASSW|API_?KEY|PRIVATE|CREDENTIAL", re.I)


class Kind(StrEnum):
    """Action kinds, in the order the executor runs them on a host."""

    FETCH = "fetch-model"        # controller: download a missing model before anything stops
    HOLD = "hold"                # no-op marker: a service deliberately left as it is (and why)
    INTENT = "intent"            # record on the host what is about to be deployed (pending)
    DISARM = "disarm"            # take down a dead-man's switch (a service that leaves, or is held)
    STOP = "stop"
    DISABLE = "disable"
    ADOPT = "adopt"              # keep a foreign unit's original files under adopted/
    WRITE = "write"
    REMOVE = "remove"
    SECRETS = "secrets"          # deliver a service's secrets to its root-only credstore (values never in the plan)
    RESTORE = "restore"          # put an adopted unit's original files back
    ARM = "arm"                  # write the deploy's dead-man's switch (confirm.py)
    DAEMON_RELOAD = "daemon-reload"
    WAIT_GPUS = "wait-gpus"      # controller: wait until the GPUs are free before starting
    ARM_TIMER = "arm-timer"      # ready the switch's timer (made if the controller goes), right before the start
    ENABLE = "enable"
    START = "start"
    RESTART = "restart"
    RECORD = "record"            # per-service records after the starts, and the host record
    WATCH = "watch"              # controller: health watch until a verdict

    @property
    def mutating(self) -> bool:
        """Changes a service on the host (bookkeeping, markers and watches do not)."""
        return self not in (Kind.HOLD, Kind.INTENT, Kind.RECORD, Kind.WATCH, Kind.ARM, Kind.ARM_TIMER,
                            Kind.DISARM)


ORDER = {k: i for i, k in enumerate(Kind)}


class State(StrEnum):
    """The fixed set of states a service can be in (see the module docstring)."""

    NEW = "New"
    IN_SYNC = "InSync"
    CHANGED = "Changed"
    DRIFTED = "Drifted"
    STOPPED = "Stopped"
    PENDING = "Pending"
    QUARANTINED = "Quarantined"
    QUARANTINED_NO_GOOD = "QuarantinedNoLastGood"
    ROLLBACK_FAILED = "RollbackFailed"
    HALTED = "RolloutHalted"
    ADOPT = "Adopt"
    FOREIGN = "Foreign"
    BLOCKED = "Blocked"
    DEFERRED = "Deferred"
    ORPHAN = "Orphan"
    INCONCLUSIVE = "Inconclusive"


class Reason(StrEnum):
    """Why an action is in the plan (CamelCase, like Flux's condition reasons)."""

    NEW_SERVICE = "NewService"
    UNIT_CHANGED = "UnitChanged"
    ENV_CHANGED = "EnvChanged"
    SECRET_CHANGED = "SecretChanged"
    DRIFT = "Drift"
    FOREIGN_DROPIN = "ForeignDropIn"
    NOT_RUNNING = "NotRunning"
    STALE_PROCESS = "ProcessPredatesFiles"
    INTERRUPTED = "InterruptedDeploy"
    REVERIFY = "Reverify"
    SUBSTITUTE = "SubstituteLastGood"
    HOLD_LAST_GOOD = "HoldLastGood"
    HOLD_STOPPED = "HoldStopped"
    HOLD_HALTED = "HoldHalted"
    FOREIGN = "Foreign"
    BLOCKED = "Blocked"
    ADOPT = "Adopt"
    REMOVED = "RemovedFromGit"
    RESTORE = "RestoreAdopted"
    RESTORE_MASK = "RestoreMask"
    KEEP_ORPHAN = "KeptWhileBlocked"
    GPU_GATE = "GpuGate"
    FETCH_MODEL = "FetchModel"
    START_AT_BOOT = "StartAtBoot"
    RELOAD = "UnitFilesChanged"
    HEALTH = "HealthCheck"
    RECORD = "Record"
    QUARANTINE = "RecordQuarantine"
    CONFIRM = "DeadMansSwitch"
    START_AGAIN = "StartAgain"
    HOLD_UNJUDGED = "HoldUnjudged"
    STALE_TEMP = "StaleTempFile"


@dataclass(frozen=True)
class Target:
    """The version of a service this run converges to: the desired one, or the last good."""

    spec: ServiceSpec
    revision: str
    rollback: bool = False

    @property
    def hash(self) -> str:
        return self.spec.content_hash()


@dataclass(frozen=True)
class Watch:
    """What the health watch of one service needs to judge it against its own start."""

    hash: str
    revision: str
    rollback: bool
    baseline_restarts: int = 0       # NRestarts before our start (a restart keeps counting)
    baseline_invocation: str = ""    # InvocationID before our start: unchanged = not started yet
    baseline_active_enter: str = ""  # ActiveEnterTimestampMonotonic before: unchanged = never active
    reverify: bool = False           # watched again, without a restart (the verdict was lost)
    since: int | None = None         # epoch the deploy began, for the journal (None: this apply)


@dataclass(frozen=True)
class Action:
    """One step on one host. `content` is never printed (env may hold secrets); `diff` is masked."""

    kind: Kind
    reason: Reason
    service: str | None = None
    path: str | None = None
    content: str | None = field(default=None, repr=False)
    diff: str | None = None
    detail: str = ""
    record: ServiceRecord | None = field(default=None, repr=False)   # INTENT / RECORD: what to write
    watch: Watch | None = None
    switch: Switch | None = field(default=None, repr=False)          # ARM, ARM_TIMER: the dead-man's switch
    secrets: tuple[SecretSpec, ...] = field(default=(), repr=False)   # SECRETS: what to deliver (no values)
    # START: systemd had never loaded the unit (no failed state, restart count or start limit to
    # reset first)
    fresh: bool = False

    def describe(self) -> str:
        target = self.path or self.service or ""
        return f"{self.kind.value} {target}".strip() + f"  ({self.detail or self.reason.value})"

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind.value, "service": self.service, "path": self.path,
                "reason": self.reason.value, "detail": self.detail, "diff": self.diff}


@dataclass(frozen=True)
class ServicePlan:
    """One service's state, the version it converges to, and what that means for the host."""

    name: str
    state: State
    target: Target | None = None
    result: Result = Result.IN_SYNC  # before any verdict: what this state alone makes of the host
    reason: str = ""                 # CamelCase, when result is not a success
    note: str = ""                   # for people: quarantine, foreign path, blocked reasons
    quote: str | None = None         # the journal line recorded with a quarantine


@dataclass(frozen=True)
class Block:
    """Why pre-flight (or systemd's own check of the unit) refuses to start a service."""

    reason: str                      # PreflightFailed | UnitInvalid | ModelFetchFailed | GpuBusy
    message: str


@dataclass(frozen=True)
class Checks:
    """What host-side pre-flight decided; the planner only reads it."""

    blocked: Mapping[str, tuple[Block, ...]] = field(default_factory=dict)
    fetch: Mapping[str, str] = field(default_factory=dict)   # service -> what would be fetched
    gpu_gate: bool = False           # the host has GPUs: starts wait until they are free


@dataclass(frozen=True)
class Context:
    """Everything besides desired and observed that a plan depends on (all plain values)."""

    revision: str
    last_good: Mapping[str, ServiceSpec | None] = field(default_factory=dict)  # rendered at last_good_revision
    fleet_quarantine: Mapping[str, Quarantine] = field(default_factory=dict)   # halted rollouts
    deferred: frozenset[str] = frozenset()    # converged by another pass (a rollout wave)
    retry: bool = False                       # --retry: ignore quarantines once
    checks: Checks = field(default_factory=Checks)
    confirm_margin: float | None = 60.0       # dead-man's switch window = start-up + stable_for + this (None: off)


@dataclass(frozen=True)
class HostPlan:
    """Everything to do on one host, in execution order, plus every service's plan."""

    host: str
    revision: str
    actions: tuple[Action, ...]
    services: Mapping[str, ServicePlan]
    dropped_records: tuple[str, ...] = ()     # services leaving the inventory

    @property
    def states(self) -> dict[str, State]:
        return {n: s.state for n, s in self.services.items()}

    @property
    def changes(self) -> tuple[Action, ...]:
        """Actions that change the host's services (bookkeeping, holds and watches excluded)."""
        return tuple(a for a in self.actions if a.kind.mutating)

    @property
    def visible(self) -> tuple[Action, ...]:
        """What a person should see in a plan: everything but the bookkeeping writes."""
        return tuple(a for a in self.actions if a.kind not in (Kind.INTENT, Kind.RECORD, Kind.ARM_TIMER,
                                                               Kind.DISARM))

    @property
    def restarts(self) -> list[str]:
        return [a.service for a in self.actions if a.kind in (Kind.START, Kind.RESTART) and a.service]

    @property
    def watches(self) -> list[Action]:
        return [a for a in self.actions if a.kind is Kind.WATCH]

    def summary(self) -> str:
        """One line: what would change, e.g. 'write 2 files, daemon-reload, restart sglang'."""
        if not self.changes:
            reverify = [a.service for a in self.watches if a.service]
            return f"in sync; re-verify {', '.join(reverify)}" if reverify else "in sync"
        parts = []
        for kind, word in ((Kind.WRITE, "write"), (Kind.REMOVE, "remove")):
            n = sum(a.kind is kind for a in self.actions)
            if n:
                parts.append(f"{word} {n} file{'s' * (n != 1)}")
        for kind in (Kind.FETCH, Kind.ADOPT, Kind.SECRETS, Kind.RESTORE, Kind.DAEMON_RELOAD, Kind.STOP, Kind.DISABLE,
                     Kind.WAIT_GPUS, Kind.ENABLE, Kind.START, Kind.RESTART):
            names = sorted({a.service for a in self.actions if a.kind is kind and a.service})
            if kind is Kind.DAEMON_RELOAD and any(a.kind is kind for a in self.actions):
                parts.append("daemon-reload")
            elif names:
                parts.append(f"{kind.value} {', '.join(names)}")
        return ", ".join(parts)


# ---- files -------------------------------------------------------------------------------------


def render_env_dropin(service: str) -> str:
    """The env drop-in: it names the service's env file (the same text whatever the env is, so a
    change of env alone changes no unit file and needs no daemon-reload)."""
    return f"{ENV_HEADER}[Service]\nEnvironmentFile={envfile_path(service)}\n"


def _env_quote(value: str) -> str:
    # systemd.exec(5), EnvironmentFile=: in double quotes, a backslash keeps any of \ " ` $ as it
    # is; every other character (a newline too) is the value's own; nothing is expanded.
    return '"' + re.sub(r'([\\"`$])', r"\\\1", value) + '"'


def render_env_file(env: Mapping[str, str]) -> str:
    """The env file: one NAME="value" line per variable, read by systemd at every start."""
    return ENV_HEADER + "".join(f"{key}={_env_quote(env[key])}\n" for key in sorted(env))


_ENV_FILE_LINE = re.compile(r'^([A-Za-z_][A-Za-z0-9_]*)=(.*)$')


def parse_env_file(text: str | None) -> dict[str, str]:
    """Best-effort reading of an env file (ours or hand-edited) for reasons and diffs."""
    out: dict[str, str] = {}
    for line in (text or "").splitlines():
        m = _ENV_FILE_LINE.match(line.strip())
        if m:
            value = m.group(2)
            if len(value) >= 2 and value[0] == value[-1] == '"':
                value = re.sub(r"\\(.)", r"\1", value[1:-1])
            elif len(value) >= 2 and value[0] == value[-1] == "'":
                value = value[1:-1]
            out[m.group(1)] = value
    return out


def _legacy_env_dropin(env: Mapping[str, str]) -> str:
    """The env drop-in as a reconciler before the env file wrote it (Environment= lines): a host
    that has exactly this for the desired env runs the desired env already."""
    lines = [ENV_HEADER, "[Service]\n"]
    for key in sorted(env):
        value = env[key].replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
        lines.append(f'Environment="{key}={value}"\n')
    return "".join(lines)


_ENV_LINE = re.compile(r'^Environment="([^=]+)=(.*)"$')


def parse_env(text: str | None) -> dict[str, str]:
    """Best-effort reading of Environment= lines (an env drop-in an older reconciler wrote, or a
    hand-edited one) for reasons."""
    out: dict[str, str] = {}
    for line in (text or "").splitlines():
        m = _ENV_LINE.match(line.strip())
        if m:
            out[m.group(1)] = m.group(2)
    return out


def render_secrets(svc: ServiceSpec) -> str | None:
    """The secrets drop-in: where systemd finds each secret, never a value. A credential is
    loaded by systemd at start into $CREDENTIALS_DIRECTORY/NAME (only the service's user can read
    it); the secrets wanted as environment variables come from one root-only EnvironmentFile=.
    Never Environment=: every local user can read that through `systemctl show`."""
    if not svc.secrets:
        return None
    lines = [ENV_HEADER, "# Secrets, by path only: the values are in root-only files.\n", "[Service]\n"]
    for s in sorted(svc.secrets, key=lambda s: s.name):
        if not s.env:
            src = s.path if s.source == "file" else cred_path(svc.name, s.name)
            lines.append(f"LoadCredential={s.name}:{src}\n")
    if any(s.env for s in svc.secrets):
        lines.append(f"EnvironmentFile={cred_env_path(svc.name)}\n")
    return "".join(lines)


def desired_files(svc: ServiceSpec) -> dict[str, str | None]:
    """Path -> content for one service; None means the file must not exist."""
    return {unit_path(svc.name): svc.unit_text,
            env_path(svc.name): render_env_dropin(svc.name) if svc.env else None,
            envfile_path(svc.name): render_env_file(svc.env) if svc.env else None,
            secrets_path(svc.name): render_secrets(svc)}


def needs_reload(path: str) -> bool:
    """A file systemd loads (a unit or a drop-in): replacing it takes a daemon-reload. The env
    file is read at every start and takes none."""
    return path.startswith(f"{UNIT_DIR}/")


def own_files(name: str) -> frozenset[str]:
    """The files the reconciler writes for a service (everything else is someone else's)."""
    return frozenset({unit_path(name), env_path(name), envfile_path(name), secrets_path(name)})


def secret_files(host: HostSpec) -> list[str]:
    """The files whose keyed hash the observation reads: each referenced file, and the
    reconciler's own copies of the age secrets and of the environment file."""
    out: set[str] = set()
    for svc in host.services.values():
        for s in svc.secrets:
            out.add(s.path if s.source == "file" else cred_path(svc.name, s.name))
        if any(s.env for s in svc.secrets):
            out.add(cred_env_path(svc.name))
    return sorted(out)


UNOBSERVED = "?"


def secret_versions(svc: ServiceSpec, observed: Mapping[str, str | None]) -> dict[str, str | None]:
    """NAME -> the version of the value to deliver, never the value: the controller's keyed
    digest of an age secret, the host's keyed hash of a referenced file (None: the file is not
    on the host, or the secret cannot be decrypted; UNOBSERVED: not read in this run)."""
    out: dict[str, str | None] = {}
    for s in svc.secrets:
        if s.source == "age":
            out[s.name] = f"age:{s.digest}" if s.digest else None
        else:
            h = observed.get(s.path, UNOBSERVED)
            out[s.name] = f"file:{h}" if h else None
    return out


def secret_blocks(svc: ServiceSpec, observed: Mapping[str, str | None]) -> tuple[Block, ...]:
    """Secrets that cannot be delivered: the service is blocked and nothing is written."""
    out: list[Block] = []
    for s in sorted(svc.secrets, key=lambda s: s.name):
        if s.problem:
            out.append(Block("SecretUndecryptable", f"secret {s.name}: {s.problem}"))
        elif s.source == "file" and s.path in observed and observed[s.path] is None:
            out.append(Block("SecretMissing", f"secret {s.name}: {s.path} does not exist on the host (a referenced "
                                              f"secret is provisioned there by other means); nothing written"))
    return tuple(out)


def secret_changes(svc: ServiceSpec, rec: ServiceRecord,
                   observed: Mapping[str, str | None]) -> tuple[tuple[str, str], ...]:
    """(NAME, what) for each secret whose delivered value is not the one wanted: added, changed,
    removed, or the reconciler's own copy missing on the host. Never a value."""
    want = secret_versions(svc, observed)
    out: list[tuple[str, str]] = []
    for name, v in sorted(want.items()):
        have = rec.secrets.get(name)
        if have is None:
            out.append((name, "added"))
        elif v != have and not (v is not None and v.endswith(UNOBSERVED)):
            out.append((name, "changed"))
    out += [(name, "removed") for name in sorted(set(rec.secrets) - set(want))]
    seen = {n for n, _ in out}
    for s in sorted(svc.secrets, key=lambda s: s.name):
        own = cred_path(svc.name, s.name) if s.source == "age" else cred_env_path(svc.name) if s.env else None
        if s.name not in seen and own is not None and own in observed and observed[own] is None:
            out.append((s.name, "missing on the host"))
    return tuple(out)


def describe_secret_changes(changes: tuple[tuple[str, str], ...]) -> str:
    """'secret API_KEY changed, HF_TOKEN added': names only."""
    return "secret " + ", ".join(f"{n} {what}" for n, what in changes)


def mask_secrets(text: str) -> str:
    """Hide values of secret-looking variables (…TOKEN, …SECRET, …PASSWORD) in a diff."""
    def repl(m: re.Match[str]) -> str:   # an env file's NAME="value", or an Environment="NAME=value" line
        sign, environment, name = m.groups()
        if not _SECRETISH.search(name):
            return m.group(0)
        return f'{sign}{environment}{name}=***"' if environment else f'{sign}{name}="***"'
    return re.sub(r'^([-+ ]?)(Environment="?)?([A-Za-z_][A-Za-z0-9_]*)=.*$', repl, text, flags=re.M)


def unified_diff(path: str, old: str | None, new: str | None, host: str, short_rev: str) -> str:
    """A unified diff of one file, host version -> revision version, secrets masked."""
    diff = difflib.unified_diff(
        (old or "").splitlines(keepends=True), (new or "").splitlines(keepends=True),
        fromfile=f"{host}:{path}" if old is not None else "/dev/null",
        tofile=f"{short_rev}:{path}" if new is not None else "/dev/null")
    return mask_secrets("".join(line if line.endswith("\n") else line + "\n" for line in diff))


def _has_install(unit_text: str) -> bool:
    return re.search(r"^\s*\[Install\]\s*$", unit_text, re.M) is not None


def foreign_dropins(svc: ServiceSpec, f: ServiceFacts | None) -> dict[str, str]:
    """Drop-ins for the service that the reconciler did not write and that are not allowed."""
    if f is None:
        return {}
    return {p: c for p, c in sorted(f.dropins.items()) if p not in own_files(svc.name) and not svc.allows_dropin(p)}


def live_quarantine(recorded: Quarantine | None, fleet: Quarantine | None, want: str) -> Quarantine | None:
    """The quarantine in force for a service whose desired content hash is `want`: the one
    recorded on the host, the fleet-wide one (a halted rollout), or both merged (the record wins,
    the fleet fills in what it lacks, e.g. where the rollout halted). None when neither matches."""
    rec = recorded if recorded is not None and recorded.hash == want else None
    flt = fleet if fleet is not None and fleet.hash == want else None
    if rec is not None:
        return rec.merged(flt)
    return flt


# ---- classification ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Sync:
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


def _sync(target: Target, f: ServiceFacts | None, observed: Mapping[str, str | None]) -> _Sync:
    rec = (f.record if f else None) or ServiceRecord()
    files = []
    for path, want in desired_files(target.spec).items():
        have = _have(f, path)
        if have != want:
            files.append((path, have, want))
    pending = rec.pending if rec.pending is not None and rec.pending.hash == target.hash else None
    moved: list[tuple[str, str | None, str | None]] = []
    env_files = {env_path(target.spec.name), envfile_path(target.spec.name)}
    if f is not None and files and {p for p, _, _ in files} <= env_files and f.envfile_text is None \
            and target.spec.env and f.env_text == _legacy_env_dropin(target.spec.env):
        moved, files = files, []
    return _Sync(files=tuple(files), moved_env=tuple(moved), dropins=tuple(foreign_dropins(target.spec, f).items()),
                 secrets=secret_changes(target.spec, rec, observed),
                 applied=rec.hash == target.hash, running=f is not None and f.running, pending=pending,
                 verified=rec.last_good_hash == target.hash)


def _up(f: ServiceFacts | None) -> bool:
    """Up, or on its way up by a start job: not failed, stopped, or waiting out a restart."""
    if f is None:
        return False
    return f.active_state in ("active", "activating", "reloading", "refreshing") \
        and not f.props.get("SubState", "").startswith("auto-restart")


def _absent(f: ServiceFacts | None) -> bool:
    return f is None or (f.unit_text is None and f.env_text is None and f.envfile_text is None and not f.managed)


def _sync_state(s: _Sync, f: ServiceFacts | None) -> State:
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
        return ServicePlan(name, State.FOREIGN, result=Result.FAILED, reason="Foreign",
                           note=f"{foreign} was not installed by the reconciler: left untouched "
                                f"(set adopt = true on the service to take it over)")
    desired = Target(svc, ctx.revision)
    q = None if ctx.retry else live_quarantine(rec.quarantine, ctx.fleet_quarantine.get(name), svc.content_hash())
    if q is not None:
        rev7 = q.revision[:7] or "?"
        why = q.why(host)
        if q.rollback_failed:
            return ServicePlan(name, State.ROLLBACK_FAILED, result=Result.FAILED, reason="RollbackFailed",
                               note=f"desired {rev7} quarantined ({why}); its rollback failed too: left stopped "
                                    f"until a new commit changes it or --retry", quote=q.quote)
        good = ctx.last_good.get(name)
        if good is not None and rec.last_good_revision and rec.last_good_hash == good.content_hash() \
                and good.content_hash() != svc.content_hash():
            target = Target(good, rec.last_good_revision, rollback=True)
            return ServicePlan(name, State.QUARANTINED, target, result=Result.QUARANTINED, reason="Quarantined",
                               note=f"desired {rev7} quarantined ({why}), running {rec.last_good_revision[:7]}",
                               quote=q.quote)
        if q.halted_at and q.halted_at != host:
            return ServicePlan(name, State.HALTED, result=Result.QUARANTINED, reason="RolloutHalted",
                               note=f"desired {rev7} quarantined ({why}); left as it is until a new commit "
                                    f"changes it or --retry", quote=q.quote)
        what = "first deploy failed" if not rec.last_good_revision else \
            f"last good {rec.last_good_revision[:7]} cannot be rendered"
        return ServicePlan(name, State.QUARANTINED_NO_GOOD, result=Result.FAILED, reason="QuarantinedNoRollback",
                           note=f"desired {rev7} quarantined ({why}); {what}: left stopped until a new commit "
                                f"changes it or --retry", quote=q.quote)
    pend = rec.pending
    if (pend is not None and pend.hash == desired.hash and pend.started and pend.unjudged is not None
            and pend.attempts >= MAX_UNJUDGED and not ctx.retry):
        return ServicePlan(name, State.INCONCLUSIVE, result=Result.FAILED, reason="Inconclusive",
                           note=f"no verdict on {pend.revision[:7]} after {pend.attempts} tries ({pend.unjudged}); "
                                f"not quarantined: left as it is until a new commit changes it or --retry")
    if foreign is not None:
        return ServicePlan(name, State.ADOPT, desired, result=Result.CONVERGED,
                           note=f"adopting {foreign} (the original is kept and put back when the service "
                                f"leaves the desired state)")
    s = _sync(desired, f, observed or {})
    state = _sync_state(s, f)
    in_sync = state is State.IN_SYNC and not s.moved_env
    return ServicePlan(name, state, desired, result=Result.IN_SYNC if in_sync else Result.CONVERGED)


def _blocked(sp: ServicePlan, blocks: tuple[Block, ...]) -> ServicePlan:
    reason = blocks[0].reason
    # Pre-flight messages name their service ("m: ..."); the result names it once already.
    note = " | ".join(b.message.removeprefix(f"{sp.name}: ") for b in blocks)
    if sp.state is State.QUARANTINED:
        note = f"{sp.note}; the last good version cannot start: {note}"
    return ServicePlan(sp.name, State.BLOCKED, None, result=Result.FAILED, reason=reason, note=note, quote=sp.quote)


# ---- actions for a state -----------------------------------------------------------------------


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
        assert sp.target is not None
        s = _sync(sp.target, f, self.facts.secret_files)
        why_sub = f"substitute last good {sp.target.revision[:7]}: {sp.note}" if sp.target.rollback else ""
        for path, have, want in s.moved_env:
            assert want is not None
            self.add(Kind.WRITE, Reason.ENV_CHANGED, sp.name, path=path, content=want,
                     diff=unified_diff(path, have, want, self.host.name, sp.target.revision[:7]),
                     detail=f"env moved to {envfile_path(sp.name)}, same values: no restart")
            self.reload = True
        if self._nothing_to_apply(sp, f, s, why_sub):
            return
        if sp.name in self.ctx.checks.fetch and not sp.target.rollback:
            self.add(Kind.FETCH, Reason.FETCH_MODEL, sp.name, detail=self.ctx.checks.fetch[sp.name])
        rec = self._intent(sp, f, s)
        self._files(sp, f, s, why_sub)
        self._start(sp, f, s, rec, why_sub)

    def _nothing_to_apply(self, sp: ServicePlan, f: ServiceFacts | None, s: _Sync, why_sub: str) -> bool:
        """The target's files are in place and it runs: at most a re-verify (and an enable)."""
        target = sp.target
        assert target is not None
        if s.pending is not None and s.pending.started and not s.files_differ:
            if s.pending.unjudged is not None and not _up(f):
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

    def _intent(self, sp: ServicePlan, f: ServiceFacts | None, s: _Sync) -> ServiceRecord:
        """Record what is about to be deployed before anything changes; returns the record the
        later steps build on (with the adopted originals named, for an adoption)."""
        target = sp.target
        assert target is not None
        rec = self.base_record(sp.name, f)
        if sp.state is State.ADOPT and f is not None:
            # Durable first: the intent names the originals (the unit and its drop-ins) before
            # anything is copied or replaced; they are put back when the service leaves git.
            files = ((unit_path(sp.name),) if f.unit_text is not None else ()) + tuple(
                p for p in sorted(f.dropins) if p not in own_files(sp.name))
            rec = replace(rec, adopted=Adopted(files=files, was_enabled=f.enabled, was_active=f.running,
                                               fragment=f.foreign_path(),
                                               masked=f.props.get("LoadState") == "masked"))
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

    def _files(self, sp: ServicePlan, f: ServiceFacts | None, s: _Sync, why_sub: str) -> None:
        """Write what differs, remove what must not be there (foreign drop-ins kept aside)."""
        target = sp.target
        assert target is not None
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
            or (f is not None and f.props.get("NeedDaemonReload") == "yes")

    def _start(self, sp: ServicePlan, f: ServiceFacts | None, s: _Sync, rec: ServiceRecord, why_sub: str) -> None:
        """(Re)start it (through the GPU gate on a GPU host), record it started, watch it."""
        target = sp.target
        assert target is not None and rec.pending is not None
        reason, detail = self._start_reason(sp, s, s.running, why_sub)
        gated = self.ctx.checks.gpu_gate
        if gated:
            if s.running:
                self.add(Kind.STOP, Reason.GPU_GATE, sp.name, detail="stop first, start when its GPUs are free")
            self.add(Kind.WAIT_GPUS, Reason.GPU_GATE, sp.name, detail="wait until the GPUs it claims are released")
        self._arm(sp, f, s, rec)
        fresh = f is not None and f.props.get("LoadState") == "not-found" and f.active_state == "inactive"
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

    def _arm(self, sp: ServicePlan, f: ServiceFacts | None, s: _Sync, rec: ServiceRecord) -> None:
        """Arm the deploy's dead-man's switch (not for a rollback: the last good is what it would
        restore). It restores what runs now when that is the verified version, else it stops."""
        target = sp.target
        assert target is not None
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

    def _start_reason(self, sp: ServicePlan, s: _Sync, running: bool, why_sub: str) -> tuple[Reason, str]:
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
        if not running:
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
        if _has_install(spec.unit_text) and (f is None or not f.enabled):
            self.add(Kind.ENABLE, Reason.START_AT_BOOT, spec.name, detail="start at boot ([Install] section)")

    @staticmethod
    def _watch(target: Target, f: ServiceFacts | None, *, fresh: bool = False, reverify: bool = False,
               since: int | None = None) -> Watch:
        props = f.props if f is not None else {}
        try:
            restarts = int(props.get("NRestarts", "0") or 0)
        except ValueError:
            restarts = 0
        # A start (also a gated stop + start) resets NRestarts to 0; a restart keeps counting
        # (../shared/SYSTEMD.md). A re-verify judges from what runs now.
        return Watch(hash=target.hash, revision=target.revision, rollback=target.rollback,
                     baseline_restarts=0 if fresh else restarts,
                     baseline_invocation="" if reverify else props.get("InvocationID", ""),
                     baseline_active_enter="" if reverify else props.get("ActiveEnterTimestampMonotonic", ""),
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


def _service_plan(name: str, svc: ServiceSpec, f: ServiceFacts | None, host: str, ctx: Context,
                  observed: Mapping[str, str | None]) -> ServicePlan:
    sp = classify(name, svc, f, host, ctx, observed)
    blocks = tuple(ctx.checks.blocked.get(name, ()))
    if sp.target is not None:
        blocks += secret_blocks(sp.target.spec, observed)
    if blocks and sp.target is not None and sp.state is not State.IN_SYNC:
        return _blocked(sp, blocks)
    return sp


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
    for name, svc in sorted(desired.services.items()):
        f = facts.services.get(name)
        sp = services[name] = _service_plan(name, svc, f, desired.name, ctx, facts.secret_files)
        if sp.state in _HOLDS:
            b.hold(sp, _HOLDS[sp.state], f)
        if sp.state in _RECORDS_QUARANTINE:
            b.record_quarantine(sp, f)
        if sp.target is not None and sp.state is not State.BLOCKED:
            b.converge(sp, f)
    dropped = _orphans(b, facts, services)
    for path in facts.stale_temps:
        b.add(Kind.REMOVE, Reason.STALE_TEMP, path=path,
              detail="temp file an interrupted run left (removed under the host lock)")
    if b.reload:
        b.add(Kind.DAEMON_RELOAD, Reason.RELOAD, detail="unit files changed on disk")
    host_rev = facts.record.applied_revision if facts.record else None
    blocked = any(sp.state is State.BLOCKED for sp in services.values())
    # A revision is recorded as applied when something was applied, or when nothing at it was
    # refused: a blocked deploy writes nothing at all, not even the record.
    if any(a.kind.mutating for a in b.actions) or dropped or (host_rev != ctx.revision and not blocked):
        b.add(Kind.RECORD, Reason.RECORD, detail=f"record revision {b.short} and the inventory")
    actions = sorted(b.actions, key=lambda a: ORDER[a.kind])
    return HostPlan(desired.name, ctx.revision, tuple(actions), services, tuple(dropped))


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


def starting(plan: HostPlan) -> dict[str, Target]:
    """Services the plan starts or restarts, with the version they start as."""
    out: dict[str, Target] = {}
    for a in plan.actions:
        if a.kind in (Kind.START, Kind.RESTART) and a.service and a.reason is not Reason.RESTORE:
            sp = plan.services.get(a.service)
            if sp is not None and sp.target is not None:
                out[a.service] = sp.target
    return out


def writing_units(plan: HostPlan) -> dict[str, str]:
    """Service -> the unit text the plan writes (what systemd must accept before the rename)."""
    return {a.service: a.content for a in plan.actions
            if a.kind is Kind.WRITE and a.service and a.content is not None and a.path == unit_path(a.service)}
