"""The systemd units that run `reconcile pull` on a host: `reconcile pull --install` writes and
enables them, `--uninstall` removes them.

    reconciler-pull.service   Type=oneshot: one `reconcile pull ...` run
    reconciler-pull.timer     every --interval (OnUnitActiveSec=), and soon after boot (OnBootSec=)
    reconciler-pull.path      a local repo only: PathChanged= on the directory of the branch's
                              ref, so a commit or push to a repo on the host starts a run at once

`render_units` is pure; `install` and `uninstall` write /etc/systemd/system and run systemctl
here (they run on the host itself, as root), and say what they did, line by line.

The units are root's alone (0600: systemd reads them as root; the command line names the repo,
the signers file and the age identity), and the service is sandboxed as far as a run allows
(SANDBOX). `untrusted_paths` refuses an interpreter or package that another user could change
before it is made the ExecStart= of a root service.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

SERVICE = "reconciler-pull.service"
TIMER = "reconciler-pull.timer"
PATH = "reconciler-pull.path"
UNITS = (SERVICE, TIMER, PATH)
UNIT_DIR = Path("/etc/systemd/system")
HEADER = "# Written by `reconcile pull --install`; `reconcile pull --uninstall` removes it.\n"

UNIT_MODE = 0o600
# Where a run keeps its own files under the sandbox (home directories are read-only there).
STATE = "/var/lib/reconciler/pull/state"
CACHE = "/var/cache/reconciler-pull"

# What `reconcile pull` needs, and so what the sandbox leaves it: it runs systemctl and
# systemd-run (PID 1 does the work, over its socket); it writes units and drop-ins under
# /etc/systemd/system, env files and credentials under /etc/reconciler and /var/lib/reconciler,
# its mirror, state and cache; it reads /proc of the processes holding GPUs (the GPU gate: other
# users' too, hence CAP_SYS_PTRACE) and opens /dev/nvidia* through nvidia-smi (so no
# PrivateDevices= and no ProtectClock=, whose device rule closes every other device); and it runs
# the services' model fetch commands, which write their model paths anywhere but /usr, /boot
# and home directories, and may read a token there (ProtectHome=read-only, not yes). Their /tmp
# is private: a model path under /tmp does not work in pull mode.
SANDBOX = """\
NoNewPrivileges=yes
ProtectSystem=yes
ProtectHome=read-only
PrivateTmp=yes
PrivateMounts=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectHostname=yes
RestrictSUIDSGID=yes
RestrictRealtime=yes
RestrictNamespaces=yes
LockPersonality=yes
KeyringMode=private
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallErrorNumber=EPERM
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
CapabilityBoundingSet=CAP_CHOWN CAP_DAC_OVERRIDE CAP_DAC_READ_SEARCH CAP_FOWNER CAP_FSETID CAP_KILL CAP_SETUID \
CAP_SETGID CAP_SYS_PTRACE
"""

_PLAIN = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+\Z")

Run = Callable[[list[str]], "subprocess.CompletedProcess[str]"]


def quote(arg: str) -> str:
    """One argument as systemd's ExecStart= reads it: as is when plain, else double-quoted with
    `\\` and `"` escaped and a line break as `\\n` (a unit line never breaks); `%` (a specifier) and
    `$` (a variable) doubled either way."""
    escaped = arg.replace("%", "%%").replace("$", "$$")
    if _PLAIN.match(arg):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def seconds(value: float) -> str:
    """A time span as systemd reads it: 60s, 0.500s."""
    return f"{int(value)}s" if float(value).is_integer() else f"{value:.3f}s"


def render_units(argv: Sequence[str], *, interval: float, splay: float, watch: str | None) -> dict[str, str]:
    """PURE: the unit files (name -> text) that run `argv` every `interval` seconds (plus a random
    delay up to `splay`, to spread a fleet's fetches), soon after boot, and, with `watch` (a
    directory of the repo's refs), whenever it changes."""
    command = " ".join(quote(a) for a in argv)
    units = {
        SERVICE: (
            f"{HEADER}[Unit]\n"
            "Description=Reconcile this host from its desired-state repo (reconcile pull)\n"
            "Wants=network-online.target\nAfter=network-online.target\n"
            "# The timer and the path unit may ask often: never refuse a start for that.\n"
            "StartLimitIntervalSec=0\n\n"
            "[Service]\nType=oneshot\n"
            f"ExecStart={command}\n"
            "# A deploy waits for its services' health: a big model may take many minutes to load.\n"
            "# Each step has a time-out of its own (the git fetch: a minute of silence).\n"
            "TimeoutStartSec=infinity\n"
            f"Environment=RECONCILER_STATE_DIR={STATE} RECONCILER_CACHE_DIR={CACHE}\n"
            f"CacheDirectory={CACHE.removeprefix('/var/cache/')}\nCacheDirectoryMode=0700\n"
            "# Sandboxed as far as a run allows (reconciler/pull/_units.py says what it needs).\n"
            + SANDBOX
        ),
        TIMER: (
            f"{HEADER}[Unit]\n"
            f"Description=Run reconcile pull every {seconds(interval)}\n\n"
            "[Timer]\n"
            f"OnBootSec={seconds(min(interval, 60.0))}\n"
            f"OnUnitActiveSec={seconds(interval)}\n"
            "AccuracySec=1s\n"
            + (f"RandomizedDelaySec={seconds(splay)}\n" if splay > 0 else "")
            + f"Unit={SERVICE}\n\n[Install]\nWantedBy=timers.target\n"
        ),
    }
    if watch is not None:
        units[PATH] = (
            f"{HEADER}[Unit]\n"
            f"Description=Run reconcile pull when a branch of the repo changes ({watch})\n\n"
            "[Path]\n"
            f"PathChanged={watch.replace('%', '%%')}\n"
            f"Unit={SERVICE}\n\n[Install]\nWantedBy=paths.target\n"
        )
    return units


def _systemctl(run: Run, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = run(["systemctl", *args])
    if check and res.returncode != 0:
        raise OSError(f"systemctl {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def _write(path: Path, text: str) -> None:
    """Write a unit root-only from its first byte (never readable by others, even for a moment)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, UNIT_MODE)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), UNIT_MODE)
        f.write(text)
    tmp.replace(path)


def untrusted_paths(paths: Iterable[str], *, lstat: Callable[[str], os.stat_result] = os.lstat) -> str | None:
    """The first of `paths` (the interpreter, its prefix, the package), or of the directories
    above them (as given and as resolved), that a user other than root owns or that group or
    others may write; None when every one is root's. A root service must run only code that
    only root can change."""
    for given in paths:
        chain = {Path(os.path.abspath(given)), Path(os.path.realpath(given))}
        for p in sorted({q for c in chain for q in (c, *c.parents)}):
            try:
                st = lstat(str(p))
            except OSError as e:
                return f"{p} ({e.strerror or e})"
            writable = st.st_mode & 0o022 and not stat.S_ISLNK(st.st_mode)
            if st.st_uid != 0 or writable:
                return f"{p} (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def install(units: dict[str, str], *, unit_dir: Path = UNIT_DIR, run: Run = _run) -> list[str]:
    """Write the units (only those that changed), enable and start the timer (and the path
    unit), and start one run now. Idempotent: a second install with the same units changes
    nothing. Returns what it did, a line each; raises OSError when systemctl fails."""
    said: list[str] = []
    changed: list[str] = []
    unit_dir.mkdir(parents=True, exist_ok=True)
    for name, text in units.items():
        path = unit_dir / name
        old = path.read_text() if path.exists() else None
        if old == text:
            if stat.S_IMODE(path.stat().st_mode) != UNIT_MODE:     # written by an older version: 0644
                os.chmod(path, UNIT_MODE)
                said.append(f"{path}: unchanged, made root-only ({UNIT_MODE:04o})")
            else:
                said.append(f"{path}: unchanged")
            continue
        _write(path, text)
        changed.append(name)
        said.append(f"{path}: {'updated' if old is not None else 'written'}")
    stale = [n for n in (PATH,) if n not in units and (unit_dir / n).exists()]
    for name in stale:
        _systemctl(run, "disable", "--now", name, check=False)
        (unit_dir / name).unlink()
        said.append(f"{unit_dir / name}: removed (the repo is not a local path any more)")
    if changed or stale:
        _systemctl(run, "daemon-reload")
    triggers = [n for n in (TIMER, PATH) if n in units]
    _systemctl(run, "enable", "--now", *triggers)
    again = [n for n in triggers if n in changed]
    if again:
        _systemctl(run, "restart", *again)      # an active timer takes a new interval only when restarted
    said.append(f"enabled and started {', '.join(triggers)}")
    _systemctl(run, "start", "--no-block", SERVICE)
    said.append(f"started {SERVICE} once now (journalctl -u {SERVICE} shows its runs)")
    return said


def uninstall(*, unit_dir: Path = UNIT_DIR, run: Run = _run) -> list[str]:
    """Stop and remove the units (a run in progress finishes); say what was removed."""
    said: list[str] = []
    present = [n for n in UNITS if (unit_dir / n).exists()]
    triggers = [n for n in (TIMER, PATH) if n in present]
    if triggers:
        _systemctl(run, "disable", "--now", *triggers, check=False)
    for name in present:
        (unit_dir / name).unlink(missing_ok=True)
        said.append(f"{unit_dir / name}: removed")
    if present:
        _systemctl(run, "daemon-reload")
        _systemctl(run, "reset-failed", SERVICE, check=False)
    else:
        said.append(f"nothing to remove: no reconciler-pull units in {unit_dir}")
    return said
