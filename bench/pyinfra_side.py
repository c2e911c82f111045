"""Benchmark: `reconcile` side by side with pyinfra 3.10 and the floor: one env change on every host.

The same real hosts, each running the stand-in service `bench` (set up as bench/compare.py does);
a new BENCH_VALUE means its env file is written and it restarts. Whole processes, median of
--rounds; per round, in an order that rotates:

  reconcile    commit a new value; python -m reconciler --repo R --concurrency N   (the real CLI)
  floor        python -m bench.floor SPEC with a new value (bare asyncssh, bench/floor.py)
  pyinfra      PYINFRA INVENTORY DEPLOY -y --parallel N (-y: no prompt, no change-detection pass):
               files.put of the three files the reconciler writes (unit, env drop-in, env file; its
               modes), systemd.daemon_reload only if a file under /etc/systemd/system changed, and
               systemd.service(running, enabled, restarted) only if any did (`_if=any_changed(...)`)

Untimed after the floor and pyinfra: pyinfra's hosts are checked (env file with the new value,
mode 600, unit active), then the floor puts the reconciler's value back, so each run is a
one-value change; `systemctl reset-failed` before each run keeps systemd's start rate limit off.
pyinfra's inventory (a temp dir) logs in as root with the fleet's client key and trusts the hosts
by the bench's own known_hosts, strict checking on ("yes"); an empty ssh config keeps
~/.ssh/config out. pyinfra 3.10 runs op by op, all hosts in step, one shell per command: for one
env change a host gets 9 facts (File, its folder's Directory and Sha1File per file), TmpDir, an
SFTP upload, a chmod, SystemdStatus, the restart and SystemdEnabled.

Figures per tool: wall seconds; controller CPU (user + system from wait4, of the process and the
children it waited for; pyinfra is one process, gevent + paramiko, and starts none); peak RSS (max
over rounds); processes started on the hosts (HostPids, exact); and host CPU seconds, what the
test hosts burned: each container's cgroup v2 `cpu.stat` usage_usec (the cgroup of its PID 1, less
init.scope: the whole container, sshd and its sessions, shells, systemctl, systemd, journald, the
service's stop and start; not the systemd-nspawn supervising it, nor the bench's nsenter reads).
Each reading waits until the hosts are idle (under 1 ms per host in 0.2 s; an idle host with its
service burns about 0.3 ms/s), so what a run leaves going (a session closing, the service
starting) counts. At start a known burn on the first host (a shell loop, counted by the shell's
own `times`) must read the same by the cgroup, or the bench stops. Bytecode is cached for every
tool (PYTHONPYCACHEPREFIX, as in bench/compare.py) by an untimed run first.

pyinfra is not a dependency of the project: it lives in a virtual environment of its own
(.venv-pyinfra, ignored by git), from the repository's root:

    python3 -m venv .venv-pyinfra && .venv-pyinfra/bin/pip install pyinfra==3.10.0
    sudo .venv/bin/python -m bench.pyinfra_side                          # 30 hosts, 5 rounds
    sudo .venv/bin/python -m bench.pyinfra_side --sizes 1 10 30 --rounds 5 --pyinfra PATH/TO/bin/pyinfra

Needs root (systemd-nspawn). Boots its own hosts on 127.0.0.150 and up (RECONCILER_BENCH_FIRST;
RECONCILER_BENCH_PREFIX names them, "pyi" by default) and stops them at the end. The machine's
other load shows in the figures: take them on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench.compare import ROOT, SERVICE, Bench, Run, _init_of, floor_files, med, spawn
from reconciler.desired import load, source
from reconciler.plan.layout import envfile_path
from reconciler.values import replace
from tests import fleet as fleetlib
from tests.conftest import DesiredRepo

FIRST = int(os.environ.get("RECONCILER_BENCH_FIRST", "150"))
PREFIX = os.environ.get("RECONCILER_BENCH_PREFIX", "pyi")     # the hosts' machine names: pyi150, pyi151 ...
TOOLS = ("floor", "reconcile", "pyinfra")
DEPLOY = '''\
from io import StringIO

from pyinfra import host
from pyinfra.operations import files, systemd
from pyinfra.operations.util import any_changed

puts = {path: files.put(name=f"put {path}", src=StringIO(text), dest=path, mode=mode)
        for path, (text, mode) in host.data.bench_files.items()}
units = [op for path, op in puts.items() if path.startswith("/etc/systemd/system/")]
systemd.daemon_reload(name="daemon-reload", _if=any_changed(*units))
systemd.service(name="restart", service=host.data.bench_unit, running=True, enabled=True, restarted=True,
                _if=any_changed(*puts.values()))
'''


@dataclass
class Side(Run):
    host_cpu: float = 0.0     # CPU seconds the test hosts burned for the run (their cgroups)


class HostCpu:
    """The CPU the test hosts burn: each container's cgroup (v2: cpu.stat, usage_usec, recursive)."""

    def __init__(self, hosts: list[fleetlib.Host]):
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
                  if line.split()[2] == "cgroup2"]
        if not mounts:
            raise SystemExit("no cgroup v2 hierarchy mounted: host CPU cannot be read")
        self.stats: dict[str, Path] = {}
        for h in hosts:
            rel = next(ln[3:] for ln in Path(f"/proc/{_init_of(h)}/cgroup").read_text().splitlines()
                       if ln.startswith("0::"))
            rel = rel.removesuffix("/init.scope")     # the container's systemd keeps itself there
            self.stats[h.name] = Path(mounts[0] + rel) / "cpu.stat"

    def read(self, hosts: list[fleetlib.Host]) -> float:
        return sum(int(self.stats[h.name].read_text().split("usage_usec ")[1].split()[0]) for h in hosts) / 1e6

    def quiet(self, hosts: list[fleetlib.Host], timeout: float = 10.0) -> float:
        """The reading once the hosts are idle: under 1 ms per host in 0.2 s (or after `timeout`)."""
        last, deadline = self.read(hosts), time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(0.2)
            now = self.read(hosts)
            if now - last < 0.001 * len(hosts):
                return now
            last = now
        return last

    def check(self, bench: SideBench, h: fleetlib.Host) -> str:
        """A known burn on one host (a shell loop; its own count by `times`) must show in the reading."""
        def session(script: str) -> tuple[float, str]:
            t0 = self.quiet([h])
            out = bench.ssh(h, script)
            return self.quiet([h]) - t0, out
        empty, _ = session("true")
        got, out = session("i=0; while [ $i -lt 150000 ]; do i=$((i+1)); done; times")
        burn = sum(float(m) * 60 + float(s) for m, s in (t.rstrip("s").split("m") for t in out.split()[:2]))
        if not burn * 0.9 < got - empty < burn * 1.2 + 0.03:
            raise SystemExit(f"host CPU check: a burn of {burn:.3f} s read as {got - empty:.3f} s: not measured")
        return (f"host CPU check: burn {burn:.3f} s by the shell's own count, {got - empty:.3f} s by the cgroup "
                f"(an empty ssh session: {empty:.3f} s)")


class SideBench(Bench):
    def __init__(self, hosts: list[fleetlib.Host], tmp: Path, pyinfra: Path):
        super().__init__(hosts, tmp)
        self.pyinfra_bin, self.cpu = pyinfra, HostCpu(hosts)
        self.deploy = tmp / "deploy.py"
        self.deploy.write_text(DEPLOY)
        (tmp / "ssh_config").write_text("")
        self.env.pop("VIRTUAL_ENV", None)

    def ssh(self, h: fleetlib.Host, script: str) -> str:
        return subprocess.run([*fleetlib.ssh_base(h.address, self.kh), script], check=True, capture_output=True,
                              text=True, timeout=60).stdout

    def pyinfra(self, repo: DesiredRepo, hosts: list[fleetlib.Host], value: int) -> Run:
        """One whole pyinfra process converging `hosts` to BENCH_VALUE=value (the files as Bench.floor's)."""
        state = load.load_desired(source.snapshot(repo.repo))
        svcs = {h.name: state.hosts[h.name].services[SERVICE] for h in hosts}
        modes = {envfile_path(SERVICE): "600"}
        inv = [(h.address, {"bench_files": {p: (t, modes.get(p, "644")) for p, t in floor_files(
            replace(svcs[h.name], env={**svcs[h.name].env, "BENCH_VALUE": str(value)})).items()}}) for h in hosts]
        data = {"ssh_user": "root", "ssh_key": self.key, "ssh_known_hosts_file": str(self.kh),
                "ssh_strict_host_key_checking": "yes", "ssh_config_file": str(self.tmp / "ssh_config"),
                "ssh_allow_agent": False, "ssh_look_for_keys": False, "bench_unit": f"{SERVICE}.service"}
        path = self.tmp / "inventory.py"
        path.write_text(f"hosts = ({inv!r}, {data!r})\n")
        return spawn([str(self.pyinfra_bin), str(path), str(self.deploy), "-y", "--parallel", str(len(hosts))],
                     self.env, "", cwd=self.tmp, pids=(self.pids, hosts))

    def verify(self, hosts: list[fleetlib.Host], value: int) -> None:
        """Untimed: every host's env file holds `value` (mode 600) and the unit is active."""
        script = f"stat -c %a {envfile_path(SERVICE)}; cat {envfile_path(SERVICE)}; systemctl is-active {SERVICE}"
        with ThreadPoolExecutor(16) as pool:
            outs = dict(zip((h.name for h in hosts), pool.map(lambda h: self.ssh(h, script), hosts), strict=True))
        bad = {n: o for n, o in outs.items() if f'BENCH_VALUE="{value}"' not in o
               or not o.startswith("600\n") or o.split()[-1] != "active"}
        if bad:
            raise SystemExit(f"pyinfra did not converge: {json.dumps(bad, indent=1)}")

    def timed(self, hosts: list[fleetlib.Host], run: Callable[[], Run]) -> Side:
        before = self.cpu.quiet(hosts)
        r = run()
        return Side(**vars(r), host_cpu=self.cpu.quiet(hosts) - before)

    def side(self, n: int, rounds: int) -> dict[str, list[Run]]:
        hosts = self.hosts[:n]
        self.at = hosts
        repo = DesiredRepo(self.tmp / f"repo{n}")
        self.value += 1
        self.desired(repo, hosts, self.value)
        self.reset(hosts)
        self.ours(repo, n, "converged")                      # untimed: the service runs everywhere
        self.pyinfra(repo, hosts, self.value)                # untimed: its bytecode cached; nothing to do
        runs: dict[str, list[Run]] = {t: [] for t in TOOLS}
        for r in range(rounds):
            for tool in TOOLS[r % 3:] + TOOLS[:r % 3]:
                self.unlimit(hosts)
                if tool == "reconcile":
                    self.value += 1
                    self.desired(repo, hosts, self.value)
                    runs[tool].append(self.timed(hosts, lambda: self.ours(repo, n, "converged")))
                    continue
                if tool == "floor":
                    runs[tool].append(self.timed(hosts, lambda: self.floor(repo, hosts, -self.value, "converged")))
                else:
                    runs[tool].append(self.timed(hosts, lambda: self.pyinfra(repo, hosts, -self.value)))
                    self.verify(hosts, -self.value)
                self.unlimit(hosts)
                self.floor(repo, hosts, self.value, "converged")        # untimed: the reconciler's value back
        return runs


def report(results: dict[int, dict[str, list[Run]]], rounds: int) -> str:
    out = [f"one env change on every host; median of {rounds} round{'s' * (rounds != 1)}; whole processes; "
           "all hosts at once",
           f"{'hosts':>5}  {'tool':<10}{'wall s':>8}{'x floor':>9}{'ctl CPU s':>11}{'host CPU s':>12}"
           f"{'on hosts':>10}{'peak RSS MB':>13}"]
    for n, runs in sorted(results.items()):
        f = med(runs["floor"], "seconds")
        for tool in TOOLS:
            rs = runs[tool]
            out.append(f"{n:>5}  {tool:<10}{med(rs, 'seconds'):>8.2f}{med(rs, 'seconds') / f:>8.2f}x"
                       f"{med(rs, 'cpu'):>11.2f}{med(rs, 'host_cpu'):>12.2f}{med(rs, 'host_procs'):>10.0f}"
                       f"{max(r.rss_mb for r in rs):>13.0f}")
    out.append("")
    for n, runs in sorted(results.items()):
        (ow, oc), (pw, pc) = ((med(runs[t], "seconds"), med(runs[t], "host_cpu")) for t in ("reconcile", "pyinfra"))
        out.append(f"{n} host{'s' * (n != 1)}: reconcile {'ahead of' if ow < pw else 'behind'} pyinfra in wall time "
                   f"({ow:.2f} s against {pw:.2f} s), {'ahead' if oc < pc else 'behind'} in host CPU "
                   f"(our hosts burn {oc:.2f} s of CPU against pyinfra's {pc:.2f} s)")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[30])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pyinfra", type=Path, default=ROOT / ".venv-pyinfra/bin/pyinfra",
                    help="the pyinfra 3.10 command (its own venv; default .venv-pyinfra/bin/pyinfra)")
    args = ap.parse_args()
    if not args.pyinfra.exists():
        raise SystemExit(f"{args.pyinfra}: no pyinfra there (see the module's docstring)")
    version = subprocess.run([str(args.pyinfra), "--version"], capture_output=True, text=True).stdout.strip()
    fleetlib.build()
    hosts = fleetlib.up(max(args.sizes), first=FIRST, prefix=PREFIX)
    results: dict[int, dict[str, list[Run]]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            bench = SideBench(hosts, Path(tmp), args.pyinfra.resolve())
            bench.warm_up()
            print(bench.cpu.check(bench, hosts[0]), file=sys.stderr, flush=True)
            for n in sorted(args.sizes):
                results[n] = bench.side(n, args.rounds)
                print(f"{n} host{'s' * (n != 1)}: done", file=sys.stderr, flush=True)
    finally:
        fleetlib.down(hosts)
    print(f"{version}\n{report(results, args.rounds)}")


if __name__ == "__main__":
    main()
