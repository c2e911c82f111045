#!/usr/bin/env python3
"""A STAND-IN for `systemctl`, for the GPU machine, which has no systemd (not systemd).

Just enough of systemctl for the reconciler's apply script, observation and health watch to
run unchanged through a local shell (bench/gpu_gate_apply_device.py puts it first on PATH as
`systemctl`): units are /etc/systemd/system/NAME.service plus NAME.service.d/*.conf drop-ins;
`start` runs ExecStart= (with the units' Environment= lines) under a small supervisor that
records its exit; `stop` sends SIGTERM (SIGKILL after 15 s); `show -p ...` prints the
properties the reconciler reads. State lives in /run/fake-systemd (FAKE_SYSTEMD_DIR).
Standard library only.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

UNITS = Path(os.environ.get("FAKE_SYSTEMD_UNITS", "/etc/systemd/system"))
STATE = Path(os.environ.get("FAKE_SYSTEMD_DIR", "/run/fake-systemd"))


def _name(unit: str) -> str:
    return unit if unit.endswith(".service") else unit + ".service"


def _state(unit: str) -> dict:
    p = STATE / f"{unit}.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


def _save(unit: str, st: dict) -> None:
    STATE.mkdir(parents=True, exist_ok=True)
    tmp = STATE / f".{unit}.tmp"
    tmp.write_text(json.dumps(st))
    os.replace(tmp, STATE / f"{unit}.json")


def _unit_entries(unit: str) -> list[tuple[str, str]]:
    files = [UNITS / unit, *sorted((UNITS / f"{unit}.d").glob("*.conf"))]
    out: list[tuple[str, str]] = []
    for f in files:
        if not f.is_file():
            continue
        text = f.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            key, sep, value = line.strip().partition("=")
            if sep and not key.startswith(("#", ";", "[")):
                out.append((key.strip(), value.strip()))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _show(unit: str, props: list[str]) -> str:
    st = _state(unit)
    exists = (UNITS / unit).is_file()
    pid = int(st.get("pid", 0) or 0)
    running = bool(pid) and _alive(pid)
    if running:
        active, sub = "active", "running"
    elif st.get("failed"):
        active, sub = "failed", "failed"
    else:
        active, sub = "inactive", "dead"
    values = {
        "Id": unit, "LoadState": "loaded" if exists else "not-found", "ActiveState": active, "SubState": sub,
        "Result": "exit-code" if st.get("failed") else "success", "NRestarts": "0",
        "ExecMainCode": "1", "ExecMainStatus": str(st.get("status", 0)), "ExecMainPID": str(pid if running else 0),
        "InvocationID": st.get("invocation", ""), "NeedDaemonReload": "no",
        "FragmentPath": str(UNITS / unit) if exists else "", "DropInPaths": "",
        "UnitFileState": "enabled" if st.get("enabled") else ("disabled" if exists else ""),
        "ActiveEnterTimestampMonotonic": str(st.get("active_enter", 0)),
    }
    return "\n".join(f"{p}={values.get(p, '')}" for p in props) + "\n"


def _start(unit: str) -> int:
    st = _state(unit)
    if st.get("pid") and _alive(int(st["pid"])):
        return 0
    entries = _unit_entries(unit)
    exec_start = [v for k, v in entries if k == "ExecStart" and v][-1:]
    if not exec_start:
        print(f"Failed to start {unit}: Unit {unit} has a bad unit file setting.", file=sys.stderr)
        return 1
    env = dict(os.environ)
    for k, v in entries:
        if k == "Environment":
            for word in shlex.split(v):
                name, _, value = word.partition("=")
                env[name] = value
        elif k == "EnvironmentFile":      # the reconciler's env file: NAME="value" lines
            path = Path(v.lstrip("-"))
            if path.is_file():
                for line in path.read_text().splitlines():
                    name, eq, value = line.partition("=")
                    if eq and not name.startswith("#"):
                        env[name] = re.sub(r"\\(.)", r"\1", value[1:-1]) if value[:1] == '"' else value
    log = open(STATE / f"{unit}.log", "ab")  # noqa: SIM115 -- the supervisor keeps it
    # The supervisor itself runs with a plain environment: only the service gets the unit's.
    sup = subprocess.Popen([sys.executable, __file__, "__supervise", unit, exec_start[0]],
                           env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "FAKE_SYSTEMD_ENV": json.dumps(env)},
                           stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not _state(unit).get("pid"):
        time.sleep(0.01)
    return 0 if sup.poll() in (None, 0) else 1


def _supervise(unit: str, command: str) -> int:
    child = subprocess.Popen(shlex.split(command), env=json.loads(os.environ["FAKE_SYSTEMD_ENV"]))
    _save(unit, {**_state(unit), "pid": child.pid, "invocation": uuid.uuid4().hex, "failed": False,
                 "active_enter": time.monotonic_ns() // 1000})
    signal.signal(signal.SIGTERM, lambda *_: child.terminate())
    code = child.wait()
    st = _state(unit)
    _save(unit, {**st, "failed": code != 0 and not st.get("stopping"), "status": code, "stopping": False})
    return 0


def _stop(unit: str) -> int:
    st = _state(unit)
    pid = int(st.get("pid", 0) or 0)
    if pid and _alive(pid):
        _save(unit, {**st, "stopping": True})
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
            while _alive(pid):
                time.sleep(0.05)
    _save(unit, {**_state(unit), "pid": 0})
    return 0


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("--") or a.startswith("--property")]
    if not args:
        return 0
    verb, rest = args[0], args[1:]
    if verb == "__supervise":
        return _supervise(rest[0], rest[1])
    if verb == "show":
        props: list[str] = []
        units: list[str] = []
        it = iter(argv[1:])
        for a in it:
            if a == "-p":
                props += next(it).split(",")
            elif not a.startswith("-"):
                units.append(_name(a))
        print("\n".join(_show(u, props) for u in units), end="")
        return 0
    units = [_name(u) for u in rest if not u.startswith("-")]
    for u in units:
        if verb == "start" and _start(u):
            return 1
        if verb == "stop":
            _stop(u)
        if verb == "restart":
            _stop(u)
            if _start(u):
                return 1
        if verb in ("enable", "disable"):
            _save(u, {**_state(u), "enabled": verb == "enable"})
        if verb == "reset-failed":
            _save(u, {**_state(u), "failed": False})
    return 0            # daemon-reload and anything else: nothing to do here


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
