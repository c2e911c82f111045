"""The apply script: a plan's host steps as one shell program (sent on the stdin of `sh -s`).

It starts with the functions of reconciler/sh/apply.sh and marks each step (`step N`): file and
record steps write atomically and stop the script when they fail (`@@fatal`); systemctl steps
report themselves and never stop it (`@@ok`, `@@fail`). Consecutive file writes go as one batch
(one fsync of the temps, a rename each, one fsync of their directories); the intents are a batch
of their own, durable before any file they announce is replaced. Pure: text in, text out.
"""

from __future__ import annotations

import base64
import re
import shlex
from collections.abc import Sequence
from dataclasses import replace

from .. import faults, shell
from ..desired import secrets
from ..desired.spec import SecretSpec
from ..plan import confirm
from ..plan.facts import (
    CREDSTORE,
    HOST_RECORD,
    LOCK_OWNER,
    STATE_DIR,
    adopted_copy,
    cred_env_path,
    cred_path,
    envfile_path,
    record_path,
)
from ..plan.model import Action, HostPlan, Kind, Reason
from ..plan.records import HostRecord, ServiceRecord
from .health import WATCH_PROPS

REMOVED_DIR = f"{STATE_DIR}/removed"
# Seconds an apply script waits, in all, for the jobs of the starts and restarts it runs (job()):
# a restart that is done by then (a quick stop, a Type=simple start) needs no poll of the watch
# after the script's own reading; a slower one adds at most this much before the watch begins.
JOB_WAIT = 1.0
RECORD_MODE = "0600"    # root's alone: records quote a failed server's journal lines; only root reads them

# The functions every apply script starts with: reconciler/sh/apply.sh.
PRELUDE = shell.program("apply")


def _b64(content: str) -> str:
    return base64.b64encode(content.encode()).decode()


def _write(path: str, content: str, mode: str = "0644") -> str:
    """One file written atomically, by itself (text in clear on the script's stdin; base64 only
    for what a shell string cannot hold)."""
    if "\x00" in content:
        return f"atomic_write {shlex.quote(path)} {mode} {_b64(content)}"
    return f"atomic_text {shlex.quote(path)} {mode} {shlex.quote(content)}"


def unit_word(service: str | None) -> str:
    return shlex.quote(f"{service}.service")


def _record_text(rec: ServiceRecord, now: int) -> str:
    """A record as written: a pending deploy stamped with the host's clock."""
    if rec.pending is not None and not rec.pending.at:
        rec = replace(rec, pending=replace(rec.pending, at=now))
    return rec.dumps()


def record_step(name: str, rec: ServiceRecord, now: int) -> str:
    return _write(record_path(name), _record_text(rec, now), RECORD_MODE)


def _files(a: Action, plan: HostPlan, now: int) -> tuple[str, list[tuple[str, str, str]]] | None:
    """A step that only writes files, as (shell to run before them, [(path, content, mode)]);
    None for any other step."""
    q = shlex.quote
    if a.kind in (Kind.INTENT, Kind.RECORD) and a.service:
        assert a.record is not None
        return "", [(record_path(a.service), _record_text(a.record, now), RECORD_MODE)]
    if a.kind is Kind.RECORD:
        pre = " && ".join(f"rm -f {q(record_path(n))}; rm -rf {q(adopted_copy(n, ''))}" for n in plan.dropped_records)
        return pre, [(HOST_RECORD, HostRecord(plan.revision, now).dumps(), RECORD_MODE)]
    if a.kind is Kind.WRITE:
        assert a.path is not None and a.content is not None
        # the env file is root's alone (systemd reads it as root); others can no longer read the
        # env, as they could through `systemctl show` of Environment= lines
        return "", [(a.path, a.content, "0600" if a.service and a.path == envfile_path(a.service) else "0644")]
    if a.kind is Kind.ARM:
        assert a.switch is not None
        # The script is run by `sh script` (confirm.py), so root-only 0600 is enough: no chmod
        return "", [(confirm.script_path(a.switch.service), a.switch.script, "0600")]
    return None


def _secrets(service: str, wanted: Sequence[SecretSpec], *, remove: bool = False) -> str:
    """Deliver a service's secrets: each age secret's value to a root-only file (0600 in a 0700
    directory, written atomically: the value goes to the host on the script's stdin, never on a
    command line), the environment file composed on the host from those files and the referenced
    ones, and nothing else left in its credstore. What was there is kept aside first for the
    deploy's dead-man's switch (confirm.restore_secrets_script); the verdict deletes it."""
    q = shlex.quote
    svc_dir, env, kept = q(f"{CREDSTORE}/{service}"), q(cred_env_path(service)), q(confirm.KEPT)
    lines = [f"(umask 077; mkdir -p {kept}) && chmod 0700 {q(CREDSTORE)} {kept}",
             f"rm -rf {kept}/{q(service)} {kept}/{q(service + '.env')}"]
    if remove:
        return " && ".join([*lines, f"rm -rf {svc_dir} {env}"])
    lines += [f"{{ [ ! -e {svc_dir} ] || cp -a {svc_dir} {kept}/{q(service)}; }}",
              f"{{ [ ! -e {env} ] || cp -p {env} {kept}/{q(service + '.env')}; }}",
              f"(umask 077; mkdir -p {svc_dir}) && chmod 0700 {svc_dir}"]
    keep = []
    for s in sorted(wanted, key=lambda s: s.name):
        if s.source != "age":
            continue
        value = secrets.value(s.digest)
        if value is None:
            return f"echo {q(f'secret {s.name} was not decrypted by this controller')} >&2; false"
        keep.append(s.name)
        lines.append(f"atomic_write {q(cred_path(service, s.name))} 0600 {base64.b64encode(value).decode()}")
    names = " ".join(q(n) for n in keep)
    lines.append(f"for f in {svc_dir}/* {svc_dir}/.[!.]*; do [ -e \"$f\" ] || continue; "
                 f"case \" {names} \" in *\" ${{f##*/}} \"*) ;; *) rm -rf \"$f\";; esac; done")
    env_secrets = [s for s in sorted(wanted, key=lambda s: s.name) if s.env]
    if env_secrets:
        compose = [f"tmp_beside {env}", "umask 077", ': > "$t"', "umask 022",
                   *(f'env_line {q(s.name)} {q(s.path if s.source == "file" else cred_path(service, s.name))} '
                     f'>> "$t"' for s in env_secrets),
                   'sync "$t"', f'mv -f "$t" {env}', f"sync {q(CREDSTORE)}"]
        lines.append("{ " + " && ".join(compose) + "; }")
    else:
        lines.append(f"rm -f {env}")
    return " && ".join(lines)


def _soft(a: Action, wait: str) -> str | None:
    """The systemctl command of a soft step, or None when the action is not one. `wait`: the
    seconds a start or restart waits for its job (job() in the prelude)."""
    u = unit_word(a.service)
    if a.kind is Kind.START and a.fresh:
        return f"job {wait} start {u}"
    return {Kind.STOP: f"u_stop {u}", Kind.DISABLE: f"systemctl disable --quiet --no-reload {u}",
            Kind.ENABLE: f"systemctl enable --quiet --no-reload {u}", Kind.START: f"u_start {wait} {u}",
            Kind.RESTART: f"job {wait} restart {u}"}.get(a.kind)


def _job_wait(actions: Sequence[Action]) -> str:
    """Each start's or restart's wait for its job: JOB_WAIT shared out among them (at least 0.1 s
    each), so a script that restarts many slow services still reaches its watch within JOB_WAIT."""
    n = sum(1 for a in actions if a.kind in (Kind.START, Kind.RESTART))
    return f"{max(0.1, JOB_WAIT / max(1, n)):.2f}"


def _fatal(a: Action, plan: HostPlan, now: int) -> str:
    """The shell of a file or record step (paths and names are validated upstream, quoted here)."""
    q = shlex.quote
    written = _files(a, plan, now)
    if written is not None:        # each file by itself (what a batch cannot carry)
        pre, files = written
        return " && ".join([*([pre] if pre else []), *(_write(p, c, m) for p, c, m in files)])
    if a.kind is Kind.REMOVE and a.reason is Reason.STALE_TEMP:
        assert a.path is not None
        # Only what was there before this run's holder took the lock (its owner file's time):
        # nothing of this run's own, nor of a switch that holds the lock after it.
        p = q(a.path)
        return f"{{ [ ! -e {p} ] && [ ! -L {p} ] || [ {p} -nt {LOCK_OWNER} ] || rm -f {p}; }}"
    if a.kind is Kind.REMOVE:
        assert a.path is not None and a.service is not None
        d = a.path.rsplit("/", 1)[0]
        keep = ""
        if a.reason is Reason.FOREIGN_DROPIN:
            backup = f"{REMOVED_DIR}/{a.service}/{now}{a.path}"
            keep = f"mkdir -p {q(backup.rsplit('/', 1)[0])} && cp -p {q(a.path)} {q(backup)} && "
        return f"{keep}rm -f {q(a.path)} && {{ rmdir {q(d)} 2>/dev/null || true; }}" if d.endswith(".service.d") \
            else f"{keep}rm -f {q(a.path)}"
    if a.kind is Kind.ADOPT:
        assert a.path is not None and a.service is not None
        return f"atomic_copy {q(a.path)} {q(adopted_copy(a.service, a.path))}"
    if a.kind is Kind.RESTORE and a.reason is Reason.RESTORE_MASK:
        assert a.path is not None
        return f"ln -sfn /dev/null {q(a.path)}"
    if a.kind is Kind.RESTORE:
        assert a.path is not None and a.service is not None
        return f"atomic_copy {q(adopted_copy(a.service, a.path))} {q(a.path)}"
    if a.kind is Kind.SECRETS:
        assert a.service is not None
        return _secrets(a.service, a.secrets, remove=a.reason is Reason.REMOVED)
    if a.kind is Kind.DAEMON_RELOAD:
        return 'pause "${RC_PAUSE_BEFORE_RELOAD:-}"; systemctl daemon-reload'
    if a.kind is Kind.ARM_TIMER:
        assert a.switch is not None
        # The timer itself is made only if the controller goes (the lock holder's last act,
        # confirm.arm_pending, runs the re-arm script); here, a timer an earlier controller's
        # holder left armed is stopped (a builtin test where there is none), and once per host
        # the unit and script that arm pending switches (at boot, and for the holder) are
        # installed. The unit only matters at the next boot, so it needs no daemon-reload; the
        # link first, the unit file last, so a cut-short install is done again. Both files
        # staged, one fsync of both, then one of their directories.
        wants = confirm.REARM_LINK.rsplit("/", 1)[0]
        dirs = " ".join(dict.fromkeys(q(p.rsplit("/", 1)[0]) for p in (confirm.REARM_SCRIPT, confirm.REARM_PATH)))
        install = " && ".join([f"{{ [ -d {q(wants)} ] || mkdir -p {q(wants)}; }}",
                               f"ln -sfn {q(confirm.REARM_PATH)} {q(confirm.REARM_LINK)}",
                               f"stage {q(confirm.REARM_SCRIPT)} 0644 {q(confirm.REARM_TEXT)}", 'r1=$t',
                               f"stage {q(confirm.REARM_PATH)} 0644 {q(confirm.REARM_UNIT_TEXT)}", 'r2=$t',
                               'sync "$r1" "$r2"', f'mv -f "$r1" {q(confirm.REARM_SCRIPT)}',
                               f'mv -f "$r2" {q(confirm.REARM_PATH)}', 'TMPS=${TMPS%" $r2"}',
                               'TMPS=${TMPS%" $r1"}', f"sync {dirs}"])
        stale = confirm.stop_if_armed(a.switch.service)
        return f"{{ [ -f {q(confirm.REARM_PATH)} ] || {{ {install}; }}; }} && {{ {stale}; }}"
    if a.kind is Kind.DISARM:
        assert a.service is not None
        return confirm.disarm_script(a.service)
    raise ValueError(a.kind)


# Steps the controller runs itself (not in the host script).
CONTROLLER = frozenset({Kind.FETCH, Kind.HOLD, Kind.KILL_STRAYS, Kind.WAIT_GPUS, Kind.WATCH})


# A path the batched writes may name unquoted in a word list: what the planner produces (unit,
# drop-in, record and switch paths); anything else is written by itself (atomic_text).
_PLAIN_PATH = re.compile(r"^/[A-Za-z0-9_.@:+/-]+\Z")


def _staged(a: Action, plan: HostPlan, now: int) -> tuple[str, list[tuple[str, str, str]]] | None:
    """A file-writing step a batch can carry (`_files`), or None (another step, or a file whose
    path or content a batch cannot hold)."""
    written = _files(a, plan, now)
    if written is None or any("\x00" in c or not _PLAIN_PATH.match(p) for p, c, _ in written[1]):
        return None
    return written


def _batch(group: list[tuple[int, str, list[tuple[str, str, str]]]], first_var: int, *, carry: str = "",
           defer: bool = False) -> tuple[list[str], str]:
    """Consecutive file-writing steps as one batch: every temp file staged (no process), one fsync
    of them all, each renamed over its path, one fsync of their directories. Each file is still
    replaced atomically; a batch is durable before the next step runs (the intent, a batch of
    its own, is on disk before any unit file is replaced). Five processes for three files, where
    one write at a time takes nine.

    carry: directories of the batch before, whose fsync this batch's fsync of its temps takes on
    (before any of its renames, so that batch is still on disk first: one process fewer).
    defer: leave out the last fsync and return its directories instead (else "")."""
    q = shlex.quote
    lines: list[str] = []
    moves: list[tuple[int, str, str]] = []
    n = first_var
    for i, pre, files in group:
        cmds = [f"{{ {pre}; }}"] if pre else []
        for path, content, mode in files:
            n += 1
            cmds.append(f"stage {q(path)} {mode} {q(content)} && W{n}=$t")
            moves.append((i, f"W{n}", path))
        lines += [f"step {i}", " && ".join(cmds) + f" || fatal {i} $?"]
    first, last = group[0][0], group[-1][0]
    temps = " ".join(f'"${v}"' for _, v, _ in moves)
    lines += [f"step {first}", f"sync {carry + ' ' if carry else ''}{temps} || fatal {first} $?",
              'pause "${RC_PAUSE_AFTER_TEMP:-}"']
    at = first
    for i, v, path in moves:
        if i != at:
            lines.append(f"step {i}")
            at = i
        lines.append(f'mv -f "${v}" {q(path)} || fatal {i} $?')
    dirs = " ".join(dict.fromkeys(q(p.rsplit("/", 1)[0] or "/") for _, _, p in moves))
    if at != last:
        lines.append(f"step {last}")
    lines += [] if defer else [f"sync {dirs} || fatal {last} $?"]
    lines += ['TMPS=""', 'pause "${RC_PAUSE_AFTER_RENAME:-}"']
    return lines, dirs if defer else ""


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


def _enable_now(i: int, enable: Action, j: int, start: Action, wait: str) -> str:
    """Steps i (enable) and j (start) of one service in one systemctl. Where that fails (not its
    start job: job() judges that as the watch's), each step runs by itself, as without the
    pairing, so the failure is reported by its own step."""
    u = unit_word(start.service)
    reset = "" if start.fresh else f"systemctl reset-failed {u} 2>/dev/null; "
    return (f"{reset}if job {wait} enable --now --quiet --no-reload {u} >/dev/null 2>&1; "
            f"then printf '@@ok %s\\n@@ok %s\\n' {i} {j}\n"
            f"else soft {i} {_soft(enable, wait)}; step {j}; soft {j} {_soft(start, wait)}; fi")


def build_script(plan: HostPlan, actions: Sequence[Action], now: int) -> str:
    """The given actions of a plan as one script; step N marks plan.actions[N]."""
    index = {id(a): i for i, a in enumerate(plan.actions)}
    # The host's clock: the session's bash gives it (session.py, no process), else `date`
    parts = [PRELUDE, "printf '@@now %s\\n' \"${RECONCILER_NOW:-$(date +%s)}\"", *faults.host_pauses()]
    group: list[tuple[int, str, list[tuple[str, str, str]]]] = []
    staged = 0
    # The intents' directories, whose fsync the next batch takes on; settle() runs it before a
    # step that is no batch (every later step comes after the intents are on disk).
    carry: tuple[int, str] | None = None          # (the intents' last step, their directories)

    def flush() -> None:
        nonlocal staged, carry
        if group:
            intent = plan.actions[group[0][0]].kind is Kind.INTENT
            lines, dirs = _batch(group, staged, carry=carry[1] if carry else "", defer=intent)
            parts.extend(lines)
            carry = (group[-1][0], dirs) if dirs else None
            staged += sum(len(f) for _, _, f in group)
            group.clear()

    def settle() -> None:
        nonlocal carry
        if carry:
            parts.append(f"sync {carry[1]} || fatal {carry[0]} $?")
            carry = None

    paired = _enable_start_pairs(actions)
    wait = _job_wait(actions)
    started_by_enable = {id(s) for s in paired.values()}
    for a in actions:
        if a.kind in CONTROLLER or id(a) in started_by_enable:
            continue
        i = index[id(a)]
        batch = _staged(a, plan, now)
        if batch is not None:
            # The intents are a batch of their own: durable before anything they announce is replaced.
            if group and (a.kind is Kind.INTENT) != (plan.actions[group[-1][0]].kind is Kind.INTENT):
                flush()
            group.append((i, *batch))
            continue
        flush()
        settle()
        soft = _soft(a, wait)
        parts.append(f"step {i}")
        start = paired.get(id(a))
        if start is not None:
            parts.append(_enable_now(i, a, index[id(start)], start, wait))
            continue
        parts.append(f"soft {i} {soft}" if soft else f"{_fatal(a, plan, now)} || fatal {i} $?")
    flush()
    settle()
    parts.append("step done")
    started = sorted({a.service for a in actions if a.kind in (Kind.START, Kind.RESTART) and a.service})
    if started:
        # The health watch's first reading of what this script started, in the same round trip
        # (a job that took longer than its wait is still running then); never fatal.
        parts.append(f"printf '@@show\\n'; systemctl show -p {WATCH_PROPS} {' '.join(unit_word(n) for n in started)} "
                     "2>/dev/null; printf '\\n@@shown\\n'")
    return "\n".join(parts) + "\n"


