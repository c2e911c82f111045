"""Benchmark: where the whole machine's CPU goes in one env change on N real hosts, by command.

bench.compare says how much more CPU `reconcile` costs the machine than the floor (the
controller and the hosts' side together); this says on what. `perf record -a` samples every
CPU while one whole `reconcile` process converges N hosts to a new env value, then while the
floor (bench/floor.py) does the same, and the samples are summed by command name (the
kernel's comm: `python` is a controller, `python3` the hosts' stand-in servers starting,
`sh`, `bash`, `mv`, `sync`, `systemctl` ... the hosts' side). A forked child is counted under
its parent's name until it execs, so a shell's share holds the fork of each command it runs.

    sudo .venv/bin/python -m bench.by_command             # 30 hosts, median of 3 runs each
    sudo .venv/bin/python -m bench.by_command --hosts 10 --rounds 5

Needs root and `perf` (linux-perf). Boots its own hosts on 127.0.0.40 and up, as bench.compare
does (RECONCILER_BENCH_FIRST, RECONCILER_BENCH_PREFIX). Prints a table; asserts only that every
run converged. Take it on a quiet machine: whatever else runs is sampled too.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from bench.compare import FIRST, PREFIX, Bench, DesiredRepo
from tests import fleet as fleetlib

HZ = 2000          # samples a second on each CPU: one sample is 0.5 ms of a CPU
IDLE = "swapper"   # the idle task: a CPU with nothing to run


def by_command(data: Path) -> Counter[str]:
    """The CPU milliseconds in a perf.data file, by command name."""
    out = subprocess.run(["perf", "script", "-i", str(data), "-F", "comm"], capture_output=True, text=True,
                         check=True).stdout
    return Counter({comm: n * 1000 / HZ for comm, n in Counter(line.strip() for line in out.splitlines()
                                                               if line.strip()).items()})


def sampled(cmd: list[str], bench: Bench, data: Path, expect: str) -> Counter[str]:
    """Run `cmd` as bench.compare runs it, the whole machine sampled meanwhile."""
    perf = ["perf", "record", "-q", "-a", "-F", str(HZ), "-o", str(data), "--"]
    res = subprocess.run([*perf, *cmd], env=bench.env, capture_output=True, text=True, timeout=600)
    last = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
    if res.returncode != 0 or expect not in last:
        raise SystemExit(f"{' '.join(cmd)}: exit {res.returncode}, wanted {expect!r} in {last!r}\n"
                         f"{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return by_command(data)


def report(ours: list[Counter[str]], floor: list[Counter[str]], n: int, rounds: int) -> str:
    names = set().union(*ours, *floor)
    med = {c: (statistics.median(r[c] for r in floor), statistics.median(r[c] for r in ours)) for c in names}
    total = tuple(statistics.median(sum(v for c, v in r.items() if c != IDLE) for r in runs) for runs in (floor, ours))
    rows = sorted(med.items(), key=lambda kv: -abs(kv[1][1] - kv[1][0]))
    out = [f"one env change on {n} host{'s' * (n != 1)}: the whole machine's CPU by command, median of {rounds} "
           f"runs each ({HZ} samples a second a CPU; {IDLE} is idle time)",
           "",
           f"{'command':<20}{'floor ms':>10}{'ours ms':>10}{'ours - floor':>14}"]
    out += [f"{c:<20}{f:>10.1f}{o:>10.1f}{o - f:>14.1f}" for c, (f, o) in rows if max(f, o) >= 5]
    out.append(f"{'all but ' + IDLE:<20}{total[0]:>10.1f}{total[1]:>10.1f}{total[1] - total[0]:>14.1f}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if shutil.which("perf") is None:
        raise SystemExit("perf not found: install linux-perf (Debian) to run this benchmark")
    fleetlib.build()
    hosts = fleetlib.up(args.hosts, first=FIRST, prefix=PREFIX)
    ours: list[Counter[str]] = []
    floor: list[Counter[str]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            bench = Bench(hosts, Path(tmp))
            bench.warm_up()
            repo = DesiredRepo(Path(tmp) / "repo")
            n = len(hosts)
            bench.value += 1
            bench.desired(repo, hosts, bench.value)
            bench.reset(hosts)
            bench.ours(repo, n, "converged")
            data = Path(tmp) / "perf.data"
            for _ in range(args.rounds):
                bench.value += 1
                bench.desired(repo, hosts, bench.value)
                bench.unlimit(hosts)
                ours.append(sampled([sys.executable, "-m", "reconciler", "--repo", str(repo.path),
                                     "--concurrency", str(n)], bench, data, f"{n} converged"))
                bench.unlimit(hosts)
                spec = bench.floor_spec(repo, hosts, -bench.value)
                floor.append(sampled([sys.executable, "-m", "bench.floor", str(spec)], bench, data,
                                     f"{n} hosts: {n} converged"))
                bench.unlimit(hosts)
                bench.floor(repo, hosts, bench.value, "converged")     # back to the reconciler's value
    finally:
        fleetlib.down(hosts)
    print(report(ours, floor, len(hosts), args.rounds))


if __name__ == "__main__":
    main()
