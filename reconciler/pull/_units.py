"""The systemd units that run `reconcile pull` on a host: `reconcile pull --install` writes and
enables them, `--uninstall` removes them.

    reconciler-pull.service   Type=oneshot: one `reconcile pull ...` run
    reconciler-pull.timer     every --interval (OnUnitActiveSec=), and soon after boot (OnBootSec=)
    reconciler-pull.path      a local repo only: PathChanged= on the directory of the branch's
                              ref, so a commit or push to a repo on the host starts a run at once

`render_units` is pure; `install` and `uninstall` write /etc/systemd/system and run systemctl
here (they run on the host itself, as root), and say what they did, line by line.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

SERVICE = "reconciler-pull.service"
TIMER = "reconciler-pull.timer"
PATH = "reconciler-pull.path"
UNITS = (SERVICE, TIMER, PATH)
UNIT_DIR = Path("/etc/systemd/system")
HEADER = "# Written by `reconcile pull --install`; `reconcile pull --uninstall` removes it.\n"

_PLAIN = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")

Run = Callable[[list[str]], "subprocess.CompletedProcess[str]"]


def quote(arg: str) -> str:
    """One argument as systemd's ExecStart= reads it: as is when plain, else double-quoted with
    `\\` and `"` escaped; `%` (a specifier) and `$` (a variable) doubled either way."""
    escaped = arg.replace("%", "%%").replace("$", "$$")
    if _PLAIN.match(arg):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


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
            "TimeoutStartSec=infinity\n"
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
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    tmp.replace(path)


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
        with contextlib.suppress(FileNotFoundError):
            (unit_dir / name).unlink()
        said.append(f"{unit_dir / name}: removed")
    if present:
        _systemctl(run, "daemon-reload")
        _systemctl(run, "reset-failed", SERVICE, check=False)
    else:
        said.append(f"nothing to remove: no reconciler-pull units in {unit_dir}")
    return said
