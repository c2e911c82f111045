"""Benchmark: `systemd-analyze security` of the engine check's transient unit, before and after
issue 39 (review 2026-12-03 N2, N8).

One real test host (127.0.0.147 unless RECONCILER_BENCH_SECURITY_ADDRESS says otherwise). For
each case, the properties the host program gives the probe's `systemd-run` are given to a
transient service that sleeps (`systemd-run --unit=NAME -p ... sleep 60`), and systemd scores
its exposure (`systemd-analyze security NAME`: 0 is the most shut in, 10 the least):

- before: the properties engine-probe.sh gave at main 94b2c9d (the unit's User= only, memory,
  time, priority), for a unit without User= (the probe ran as root) and one with User=;
- after: `preflight._enginebox.probe_properties` (with the fixed ones the host program adds)
  for the same units, GPUs hidden (the default).

    sudo .venv/bin/python -m bench.engine_probe_security

Needs root (systemd-nspawn). Prints a table; asserts nothing about the figures.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import tempfile
from pathlib import Path

from reconciler.preflight import probe_properties, unit_entries
from reconciler.preflight._enginebox import unit_settings
from tests import fleet as fleetlib

FIRST = int(os.environ.get("RECONCILER_BENCH_SECURITY_ADDRESS", "147"))
# The options engine-probe.sh gives systemd-run itself, before and after (then, before: User=
# when the unit had one; after: the properties the controller sends).
FIXED = ["MemoryMax=4G", "RuntimeMaxSec=120", "Nice=19", "IOSchedulingClass=idle", "CPUSchedulingPolicy=batch"]
UNITS = {"no User=": "[Service]\nExecStart=/opt/s/bin/python3 -m sglang.launch_server\n",
         "User=svc": "[Service]\nUser=svc\nExecStart=/opt/s/bin/python3 -m sglang.launch_server\n"}
_SCORE = re.compile(r"Overall exposure level for \S+: (\d+(?:\.\d+)?) (\S+)")


def cases() -> list[tuple[str, str, list[str]]]:
    """(case, unit, properties) for each unit, before and after."""
    out = []
    for name, text in UNITS.items():
        entries = unit_settings(unit_entries(text))
        user = [f"User={v}" for k, v in entries if k == "User"]
        out.append(("before", name, FIXED + user))
        out.append(("after", name, FIXED + probe_properties(entries, "hidden")))
    return out


def score(ssh: list[str], unit: str, props: list[str]) -> tuple[str, str, str]:
    """The exposure score of a transient service with these properties, and its worst lines."""
    start = " ".join(["systemd-run", f"--unit={unit}", "--quiet", "--service-type=exec",
                      *(f"-p {shlex.quote(p)}" for p in props), "sleep 60"])
    script = (f"{start} && systemd-analyze security --no-pager {unit}.service; rc=$?; "
              f"systemctl stop {unit}.service >/dev/null 2>&1; exit $rc")
    res = subprocess.run([*ssh, script], capture_output=True, text=True, timeout=120)
    m = _SCORE.search(res.stdout)
    if m is None:
        raise RuntimeError(f"no score for {unit}: {res.stdout[-2000:]}{res.stderr[-2000:]}")
    worst = [line.split()[1] for line in res.stdout.splitlines() if line.startswith("✗")]
    return m.group(1), m.group(2), ", ".join(worst[:6])


def main() -> None:
    fleetlib.build()
    hosts = fleetlib.up(1, first=FIRST, prefix="sec")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            kh = fleetlib.write_known_hosts(hosts, Path(tmp) / "known_hosts")
            ssh = fleetlib.ssh_base(hosts[0].address, kh)
            subprocess.run([*ssh, "id svc >/dev/null 2>&1 || useradd -m svc"], check=True, timeout=60)
            version = subprocess.run([*ssh, "systemctl --version | head -n 1"], capture_output=True, text=True,
                                     timeout=60).stdout.strip()
            print(f"systemd-analyze security of the engine probe's transient unit ({version}; 0 best, 10 worst)")
            print(f"{'when':<7} {'unit':<9} {'exposure':<15} still exposed (first six)")
            for i, (when, name, props) in enumerate(cases()):
                value, verdict, worst = score(ssh, f"reconciler-probe-bench-{i}", props)
                print(f"{when:<7} {name:<9} {value + ' ' + verdict:<15} {worst}")
            print("\nafter, properties (no User=):")
            print("  " + " ".join(cases()[1][2]))
    finally:
        fleetlib.down(hosts)


if __name__ == "__main__":
    main()
