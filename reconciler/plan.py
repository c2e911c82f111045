"""PURE: desired state x observed facts -> the actions that converge one host, with reasons.

No I/O, no clock, no globals. Like Flux's helm-controller, each service is first sorted into a
state (Absent, Drifted, Changed, Stopped, InSync, Orphaned) and only then mapped to actions.
Only services in the host's inventory (installed by the reconciler) can ever be removed.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from enum import Enum

from .facts import HostFacts, ServiceFacts, env_path, unit_path
from .spec import HostSpec, ServiceSpec

ENV_HEADER = "# Managed by reconciler from git; edits on this host are reverted.\n"
_SECRETISH = re.compile(r"TOKEN|SECRET|PASSW|API_?KEY|PRIVATE|CREDENTIAL", re.I)


class Kind(str, Enum):
    """Action kinds, in the order the executor runs them."""

    STOP = "stop"
    DISABLE = "disable"
    WRITE = "write"
    REMOVE = "remove"
    DAEMON_RELOAD = "daemon-reload"
    ENABLE = "enable"
    START = "start"
    RESTART = "restart"
    RECORD = "record"


ORDER = {k: i for i, k in enumerate(Kind)}


class State(str, Enum):
    """What a service looks like on the host compared to the revision."""

    ABSENT = "Absent"        # desired, not on the host
    CHANGED = "Changed"      # the revision changes it
    DRIFTED = "Drifted"      # the host was edited by hand; the revision did not change
    STOPPED = "Stopped"      # files in sync, but not running
    IN_SYNC = "InSync"
    ORPHANED = "Orphaned"    # installed by us, no longer desired
    HELD = "Held"            # left exactly as it is (quarantined with nothing to roll back to)


@dataclass(frozen=True)
class Action:
    """One step on one host. `content` is never printed (env may hold secrets); `diff` is masked."""

    kind: Kind
    reason: str
    service: str | None = None
    path: str | None = None
    content: str | None = field(default=None, repr=False)
    diff: str | None = None

    def describe(self) -> str:
        target = self.path or self.service or ""
        return f"{self.kind.value} {target}".strip() + f"  ({self.reason})"

    def to_json(self) -> dict:
        return {"kind": self.kind.value, "service": self.service, "path": self.path,
                "reason": self.reason, "diff": self.diff}


@dataclass(frozen=True)
class HostPlan:
    """Everything to do on one host, in execution order, plus per-service states."""

    host: str
    revision: str
    actions: tuple[Action, ...]
    states: dict[str, State]
    records: dict[str, dict] = field(default_factory=dict)   # service -> record to write
    dropped_records: tuple[str, ...] = ()                      # services leaving the inventory

    @property
    def changes(self) -> tuple[Action, ...]:
        """Actions that change the host's services (bookkeeping records excluded)."""
        return tuple(a for a in self.actions if a.kind is not Kind.RECORD)

    @property
    def restarts(self) -> list[str]:
        return [a.service for a in self.actions if a.kind in (Kind.START, Kind.RESTART) and a.service]

    def summary(self) -> str:
        """One line: what would change, e.g. 'write 2 files, daemon-reload, restart sglang'."""
        if not self.changes:
            return "in sync"
        writes = sum(a.kind is Kind.WRITE for a in self.actions)
        removes = sum(a.kind is Kind.REMOVE for a in self.actions)
        parts = []
        if writes:
            parts.append(f"write {writes} file{'s' * (writes != 1)}")
        if removes:
            parts.append(f"remove {removes} file{'s' * (removes != 1)}")
        for kind in (Kind.DAEMON_RELOAD, Kind.STOP, Kind.DISABLE, Kind.ENABLE, Kind.START, Kind.RESTART):
            names = [a.service for a in self.actions if a.kind is kind]
            if kind is Kind.DAEMON_RELOAD and names:
                parts.append("daemon-reload")
            elif names:
                parts.append(f"{kind.value} {', '.join(n for n in names if n)}")
        return ", ".join(parts)


def render_env(env: dict[str, str]) -> str:
    """The env drop-in: one quoted Environment= line per variable (shows in `systemctl show`)."""
    lines = [ENV_HEADER, "[Service]\n"]
    for key in sorted(env):
        value = env[key].replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
        lines.append(f'Environment="{key}={value}"\n')
    return "".join(lines)


_ENV_LINE = re.compile(r'^Environment="([^=]+)=(.*)"$')


def parse_env(text: str | None) -> dict[str, str]:
    """Best-effort reading of an env drop-in (ours or hand-edited) for reasons and diffs."""
    out: dict[str, str] = {}
    for line in (text or "").splitlines():
        m = _ENV_LINE.match(line.strip())
        if m:
            out[m.group(1)] = m.group(2)
    return out


def desired_files(svc: ServiceSpec) -> dict[str, str | None]:
    """Path -> content for one service; None means the file must not exist."""
    return {unit_path(svc.name): svc.unit_text,
            env_path(svc.name): render_env(svc.env) if svc.env else None}


def mask_secrets(text: str) -> str:
    """Hide values of secret-looking variables (…TOKEN, …SECRET, …PASSWORD) in a diff."""
    def repl(m: re.Match) -> str:
        return f'{m.group(1)}{m.group(2)}=***"' if _SECRETISH.search(m.group(2)) else m.group(0)
    return re.sub(r'^([-+ ]?Environment=")([A-Za-z_][A-Za-z0-9_]*)=.*"$', repl, text, flags=re.M)


def unified_diff(path: str, old: str | None, new: str | None, host: str, short_rev: str) -> str:
    """A unified diff of one file, host version -> revision version, secrets masked."""
    diff = difflib.unified_diff(
        (old or "").splitlines(keepends=True), (new or "").splitlines(keepends=True),
        fromfile=f"{host}:{path}" if old is not None else "/dev/null",
        tofile=f"{short_rev}:{path}" if new is not None else "/dev/null")
    return mask_secrets("".join(line if line.endswith("\n") else line + "\n" for line in diff))


def _has_install(unit_text: str) -> bool:
    return re.search(r"^\s*\[Install\]\s*$", unit_text, re.M) is not None


def classify(svc: ServiceSpec, facts: ServiceFacts | None) -> State:
    """Sort one desired service into a State (Flux's DetermineReleaseState)."""
    if facts is None or (facts.unit_text is None and facts.env_text is None and not facts.managed):
        return State.ABSENT
    files_differ = any(
        (facts.unit_text if p.endswith(".service") else facts.env_text) != want
        for p, want in desired_files(svc).items())
    applied = (facts.record or {}).get("hash")
    if files_differ:
        return State.DRIFTED if applied == svc.content_hash() else State.CHANGED
    if applied != svc.content_hash():
        return State.CHANGED   # files match but the running process may predate them
    if not facts.running:
        return State.STOPPED
    return State.IN_SYNC


def _write_reason(state: State, path: str, old: str | None, svc: ServiceSpec) -> str:
    if old is None:
        return "new file"
    if state is State.DRIFTED:
        return "drift: edited on the host, reverting to the revision"
    if path.endswith(".conf"):
        before, after = parse_env(old), parse_env(render_env(svc.env))
        keys = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        return f"env changed: {', '.join(keys)}" if keys else "env file changed"
    return "unit changed in the revision"


def plan_host(desired: HostSpec, facts: HostFacts, revision: str, hold: frozenset[str] = frozenset()) -> HostPlan:
    """Compute the actions that converge one host to `desired` at `revision` (pure).

    Services named in `hold` are left exactly as they are (no writes, no start, no removal).
    """
    short = revision[:7]
    actions: list[Action] = []
    states: dict[str, State] = {}
    records: dict[str, dict] = {}
    reload_needed = False

    for name, svc in sorted(desired.services.items()):
        if name in hold:
            states[name] = State.HELD
            continue
        f = facts.services.get(name)
        state = classify(svc, f)
        states[name] = state
        files_changed = False
        for path, want in desired_files(svc).items():
            have = None if f is None else (f.unit_text if path.endswith(".service") else f.env_text)
            if have == want:
                continue
            files_changed = True
            diff = unified_diff(path, have, want, desired.name, short)
            if want is None:
                actions.append(Action(Kind.REMOVE, "env no longer set", name, path, diff=diff))
            else:
                actions.append(Action(Kind.WRITE, _write_reason(state, path, have, svc), name, path, want, diff))
        reload_needed |= files_changed or (f is not None and f.props.get("NeedDaemonReload") == "yes")
        running = f is not None and f.running
        if state in (State.ABSENT, State.STOPPED) or (state in (State.CHANGED, State.DRIFTED) and not running):
            why = "new service" if state is State.ABSENT else \
                f"not running (ActiveState={f.active_state or '?'})" if f else "not running"
            actions.append(Action(Kind.START, why, name))
        elif state in (State.CHANGED, State.DRIFTED):
            why = "unit or env changed" if files_changed else "running process predates the applied files"
            actions.append(Action(Kind.RESTART, why, name))
        if _has_install(svc.unit_text) and (f is None or f.props.get("UnitFileState") not in ("enabled", "enabled-runtime")):
            actions.append(Action(Kind.ENABLE, "start at boot ([Install] section)", name))
        old_record = (f.record if f else None) or {}
        if old_record.get("hash") != svc.content_hash():
            records[name] = {**old_record, "hash": svc.content_hash(), "revision": revision}

    dropped: list[str] = []
    for name in sorted(facts.inventory - set(desired.services) - hold):
        f = facts.services[name]
        states[name] = State.ORPHANED
        dropped.append(name)
        if f.running or f.active_state == "failed":
            actions.append(Action(Kind.STOP, "removed from the desired state", name))
        if f.props.get("UnitFileState") in ("enabled", "enabled-runtime"):
            actions.append(Action(Kind.DISABLE, "removed from the desired state", name))
        for path, have in ((unit_path(name), f.unit_text), (env_path(name), f.env_text)):
            if have is not None:
                actions.append(Action(Kind.REMOVE, "removed from the desired state", name, path,
                                      diff=unified_diff(path, have, None, desired.name, short)))
                reload_needed = True

    if reload_needed:
        actions.append(Action(Kind.DAEMON_RELOAD, "unit files changed on disk"))
    host_rev = (facts.record or {}).get("applied_revision")
    if records or dropped or host_rev != revision:
        actions.append(Action(Kind.RECORD, f"record revision {short} and inventory"))
    actions.sort(key=lambda a: ORDER[a.kind])
    return HostPlan(desired.name, revision, tuple(actions), states, records, tuple(dropped))


def split_for_gate(plan: HostPlan, services: set[str]) -> tuple[HostPlan, HostPlan]:
    """Split a plan around the GPU gate (pure).

    The first part writes files, reloads and *stops* the given services where the plan would
    restart them; the second part starts them (and runs every other start, restart, enable and
    the record). Between the two the caller waits until the old processes have released the GPUs.
    """
    from dataclasses import replace

    first: list[Action] = []
    second: list[Action] = []
    for a in plan.actions:
        if a.kind is Kind.RESTART and a.service in services:
            first.append(Action(Kind.STOP, "stop before the GPU gate", a.service))
            second.append(Action(Kind.START, a.reason + "; GPUs released", a.service))
        elif ORDER[a.kind] < ORDER[Kind.ENABLE]:
            first.append(a)
        else:
            second.append(a)
    first.sort(key=lambda a: ORDER[a.kind])
    return (replace(plan, actions=tuple(first), records={}, dropped_records=()),
            replace(plan, actions=tuple(second)))
