"""The apply script: a plan's host steps as calls of reconciler/sh/apply.sh's functions (pure).

`ApplyScript(plan, actions, now)` is the executor's host program: apply.sh (every step's shell
is a function there, shellcheck-clean), its constants and parameters, then one call a line with
named arguments (`stage_file step=3 path=... mode=0600 text=...`), sent on the stdin of `sh -s`
(file contents and secret values never go on a command line). What is decided here is only
which calls: consecutive file writes go as one batch (one fsync of the temps, a rename each,
their directories' fsync left to the next file step or the end); the intents are a batch of
their own, on disk before any file they announce is replaced; a service's enable and first
start go as one `systemctl enable --now`; the starts share JOB_WAIT. Text in, text out.
"""

from __future__ import annotations

import base64
import re
import shlex
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import ClassVar

from .. import faults
from ..desired import secrets
from ..desired.spec import SecretSpec
from ..frames import HostProgram, Records
from ..plan import confirm, layout
from ..plan.facts.apply import ApplyAnswer, parse_apply
from ..plan.layout import (
    HOST_RECORD,
    REMOVED_DIR,
    adopted_copy,
    cred_path,
    envfile_path,
    record_path,
)
from ..plan.model import Action, HostPlan, Kind, Reason
from ..plan.records import HostRecord, ServiceRecord
from ..values import replace
from .health import WATCH_PROPS

# Seconds an apply script waits, in all, for the jobs of the starts and restarts it runs (job()):
# a restart that is done by then (a quick stop, a Type=simple start) needs no poll of the watch
# after the script's own reading; a slower one adds at most this much before the watch begins.
JOB_WAIT = 1.0
RECORD_MODE = "0600"    # root's alone: records quote a failed server's journal lines; only root reads them

# Steps the controller runs itself (not in the host script).
CONTROLLER = frozenset({Kind.FETCH, Kind.HOLD, Kind.KILL_STRAYS, Kind.WAIT_GPUS, Kind.WATCH, Kind.REJOIN})

# A path a batch may carry: what the planner produces (unit, drop-in, record and switch paths);
# anything else is written by itself (write_file).
_PLAIN_PATH = re.compile(r"^/[A-Za-z0-9_.@:+/-]+\Z")

Files = list[tuple[str, str, str]]       # (path, content, mode)


def call(function: str, **named: str | int | None) -> str:
    """One line of the script: apply.sh's `function` with its named arguments (None: left out),
    each word shell-quoted."""
    words = [function, *(shlex.quote(f"{k}={v}") for k, v in named.items() if v is not None)]
    return " ".join(words)


def unit_name(service: str | None) -> str:
    return f"{service}.service"


def _record_text(rec: ServiceRecord, now: int) -> str:
    """A record as written: a pending deploy stamped with the host's clock."""
    if rec.pending is not None and not rec.pending.at:
        rec = replace(rec, pending=replace(rec.pending, at=now))
    return rec.dumps()


def _files(a: Action, plan: HostPlan, now: int) -> Files | None:
    """The files a step that only writes files writes; None for any other step."""
    if a.kind in (Kind.INTENT, Kind.RECORD) and a.service:
        assert a.record is not None
        return [(record_path(a.service), _record_text(a.record, now), RECORD_MODE)]
    if a.kind is Kind.RECORD:
        return [(HOST_RECORD, HostRecord(plan.revision, now).dumps(), RECORD_MODE)]
    if a.kind is Kind.WRITE:
        assert a.path is not None and a.content is not None
        # the env file is root's alone (systemd reads it as root); others can no longer read the
        # env, as they could through `systemctl show` of Environment= lines
        return [(a.path, a.content, "0600" if a.service and a.path == envfile_path(a.service) else "0644")]
    if a.kind is Kind.ARM:
        assert a.switch is not None
        # The script is run by `sh script` (confirm.py), so root-only 0600 is enough: no chmod
        return [(confirm.script_path(a.switch.service), a.switch.script, "0600")]
    return None


def _batchable(files: Files) -> bool:
    return all("\x00" not in c and _PLAIN_PATH.match(p) for p, c, _ in files)


def _write(i: int, path: str, content: str, mode: str) -> str:
    """One file written by itself (text as it is; base64 only for what a shell word cannot hold)."""
    if "\x00" in content:
        return call("write_file", step=i, path=path, mode=mode, base64=base64.b64encode(content.encode()).decode())
    return call("write_file", step=i, path=path, mode=mode, text=content)


def _secrets(i: int, service: str, wanted: Sequence[SecretSpec], *, remove: bool) -> Iterator[str]:
    """Deliver a service's secrets (apply.sh's secrets_aside, secret, secrets_env): each age
    secret's value from this controller's decrypted ones, the environment file composed on the
    host from those files and the referenced ones."""
    yield call("secrets_aside", step=i, service=service, remove=1 if remove else None)
    if remove:
        return
    keep = []
    for s in sorted(wanted, key=lambda s: s.name):
        if s.source != "age":
            continue
        value = secrets.value(s.digest)
        if value is None:
            yield call("refuse", step=i, message=f"secret {s.name} was not decrypted by this controller")
            return
        keep.append(s.name)
        yield call("secret", step=i, service=service, name=s.name, base64=base64.b64encode(value).decode())
    env = [f"{s.name}={s.path if s.source == 'file' else cred_path(service, s.name)}"
           for s in sorted(wanted, key=lambda s: s.name) if s.env]
    yield call("secrets_env", step=i, service=service, keep=" ".join(keep), env=" ".join(env))


# Steps that name a path alone, by their reason: a temp file a killed run left (removed only if
# older than this run's lock), a masked unit's link put back.
_PATH_ONLY = {Reason.STALE_TEMP: "remove_stale", Reason.RESTORE_MASK: "mask"}


def _file_step(i: int, a: Action, now: int) -> Iterator[str]:
    """The calls of a file step that writes no file of its own (a step of kind N is step i);
    ValueError for a step that is none."""
    if a.kind in (Kind.REMOVE, Kind.RESTORE) and (fn := _PATH_ONLY.get(a.reason)) is not None:
        assert a.path is not None
        yield call(fn, step=i, path=a.path)
    elif a.kind is Kind.REMOVE:
        assert a.path is not None and a.service is not None
        backup = f"{REMOVED_DIR}/{a.service}/{now}{a.path}" if a.reason is Reason.FOREIGN_DROPIN else None
        yield call("remove", step=i, path=a.path, backup=backup)
    elif a.kind is Kind.ADOPT:
        assert a.path is not None and a.service is not None
        yield call("copy_file", step=i, **{"from": a.path}, to=adopted_copy(a.service, a.path))
    elif a.kind is Kind.RESTORE:
        assert a.path is not None and a.service is not None
        yield call("copy_file", step=i, **{"from": adopted_copy(a.service, a.path)}, to=a.path)
    elif a.kind is Kind.SECRETS:
        assert a.service is not None
        yield from _secrets(i, a.service, a.secrets, remove=a.reason is Reason.REMOVED)
    elif a.kind is Kind.DAEMON_RELOAD:
        yield call("reload", step=i)
    elif a.kind is Kind.ARM_TIMER:
        assert a.switch is not None
        yield call("arm_timer", step=i, service=a.switch.service, script=confirm.rearm_text(),
                   unit=confirm.REARM_UNIT_TEXT)
    elif a.kind is Kind.DISARM:
        yield call("disarm", step=i, service=a.service, wait=1)
    else:
        raise ValueError(a.kind)


def _fatal(i: int, a: Action, plan: HostPlan, now: int) -> Iterator[str]:
    """A file or record step that is no batch (paths and names are validated upstream): its
    calls stop the script where they fail."""
    written = _files(a, plan, now)
    if written is None:
        yield from _file_step(i, a, now)
        return
    if a.kind is Kind.RECORD and not a.service:          # what a batch cannot carry, by itself
        yield from (call("drop_record", step=i, service=n) for n in plan.dropped_records)
    yield from (_write(i, p, c, m) for p, c, m in written)


def _soft(i: int, a: Action, wait: str) -> str | None:
    """The call of a systemctl step (soft), or None when the action is not one. `wait`: the
    seconds a start or restart waits for its job."""
    u = unit_name(a.service)
    if a.kind is Kind.START:
        return call("start", step=i, unit=u, wait=wait, fresh=1 if a.fresh else None)
    return {Kind.STOP: call("stop", step=i, unit=u), Kind.DISABLE: call("enable", step=i, unit=u, off=1),
            Kind.ENABLE: call("enable", step=i, unit=u),
            Kind.RESTART: call("start", step=i, unit=u, wait=wait, restart=1)}.get(a.kind)


def _job_wait(actions: Sequence[Action]) -> str:
    """Each start's or restart's wait for its job: JOB_WAIT shared out among them (at least 0.1 s
    each), so a script that restarts many slow services still reaches its watch within JOB_WAIT."""
    n = sum(1 for a in actions if a.kind in (Kind.START, Kind.RESTART))
    return f"{max(0.1, JOB_WAIT / max(1, n)):.2f}"


def _enable_start_pairs(actions: Sequence[Action]) -> dict[int, Action]:
    """id(enable) -> the start of the same service, where only enables and starts lie between
    them (the plan's order: every enable, then every start): one `systemctl enable --now` does
    both, one systemctl process fewer per service started for the first time."""
    pairs: dict[int, Action] = {}
    for n, a in enumerate(actions):
        if a.kind is not Kind.ENABLE:
            continue
        for b in actions[n + 1:]:
            if b.kind not in (Kind.ENABLE, Kind.START):
                break
            if b.kind is Kind.START and b.service == a.service:
                pairs[id(a)] = b
                break
    return pairs


class _Calls:
    """The script's calls, a line each, as steps() adds them: file steps that a batch can carry
    staged and committed together (the intents a batch of their own)."""

    def __init__(self, plan: HostPlan, now: int) -> None:
        self.plan, self.now = plan, now
        self.lines = ["now"]
        self.batch: list[str] = []
        self.intents = False

    def commit(self) -> None:
        if self.batch:
            self.lines.extend([*self.batch, "commit"])
            self.batch.clear()

    def staged(self, i: int, a: Action) -> bool:
        """Stage a file step's files in the batch; False where the step is no batchable one."""
        files = _files(a, self.plan, self.now)
        if files is None or not _batchable(files):
            return False
        # The intents are a batch of their own: on disk before anything they announce is replaced.
        if self.batch and (a.kind is Kind.INTENT) != self.intents:
            self.commit()
        self.intents = a.kind is Kind.INTENT
        if a.kind is Kind.RECORD and not a.service:
            self.batch.extend(call("drop_record", step=i, service=n) for n in self.plan.dropped_records)
        self.batch.extend(call("stage_file", step=i, path=p, mode=m, text=c) for p, c, m in files)
        return True

    def add(self, lines: Iterable[str]) -> None:
        """Calls of a step that is no batch: the batch before it goes first."""
        self.commit()
        self.lines.extend(lines)


def steps(plan: HostPlan, actions: Sequence[Action], now: int) -> list[str]:
    """The given actions of a plan as calls, a line each; step N is plan.actions[N]."""
    index = {id(a): i for i, a in enumerate(plan.actions)}
    out = _Calls(plan, now)
    paired = _enable_start_pairs(actions)
    wait = _job_wait(actions)
    started_by_enable = {id(s) for s in paired.values()}
    for a in actions:
        if a.kind in CONTROLLER or id(a) in started_by_enable:
            continue
        i = index[id(a)]
        if out.staged(i, a):
            continue
        if (start := paired.get(id(a))) is not None:
            out.add([call("enable_now", step=i, start=index[id(start)], unit=unit_name(a.service), wait=wait,
                          fresh=1 if start.fresh else None)])
            continue
        soft = _soft(i, a, wait)
        out.add([soft] if soft is not None else _fatal(i, a, plan, now))
    out.commit()
    started = sorted({unit_name(a.service) for a in actions if a.kind in (Kind.START, Kind.RESTART) and a.service})
    out.lines.append(call("finish", units=" ".join(started) or None))
    return out.lines


class ApplyScript(HostProgram[ApplyAnswer], frozen=True):
    """reconciler/sh/apply.sh with the calls of the given actions (its steps) as its payload; or
    `calls` given as they are (a verdict's, a GPU fault's). `steps`: how many steps the calls
    number (0 to steps - 1); a record naming any other step is not one of them."""

    name: ClassVar[str] = "apply"
    script_on_stdin: ClassVar[bool] = True
    fragments: ClassVar[tuple[str, ...]] = ()     # its parameters are assignments, its steps' words read by args()
    constants: ClassVar[Mapping[str, str]] = {
        "STATE": layout.STATE_DIR, "UNIT_DIR": layout.UNIT_DIR, "CREDSTORE": layout.CREDSTORE, "KEPT": layout.KEPT,
        "TRANSIENT": layout.TRANSIENT, "WANTS": layout.WANTS, "REARM_PATH": layout.REARM_PATH,
        "REARM_LINK": layout.REARM_LINK, "REARM_SCRIPT": layout.REARM_SCRIPT, "LOCK_OWNER": layout.LOCK_OWNER,
        "TEMP": layout.TEMP, "SWITCH": layout.SWITCH, "CONFIRM": layout.CONFIRM_DIR,
        "WATCH_PROPS": WATCH_PROPS}
    calls: tuple[str, ...]
    steps: int

    @classmethod
    def of(cls, plan: HostPlan, actions: Sequence[Action], now: int) -> ApplyScript:
        """The script of the given actions of a plan: step N is plan.actions[N]."""
        return cls(tuple(steps(plan, actions, now)), len(plan.actions))

    def params(self) -> Mapping[str, str]:
        # fault injection only (faults.py): the pauses the environment asks for
        return faults.host_pauses()

    def payload(self) -> str:
        return "".join(c + "\n" for c in self.calls)

    def parse(self, answer: Records) -> ApplyAnswer:
        return parse_apply(answer, self.steps)


def record_calls(name: str, rec: ServiceRecord, *, stop: bool = False, disarm: bool = True) -> tuple[str, ...]:
    """A verdict's calls, two steps: the record written at once, by itself (step 0), the
    deploy's switch disarmed (its timer queued to stop only where one is loaded), and the unit
    stopped (step 1)."""
    calls = [_write(0, record_path(name), _record_text(rec, 0), RECORD_MODE)]
    if disarm:
        calls.append(call("disarm", service=name))
    if stop:
        calls.append(call("stop", step=1, unit=unit_name(name)))
    return (*calls, "finish")
