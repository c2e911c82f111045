"""Benchmark: `reconcile` next to the floor, as whole processes, on 1, 10 and 30 real hosts.

The table of issue 15, for the project's own runs. Three scenarios:

  no-change    the hosts run the desired state; nothing to do
  converge     fresh hosts (no unit, no records) converge to one service each
  env-change   a commit changes one env value on every host: each writes its env file and restarts

Each cell is the median of --rounds runs of a whole process, Python start-up and imports
included, as a user runs it:

  floor        python -m bench.floor SPEC      bare asyncssh (bench/floor.py): one connection per
                                               host, one batched read, the minimal fix
  reconcile    python -m reconciler --repo R --concurrency N    the real CLI
  baseline     the same command from another checkout (--baseline DIR, e.g. a git worktree of
               an older revision), in the same rounds: what a change to the code costs or saves
               (where the two send different lock holder programs, each run installs its own
               again, sh/install.sh, and both pay for it: run them one after the other instead)

A fourth scenario, `help` (`reconcile --help`; its floor is the interpreter's own start,
`python -c pass`), is the cost of starting the command at all.

Both take every host at once; health is systemd's alone with stable_for = 0 (the figure is the
reconcile itself, not a model's load time); peak memory is each process's own maximum RSS
(os.wait4), CPU its user + system time. "machine CPU" is the whole machine's busy time during
the run and "processes" the processes started meanwhile (/proc/stat): the test hosts' sshd,
shells, systemctl and systemd work too, which share this machine's cores with the controller
(what a run costs the hosts shows there). Untimed steps between runs put the hosts where the
next run expects them (fresh for converge; the reconciler's last value back after the floor's
env change). Bytecode is cached as for an installed tool (PYTHONPYCACHEPREFIX in a temp dir)
and each command runs once untimed first. Every `reconcile` loads its revision afresh (there is no
load cache).

    sudo .venv/bin/python -m bench.compare                      # 1/10/30 hosts, 5 rounds each
    sudo .venv/bin/python -m bench.compare --sizes 1 10 --rounds 2 --scenarios no-change env-change

Needs root (systemd-nspawn). Boots its own hosts on 127.0.0.40 and up (RECONCILER_BENCH_FIRST;
30 hosts take 127.0.0.40-69; RECONCILER_BENCH_PREFIX names them, "cmp" by default) and stops
them at the end. "on hosts" counts the processes started on the test hosts themselves, exactly
(HostPids: each host's own PID namespace), where "processes" counts the whole machine's, other
engineers' test runs included. The machine's other load shows in the
figures: take them on a quiet machine. Prints tables; asserts only that every run converged.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from reconciler.desired import load, source
from reconciler.plan.files import desired_files
from reconciler.values import replace
from tests import fleet as fleetlib
from tests.conftest import DesiredRepo, write_fleet

FIRST = int(os.environ.get("RECONCILER_BENCH_FIRST", "40"))
PREFIX = os.environ.get("RECONCILER_BENCH_PREFIX", "cmp")     # the hosts' machine names: cmp40, cmp41 ...
ROOT = Path(__file__).resolve().parent.parent
SERVICE = "bench"
SCENARIOS = ("help", "no-change", "converge", "env-change")
TITLES = {"help": "reconcile --help",
          "no-change": "no change", "converge": "converge from nothing", "env-change": "one env change everywhere"}
# Fresh hosts: fleetlib's reset, then wait until the stand-in has let go of its port.
RESET = fleetlib.RESET_SCRIPT + ("for i in $(seq 100); do pgrep -f sglang.launch_server >/dev/null || break; "
                                 "sleep 0.05; done\n")


@dataclass
class Run:
    """One whole process: wall seconds, CPU seconds (user + system), peak RSS in MB; and the
    whole machine's CPU seconds and new processes meanwhile (/proc/stat: the test hosts' sshd,
    shells and systemd included, which share this machine's cores with the controller)."""

    seconds: float
    cpu: float
    rss_mb: float
    machine_cpu: float = 0.0
    forks: int = 0
    host_procs: int = 0       # processes started on the test hosts themselves (HostPids): exact


def machine() -> tuple[float, int]:
    """(CPU seconds spent by the whole machine so far, busy time only; processes forked so far)."""
    busy, forks = 0.0, 0
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu "):
                v = [int(x) for x in line.split()[1:]]
                busy = (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")    # less idle and iowait
            elif line.startswith("processes "):
                forks = int(line.split()[1])
    return busy, forks


class HostPids:
    """Processes started on test hosts, counted exactly: each container's PID namespace allocates
    its PIDs in order, so the change of its last PID (/proc/sys/kernel/ns_last_pid, read from
    inside it) is how many processes it started, whatever else runs on this machine. Each read
    starts one process there (its own `cat`), counted and taken off (`since`)."""

    def __init__(self, hosts: list[fleetlib.Host]):
        self.inits = {h.name: _init_of(h) for h in hosts}
        self.reads = 0

    def last(self, name: str) -> int:
        self.reads += 1
        res = subprocess.run(["nsenter", "-t", str(self.inits[name]), "-p", "-m", "cat",
                              "/proc/sys/kernel/ns_last_pid"], capture_output=True, text=True, check=True)
        return int(res.stdout)

    def now(self, hosts: list[fleetlib.Host]) -> tuple[dict[str, int], int]:
        """Every host's last PID, and the reads made so far (this one's included)."""
        return {h.name: self.last(h.name) for h in hosts}, self.reads

    def since(self, before: tuple[dict[str, int], int], hosts: list[fleetlib.Host]) -> int:
        """Processes the hosts started since `before` (the reads' own taken off)."""
        pids, reads0 = before
        after = {h.name: self.last(h.name) for h in hosts}
        # each host's reads since `before` (this one's included) each started one process there
        per_host = (self.reads - reads0) // max(1, len(hosts))
        return sum(after[n] - pids[n] - per_host for n in after)


def _init_of(h: fleetlib.Host) -> int:
    """The container's PID 1, as this machine sees it: systemd-nspawn's child."""
    children = Path(f"/proc/{h.pid}/task/{h.pid}/children").read_text().split()
    return int(children[0])


@dataclass
class Cell:
    floor: list[Run] = field(default_factory=list)
    ours: list[Run] = field(default_factory=list)
    base: list[Run] = field(default_factory=list)     # the baseline checkout's CLI, when asked


def spawn(cmd: list[str], env: dict[str, str], expect: str, cwd: Path = ROOT,
          pids: tuple[HostPids, list[fleetlib.Host]] | None = None) -> Run:
    """Run a command to its end; its own peak RSS and CPU come from wait4. `expect` must be in
    its last line of output (what it says it did), else the benchmark stops with its output.
    `pids`: count the processes it starts on these hosts (read before and after, untimed)."""
    before = pids[0].now(pids[1]) if pids is not None else None
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        m0, f0 = machine()
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=cwd)
        _, status, ru = os.wait4(p.pid, 0)
        seconds = time.perf_counter() - t0
        m1, f1 = machine()
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        text, errors = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    last = text.strip().splitlines()[-1] if text.strip() else ""
    if p.returncode != 0 or expect not in last:
        raise SystemExit(f"{' '.join(cmd)}: exit {p.returncode}, wanted {expect!r} in {last!r}\n{text[-3000:]}\n"
                         f"{errors[-3000:]}")
    host_procs = pids[0].since(before, pids[1]) if pids is not None and before is not None else 0
    return Run(seconds, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024, m1 - m0, f1 - f0 - 1, host_procs)


class Bench:
    def __init__(self, hosts: list[fleetlib.Host], tmp: Path, baseline: Path | None = None):
        self.hosts, self.tmp, self.baseline = hosts, tmp, baseline
        self.key = str(fleetlib.client_key_path())
        self.kh = fleetlib.write_known_hosts(hosts, tmp / "known_hosts")
        env = {**os.environ, "RECONCILER_IDENTITY": self.key, "RECONCILER_STATE_DIR": str(tmp / "state"),
               "RECONCILER_CACHE_DIR": str(tmp / "cache"), "PYTHONPYCACHEPREFIX": str(tmp / "pycache"),
               "NO_COLOR": "1", "COLUMNS": "200"}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        self.env = env
        self.value = 0
        self.pids = HostPids(hosts)
        self.at: list[fleetlib.Host] = hosts          # the hosts of the size being run

    def desired(self, repo: DesiredRepo, hosts: list[fleetlib.Host], value: int) -> None:
        """Commit one stand-in service per host with env BENCH_VALUE=value; systemd-only health."""
        write_fleet(repo, hosts, {SERVICE: {"port": 30000, "env": {"BENCH_VALUE": str(value)},
                                            "health": {"http": None, "stable_for": 0, "startup_timeout": 30}}},
                    extra={})
        repo.commit(f"BENCH_VALUE={value}")

    def ours(self, repo: DesiredRepo, n: int, expect: str, where: Path = ROOT) -> Run:
        """This checkout's CLI (or, `where`, another checkout's: its code first on the path)."""
        env = self.env if where == ROOT else {**self.env, "PYTHONPATH": str(where)}
        return spawn([sys.executable, "-m", "reconciler", "--repo", str(repo.path), "--concurrency", str(n)],
                     env, f"{n} {expect}", cwd=where, pids=(self.pids, self.at))

    def both(self, cell: Cell, repo: DesiredRepo, n: int, expect: str) -> None:
        """One timed run of ours, and of the baseline's where there is one (alternated)."""
        cell.ours.append(self.ours(repo, n, expect))
        if self.baseline is not None:
            cell.base.append(self.ours(repo, n, expect, self.baseline))

    def help(self, cell: Cell) -> None:
        """`reconcile --help` (and the baseline's), next to the interpreter's own start."""
        cell.floor.append(spawn([sys.executable, "-c", "pass"], self.env, ""))
        cell.ours.append(spawn([sys.executable, "-m", "reconciler", "--help"], self.env, ""))
        if self.baseline is not None:
            cell.base.append(spawn([sys.executable, "-m", "reconciler", "--help"],
                                   {**self.env, "PYTHONPATH": str(self.baseline)}, "", cwd=self.baseline))

    def floor_spec(self, repo: DesiredRepo, hosts: list[fleetlib.Host], value: int) -> Path:
        """The floor's SPEC file: `hosts` converged to the repo's unit with env BENCH_VALUE=value."""
        state = load.load_desired(source.snapshot(repo.repo))
        spec = {"key": self.key, "known_hosts": str(self.kh), "service": SERVICE,
                "hosts": [{"address": h.address, "files": floor_files(replace(
                    state.hosts[h.name].services[SERVICE],
                    env={**state.hosts[h.name].services[SERVICE].env, "BENCH_VALUE": str(value)}))}
                          for h in hosts]}
        path = self.tmp / "floor.json"
        path.write_text(json.dumps(spec))
        return path

    def floor(self, repo: DesiredRepo, hosts: list[fleetlib.Host], value: int, expect: str) -> Run:
        """The floor converging `hosts` to the repo's unit with env BENCH_VALUE=value."""
        return spawn([sys.executable, "-m", "bench.floor", str(self.floor_spec(repo, hosts, value))], self.env,
                     f"{len(hosts)} {expect}", pids=(self.pids, hosts))

    def reset(self, hosts: list[fleetlib.Host], script: str = RESET) -> None:
        def one(h: fleetlib.Host) -> None:
            subprocess.run([*fleetlib.ssh_base(h.address, self.kh), script], check=True, capture_output=True,
                           timeout=60)
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(one, hosts))

    def unlimit(self, hosts: list[fleetlib.Host]) -> None:
        """Untimed: clear systemd's start rate limit (5 starts in 10 s) that the runs' quick
        restarts of the same unit, back to back, would otherwise hit."""
        self.reset(hosts, f"systemctl reset-failed {SERVICE}.service")

    def warm_up(self) -> None:
        """Compile and cache both programs' bytecode (an installed tool has its .pyc files)."""
        empty = self.tmp / "empty.json"
        empty.write_text(json.dumps({"key": self.key, "known_hosts": str(self.kh), "service": SERVICE,
                                     "hosts": []}))
        spawn([sys.executable, "-m", "bench.floor", str(empty)], self.env, "")
        spawn([sys.executable, "-m", "reconciler", "--help"], self.env, "")
        if self.baseline is not None:
            spawn([sys.executable, "-m", "reconciler", "--help"], {**self.env, "PYTHONPATH": str(self.baseline)}, "",
                  cwd=self.baseline)

    def size(self, n: int, rounds: int, scenarios: list[str]) -> dict[str, Cell]:
        hosts = self.hosts[:n]
        self.at = hosts
        repo = DesiredRepo(self.tmp / f"repo{n}")
        cells = {s: Cell() for s in scenarios}
        self.value += 1
        self.desired(repo, hosts, self.value)
        self.reset(hosts)
        for _ in range(rounds if "help" in cells else 0):
            self.help(cells["help"])
        for _ in range(rounds if "converge" in cells else 0):
            self.reset(hosts)
            cells["converge"].floor.append(self.floor(repo, hosts, self.value, "converged"))
            self.reset(hosts)
            cells["converge"].ours.append(self.ours(repo, n, "converged"))
            if self.baseline is not None:
                self.reset(hosts)
                cells["converge"].base.append(self.ours(repo, n, "converged", self.baseline))
        if "converge" not in cells:
            self.ours(repo, n, "converged")
        for _ in range(rounds if "no-change" in cells else 0):
            cells["no-change"].floor.append(self.floor(repo, hosts, self.value, "in-sync"))
            self.both(cells["no-change"], repo, n, "in-sync")
        for _ in range(rounds if "env-change" in cells else 0):
            self.value += 1
            self.desired(repo, hosts, self.value)
            self.unlimit(hosts)
            cells["env-change"].ours.append(self.ours(repo, n, "converged"))
            if self.baseline is not None:         # its own new value: a new tree for it too
                self.value += 1
                self.desired(repo, hosts, self.value)
                self.unlimit(hosts)
                cells["env-change"].base.append(self.ours(repo, n, "converged", self.baseline))
            self.unlimit(hosts)
            cells["env-change"].floor.append(self.floor(repo, hosts, -self.value, "converged"))
            self.unlimit(hosts)
            self.floor(repo, hosts, self.value, "converged")       # untimed: back to the reconciler's value
        return cells


def floor_files(svc: object) -> dict[str, str]:
    """The files the reconciler writes for a service, for the floor to converge to (the same host
    at the end)."""
    return {p: text for p, text in desired_files(svc).items() if text is not None}  # type: ignore[arg-type]


def med(runs: list[Run], attr: str) -> float:
    return statistics.median(getattr(r, attr) for r in runs)


def report(results: dict[int, dict[str, Cell]], rounds: int, draft: bool, baseline: str | None = None) -> str:
    sizes = sorted(results)
    scenarios = [s for s in SCENARIOS if s in results[sizes[0]]]
    out = []
    if draft:
        out.append("DRAFT: taken on a busy 2-core machine (other test suites running); not the figures to quote.\n")
    out.append(f"median of {rounds} round{'s' * (rounds != 1)}; whole processes, Python start-up included; "
               f"all hosts at once; systemd-only health, stable_for = 0"
               + (f"; baseline: {baseline}" if baseline else "") + "\n")
    out.append(f"{'scenario':<28}{'hosts':>6}{'floor s':>10}{'reconcile s':>13}{'ratio':>8}"
               + (f"{'baseline s':>12}{'ratio':>8}{'CPU s':>7}" if baseline else "")
               + f"{'CPU s floor/ours':>19}{'peak RSS MB floor/ours':>25}{'machine CPU s':>17}{'processes':>15}"
               + f"{'on hosts':>15}")
    for s in scenarios:
        for n in sizes:
            if s == "help" and n != sizes[0]:
                continue            # the same at every size
            c = results[n][s]
            f, o = med(c.floor, "seconds"), med(c.ours, "seconds")
            base = ""
            if baseline and c.base:
                b = med(c.base, "seconds")
                base = f"{b:>12.2f}{b / f:>7.2f}x{med(c.base, 'cpu'):>7.2f}"
            elif baseline:
                base = f"{'-':>12}{'':>8}{'':>7}"
            out.append(f"{TITLES[s]:<28}{n if s != 'help' else '-':>6}{f:>10.2f}{o:>13.2f}{o / f:>7.2f}x{base}"
                       f"{med(c.floor, 'cpu'):>10.2f} / {med(c.ours, 'cpu'):<6.2f}"
                       f"{max(r.rss_mb for r in c.floor):>14.0f} / {max(r.rss_mb for r in c.ours):<6.0f}"
                       f"{med(c.floor, 'machine_cpu'):>9.2f} / {med(c.ours, 'machine_cpu'):<6.2f}"
                       f"{med(c.floor, 'forks'):>7.0f} / {med(c.ours, 'forks'):<6.0f}"
                       f"{med(c.floor, 'host_procs'):>7.0f} / {med(c.ours, 'host_procs'):<6.0f}")
    out.append("")
    label = " / ".join(str(n) for n in sizes)
    out.append("| scenario | floor | reconcile | goal |\n|---|---|---|---|")
    for s in scenarios:
        if s == "help":
            continue
        floors = " / ".join(f"{med(results[n][s].floor, 'seconds'):.2f}" for n in sizes)
        ratios = " / ".join(f"{med(results[n][s].ours, 'seconds') / med(results[n][s].floor, 'seconds'):.2f}"
                            for n in sizes)
        out.append(f"| {TITLES[s]}, {label} hosts | {floors} s | {ratios}x | <= 1.3x |")
    big = sizes[-1]
    peak_f = max(r.rss_mb for k, c in results[big].items() if k != "help" for r in c.floor)
    peak_o = max(r.rss_mb for k, c in results[big].items() if k != "help" for r in c.ours)
    out.append(f"\n(Peak memory at {big} host{'s' * (big != 1)}: floor {peak_f:.0f} MB, reconcile {peak_o:.0f} MB.)")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 10, 30])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    ap.add_argument("--draft", action="store_true", help="Mark the output as a draft (a busy machine).")
    ap.add_argument("--baseline", type=Path, metavar="DIR",
                    help="Another checkout (e.g. `git worktree add --detach DIR REV`) whose CLI runs beside ours. "
                         "Only where both send the hosts the same programs: each run installs its own by content "
                         "(host/lock.py), so alternating two sets measures the reinstalls; else run each by itself.")
    args = ap.parse_args()
    fleetlib.build()
    hosts = fleetlib.up(max(args.sizes), first=FIRST, prefix=PREFIX)
    results: dict[int, dict[str, Cell]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            bench = Bench(hosts, Path(tmp), args.baseline.resolve() if args.baseline else None)
            bench.warm_up()
            for n in sorted(args.sizes):
                results[n] = bench.size(n, args.rounds, args.scenarios)
                print(f"{n} host{'s' * (n != 1)}: done", file=sys.stderr, flush=True)
    finally:
        fleetlib.down(hosts)
    rev = None
    if args.baseline:
        rev = subprocess.run(["git", "-C", str(args.baseline), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip() or str(args.baseline)
    print(report(results, args.rounds, args.draft, rev))


if __name__ == "__main__":
    main()
