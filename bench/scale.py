"""Benchmark: 100, 300 and 1,000 simulated hosts per controller, ours next to the floor.

One booted test host runs a second sshd on 0.0.0.0:2222 (../shared/TESTHOSTS.md, "Many
simulated hosts from one container"): because the containers share the machine's network
namespace, every address 127.1.x.y reaches it, and each is a distinct host to the controller
(the same host key, the same systemd, the same /var/lib/reconciler). That is fine for what is
measured here: runs that find every host in sync.

    cold   a whole process, as a user starts it, Python start-up included:
             floor       python -m bench.floor SPEC   (connect, one batched read, nothing to fix)
             reconcile   python -m reconciler --repo R
    warm   rounds of a process that keeps its connections open, after its first (cold) round
           (with the whole machine's busy CPU and the processes it started in each: the hosts'
           side shows there, /proc/stat as bench.compare reads it):
             floor       bare asyncssh: the same batched read on every kept connection
             reconcile   the daemon's own run (daemon.Daemon.run_once with its pool.Pool):
                         git snapshot, load, survey (one observation per host), the store

Each figure is the median of --rounds. CPU is the controller process's user + system time,
peak RSS its own maximum (os.wait4 for whole processes, getrusage for the warm ones). Both take
100 hosts at a time (the sshd listen backlog is 128; fleet.toml concurrency = 100). The hosts'
side shares this machine's cores: compare ours with the floor, never absolute times.

    sudo .venv/bin/python -m bench.scale                        # 100 300 1000, 3 rounds
    sudo .venv/bin/python -m bench.scale --sizes 100 --rounds 2

Needs root (systemd-nspawn). Boots one host on 127.0.0.95 (RECONCILER_SCALE_ADDRESS) and stops
it at the end. Prints a table; asserts only that every run found every host in sync.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path

from bench.compare import Run, machine, spawn
from bench.floor import CIPHERS, read_command
from reconciler.plan.layout import env_path, envfile_path, unit_path
from tests import fleet as fleetlib
from tests.conftest import STANDIN_UNIT, DesiredRepo

ADDRESS = os.environ.get("RECONCILER_SCALE_ADDRESS", "127.0.0.95")
PORT = 2222
AT_ONCE = 100
SERVICE = "bench"
ROOT = Path(__file__).resolve().parent.parent
SSHD_CONF = f"""Port {PORT}
ListenAddress 0.0.0.0:{PORT}
HostKey /etc/ssh/ssh_host_ed25519_key
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
UseDNS no
MaxStartups 2000:30:4000
MaxSessions 20
"""
FILES = [unit_path(SERVICE), env_path(SERVICE), envfile_path(SERVICE)]    # what the reconciler reads too
READ = read_command(FILES, f"systemctl show -p ActiveState,SubState,UnitFileState {SERVICE}.service")


def address(i: int) -> str:
    return f"127.1.{i // 250}.{i % 250 + 1}"


@dataclass
class Warm:
    first: float                 # the first round: connects included
    rounds: list[float]          # the rounds after it, connections kept
    cpu: float                   # the process's CPU seconds over all rounds
    rss_mb: float
    # the whole machine's busy CPU seconds and the processes it started, in each round after the
    # first: the controller and the host's side (sshd, the shell, systemctl) together
    machine_cpu: list[float]
    processes: list[int]


# ---- the two warm processes (run as `python -m bench.scale warm-... ARGS OUT`) -------------------

async def _timed(work: Awaitable[object]) -> tuple[float, float, int]:
    """One warm round: its wall seconds, the machine's busy CPU seconds and the processes started."""
    cpu0, procs0 = machine()
    t0 = time.perf_counter()
    await work
    took = time.perf_counter() - t0
    cpu1, procs1 = machine()
    return took, cpu1 - cpu0, procs1 - procs0


async def _floor_warm(spec: dict, rounds: int) -> tuple[float, list[tuple[float, float, int]]]:
    import asyncssh
    known = asyncssh.read_known_hosts(spec["known_hosts"])
    sem = asyncio.Semaphore(AT_ONCE)

    async def connect(h: dict) -> asyncssh.SSHClientConnection:
        async with sem:
            return await asyncssh.connect(h["address"], port=PORT, username="root", client_keys=[spec["key"]],
                                          known_hosts=known, config=[], encryption_algs=CIPHERS)

    async def read(conn: asyncssh.SSHClientConnection) -> None:
        async with sem:
            res = await conn.run(READ, check=True)
            assert "ActiveState=active" in str(res.stdout), res.stdout

    t0 = time.perf_counter()
    conns = await asyncio.gather(*(connect(h) for h in spec["hosts"]))
    await asyncio.gather(*(read(c) for c in conns))
    first = time.perf_counter() - t0
    times: list[tuple[float, float, int]] = []
    for _ in range(rounds):
        times.append(await _timed(asyncio.gather(*(read(c) for c in conns))))
    for c in conns:
        c.close()
    return first, times


async def _ours_warm(repo: str, state_dir: str, rounds: int, n: int) -> tuple[float, list[tuple[float, float, int]]]:
    from rich.console import Console

    from reconciler.controller.config import ControllerConfig
    from reconciler.controller.daemon import Daemon
    from reconciler.process import tune_gc
    tune_gc()                            # as `reconcile watch` runs (cli.console)
    cfg = ControllerConfig(repo=repo, branch="main", state_dir=state_dir, metrics="", web="",
                           identity=str(fleetlib.client_key_path()), notes=False)
    d = Daemon(cfg, interval=3600)
    d.console = Console(file=io.StringIO(), width=160)

    async def one() -> tuple[float, float, int]:
        d.console.file = io.StringIO()
        took = await _timed(check(d.run_once()))
        log = d.console.file.getvalue()
        if d.pool.opened > n:
            raise SystemExit(f"{d.pool.opened} connections opened for {n} hosts\n{log[-3000:]}")
        return took

    async def check(work: Awaitable[int]) -> None:
        code = await work
        if code != 0:
            raise SystemExit(f"round exited {code}\n{d.console.file.getvalue()[-3000:]}")

    first = (await one())[0]
    times = [await one() for _ in range(rounds)]
    await d.pool.close()
    d.store.close()
    return first, times


def _warm_main(kind: str, args: list[str]) -> None:
    out = Path(args[-1])
    sys.stdout = open(os.devnull, "w")          # the daemon's per-run console output  # noqa: SIM115
    if kind == "warm-floor":
        first, times = asyncio.run(_floor_warm(json.loads(Path(args[0]).read_text()), int(args[1])))
    else:
        first, times = asyncio.run(_ours_warm(args[0], args[1], int(args[2]), int(args[3])))
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out.write_text(json.dumps({"first": first, "rounds": [t[0] for t in times], "cpu": ru.ru_utime + ru.ru_stime,
                               "rss_mb": ru.ru_maxrss / 1024, "machine_cpu": [t[1] for t in times],
                               "processes": [t[2] for t in times]}))


# ---- the bench --------------------------------------------------------------------------------------

class Scale:
    def __init__(self, host: fleetlib.Host, tmp: Path, sizes: list[int]):
        self.host, self.tmp = host, tmp
        self.key = str(fleetlib.client_key_path())
        self.kh = fleetlib.write_known_hosts([host], tmp / "known_hosts_22")
        key = fleetlib.host_public_key()
        self.known = tmp / "known_hosts"
        self.known.write_text("".join(f"[{address(i)}]:{PORT} {key}\n" for i in range(max(sizes))))
        env = {**os.environ, "RECONCILER_IDENTITY": self.key, "RECONCILER_CACHE_DIR": str(tmp / "cache"),
               "PYTHONPYCACHEPREFIX": str(tmp / "pycache"), "NO_COLOR": "1", "COLUMNS": "200"}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        self.env = env
        self._repo: DesiredRepo | None = None

    def start_sshd(self) -> None:
        subprocess.run([*fleetlib.ssh_base(self.host.address, self.kh),
                        f"cat > /etc/ssh/sshd_scale.conf <<'EOF'\n{SSHD_CONF}EOF\n"
                        "/usr/sbin/sshd -f /etc/ssh/sshd_scale.conf"],
                       check=True, capture_output=True, timeout=60)

    def repo(self, n: int) -> DesiredRepo:
        """n hosts, one stand-in service each, systemd-only health; converged once through sim-0
        (they all share the one container, so all n are in sync after it). One repo, a commit per
        size (sizes ascending): each descends from the one the host records as applied."""
        repo = self._repo = self._repo or DesiredRepo(self.tmp / "repo")
        repo.write("fleet.toml", f'concurrency = {AT_ONCE}\n\n[ssh]\nuser = "root"\nport = {PORT}\n'
                                 'known_hosts = "known_hosts"\n')
        repo.write("known_hosts", "".join(self.known.read_text().splitlines(keepends=True)[:n]))
        # One unit text for every simulated host (they share one systemd): no {host.address} in it.
        repo.write("units/standin.service", STANDIN_UNIT.replace("{host.address}", ADDRESS))
        for i in range(n):
            repo.write(f"hosts/sim-{i}.toml", f"""
                address = "{address(i)}"

                [services.{SERVICE}]
                unit_file = "units/standin.service"
                vars = {{ port = "30000", args = "" }}
                model = {{ id = "Qwen/Qwen3-8B", path = "/models/Qwen3-8B" }}
                health = {{ startup_timeout = 30, stable_for = 0 }}
                env = {{ BENCH_VALUE = "1" }}
            """)
        repo.commit(f"{n} simulated hosts")
        spawn([sys.executable, "-m", "reconciler", "--repo", str(repo.path), "--host", "sim-0"],
              {**self.env, "RECONCILER_STATE_DIR": str(self.tmp / "state-setup")}, "1 ")
        return repo

    def floor_spec(self, n: int) -> Path:
        path = self.tmp / f"floor{n}.json"
        path.write_text(json.dumps({"key": self.key, "known_hosts": str(self.known), "service": SERVICE,
                                    "port": PORT, "concurrency": AT_ONCE, "read_only": True, "paths": FILES,
                                    "hosts": [{"address": address(i)} for i in range(n)]}))
        return path

    def cold(self, n: int, repo: DesiredRepo, rounds: int) -> tuple[list[Run], list[Run]]:
        floor, ours = [], []
        for _ in range(rounds):
            floor.append(spawn([sys.executable, "-m", "bench.floor", str(self.floor_spec(n))], self.env,
                               f"{n} hosts: {n} in-sync"))
            ours.append(spawn([sys.executable, "-m", "reconciler", "--repo", str(repo.path)],
                              {**self.env, "RECONCILER_STATE_DIR": str(self.tmp / f"state-cold{n}")},
                              f"{n} in-sync"))
        return floor, ours

    def warm(self, n: int, repo: DesiredRepo, rounds: int) -> tuple[Warm, Warm]:
        got = []
        for kind, args in (("warm-floor", [str(self.floor_spec(n)), str(rounds)]),
                           ("warm-ours", [str(repo.path), str(self.tmp / f"state-warm{n}"), str(rounds), str(n)])):
            out = self.tmp / f"{kind}{n}.json"
            res = subprocess.run([sys.executable, "-m", "bench.scale", kind, *args, str(out)], env=self.env,
                                 cwd=ROOT, capture_output=True, text=True, timeout=1800)
            if res.returncode != 0:
                raise SystemExit(f"{kind} {n}: exit {res.returncode}\n{res.stderr[-3000:]}")
            got.append(Warm(**json.loads(out.read_text())))
        return got[0], got[1]


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def report(rows: dict[int, tuple[list[Run], list[Run], Warm, Warm]], rounds: int) -> str:
    out = [f"median of {rounds} round{'s' * (rounds != 1)}; simulated hosts (one container, sshd on "
           f"0.0.0.0:{PORT}); {AT_ONCE} hosts at a time; every host in sync",
           "",
           f"{'hosts':>6}  {'cold s floor/ours':>18} {'ratio':>6}  {'CPU s':>12}  {'RSS MB':>10}   "
           f"{'warm round s floor/ours':>24} {'ratio':>6}  {'CPU s/round':>12}  {'RSS MB':>10}"]
    for n, (cf, co, wf, wo) in sorted(rows.items()):
        f, o = med([r.seconds for r in cf]), med([r.seconds for r in co])
        wfs, wos = med(wf.rounds), med(wo.rounds)
        out.append(
            f"{n:>6}  {f:>8.2f} / {o:<7.2f} {o / f:>5.2f}x  {med([r.cpu for r in cf]):>5.2f} / "
            f"{med([r.cpu for r in co]):<5.2f} {max(r.rss_mb for r in cf):>4.0f} / {max(r.rss_mb for r in co):<4.0f}"
            f"   {wfs:>11.2f} / {wos:<10.2f} {wos / wfs:>5.2f}x  "
            f"{wf.cpu / (len(wf.rounds) + 1):>5.2f} / {wo.cpu / (len(wo.rounds) + 1):<5.2f} "
            f"{wf.rss_mb:>4.0f} / {wo.rss_mb:<4.0f}")
    out += ["", "a warm round on the whole machine (the controller and the host's sshd, shell and systemctl): "
            "median busy CPU and processes started",
            "", f"{'hosts':>6}  {'machine CPU s floor/ours':>25}  {'ms a host':>15}  {'processes floor/ours':>21}"]
    for n, (_cf, _co, wf, wo) in sorted(rows.items()):
        mf, mo = med(wf.machine_cpu), med(wo.machine_cpu)
        out.append(f"{n:>6}  {mf:>12.2f} / {mo:<10.2f}  {1000 * mf / n:>6.1f} / {1000 * mo / n:<6.1f}  "
                   f"{med(wf.processes):>9.0f} / {med(wo.processes):<9.0f}")
    out.append("")
    out.append("warm: the first round of each warm process (connects included) took "
               + "; ".join(f"{n}: floor {w[2].first:.2f} s, ours {w[3].first:.2f} s" for n, w in sorted(rows.items())))
    out.append("CPU s/round of a warm process: its whole CPU time over its rounds, the first included.")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 300, 1000])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    fleetlib.build()
    host = fleetlib.up(1, first=int(ADDRESS.rsplit(".", 1)[1]), prefix="scl")[0]
    rows = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            s = Scale(host, Path(tmp), args.sizes)
            s.start_sshd()
            spawn([sys.executable, "-m", "reconciler", "--help"], s.env, "")      # bytecode cached, untimed
            for n in sorted(args.sizes):
                repo = s.repo(n)
                cf, co = s.cold(n, repo, args.rounds)
                wf, wo = s.warm(n, repo, args.rounds)
                rows[n] = (cf, co, wf, wo)
                print(f"{n} hosts: done", file=sys.stderr, flush=True)
    finally:
        fleetlib.down([host])
    print(report(rows, args.rounds))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("warm-floor", "warm-ours"):
        _warm_main(sys.argv[1], sys.argv[2:])
    else:
        main()
