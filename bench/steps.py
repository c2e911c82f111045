"""Benchmark: where a one-host converge (or env change) goes, step by step, next to the floor's steps.

One real test host (127.0.0.96), fresh before each round (no unit, no records): `reconcile`
(in this process, through its CLI entry point) and the floor (bench/floor.py's `converge`)
converge it to one stand-in service with systemd-only health and stable_for = 0, as in
bench/compare.py. Every SSH connection and command is timed where it is made: wall time, the
whole machine's busy CPU meanwhile (the host's sshd, shells, systemctl and systemd work
included) and the processes started meanwhile (/proc/stat). Medians over --rounds; the pre-flight's
server-version probe is cached after the first round, as in a real fleet.

    sudo .venv/bin/python -m bench.steps             # 7 rounds
    sudo .venv/bin/python -m bench.steps --rounds 3
    sudo .venv/bin/python -m bench.steps --scenario env-change     # one env value changes each round

Needs root (systemd-nspawn). Prints a table; asserts only that every run converged. The
machine's other load shows in the figures: take them on a quiet machine. "on host" counts the
processes started on the test host itself, exactly (compare.HostPids), whatever else runs here.
RECONCILER_BENCH_STEPS_ADDRESS and RECONCILER_BENCH_PREFIX place and name the host.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncssh

import reconciler.values
from bench import compare, floor
from bench.compare import HostPids, machine
from reconciler.desired import load, source
from reconciler.host import lock, session, transport
from tests import fleet as fleetlib
from tests.conftest import DesiredRepo

FIRST = int(os.environ.get("RECONCILER_BENCH_STEPS_ADDRESS", "96"))

Steps = dict[str, list[tuple[float, float, int, int]]]  # step -> [(wall ms, machine CPU ms, processes, on host)]


class Meter:
    """Times each awaited step: wall, the machine's busy CPU and processes started meanwhile, and
    the processes started on the test host itself (compare.HostPids: exact, whatever else runs
    on this machine). The host's counter is read outside each step's own measures; what reading
    it costs inside an enclosing step (a few ms and two processes of this machine's per read) is
    taken off that step's figures."""

    def __init__(self, pids: HostPids, host: fleetlib.Host) -> None:
        self.steps: list[tuple[str, float, float, int, int]] = []
        self.pids, self.host = pids, host
        self.spent = 0.0          # seconds spent reading the host's counter, so far

    def _read(self) -> tuple[dict[str, int], int]:
        t0 = time.perf_counter()
        try:
            return self.pids.now([self.host])
        finally:
            self.spent += time.perf_counter() - t0

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        before = self._read()
        spent0 = self.spent
        m0, f0 = machine()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            wall = time.perf_counter() - t0 - (self.spent - spent0)
            m1, f1 = machine()
            inner = self.pids.reads - before[1]          # reads of steps inside this one
            t1 = time.perf_counter()
            on_host = self.pids.since(before, [self.host])
            self.spent += time.perf_counter() - t1
            self.steps.append((name, 1000 * wall, 1000 * (m1 - m0), f1 - f0 - 2 * inner, on_host))


def instrument_ours(meter: Meter) -> None:
    """Wrap the reconciler's SSH transport: connect, each command (by its `what`), the lock."""
    run, connect, acquire = transport.SSHTransport.run, transport.SSHTransport.connect, lock.acquire
    in_session = session.HostSession.run

    def step(cmd: str, k: dict[str, Any]) -> str:
        what = str(k.get("what") or cmd.split()[0])
        return "record verdict" if what.startswith("record verdict") else what

    async def timed_run(self: Any, cmd: str, *a: Any, **k: Any) -> Any:
        with meter.step(step(cmd, k)):
            return await run(self, cmd, *a, **k)

    async def timed_session_run(self: Any, cmd: str, **k: Any) -> Any:      # the lock holder's shell
        with meter.step(step(cmd, k)):
            return await in_session(self, cmd, **k)

    async def timed_acquire(t: Any, **k: Any) -> Any:
        # The lock: timed until the holder answers (LOCKED, and the observation under the lock).
        with meter.step("lock + observe under it"):
            return await acquire(t, **k)

    async def timed_connect(cls: Any, *a: Any, **k: Any) -> Any:
        with meter.step("connect"):
            return await connect(*a, **k)

    transport.SSHTransport.run = timed_run          # type: ignore[method-assign]
    session.HostSession.run = timed_session_run     # type: ignore[method-assign]
    lock.acquire = timed_acquire                    # type: ignore[assignment]
    transport.SSHTransport.connect = classmethod(timed_connect)   # type: ignore[method-assign,assignment]


def instrument_floor(meter: Meter) -> None:
    """Wrap asyncssh as the floor uses it: connect, and each command (read, fix, poll)."""
    connect, run = asyncssh.connect, asyncssh.SSHClientConnection.run
    names = iter(("read", "fix (write, reload, enable, start, show)"))

    @contextlib.asynccontextmanager
    async def timed_connect(*a: Any, **k: Any) -> Any:
        with meter.step("connect"):
            conn = await connect(*a, **k)
        async with conn:
            yield conn

    async def timed_run(self: Any, cmd: str, *a: Any, **k: Any) -> Any:
        with meter.step(next(names, "health poll")):
            return await run(self, cmd, *a, **k)

    floor.asyncssh.connect = timed_connect          # type: ignore[assignment]
    asyncssh.SSHClientConnection.run = timed_run    # type: ignore[method-assign]


_ORIG_T = (transport.SSHTransport.__dict__["run"], transport.SSHTransport.__dict__["connect"])
_ORIG_L = lock.acquire
_ORIG_F = (asyncssh.connect, asyncssh.SSHClientConnection.run)
_ORIG_S = session.HostSession.__dict__["run"]


def _restore() -> None:
    for name, orig in zip(("run", "connect"), _ORIG_T, strict=True):
        setattr(transport.SSHTransport, name, orig)
    lock.acquire = _ORIG_L                              # type: ignore[assignment]
    session.HostSession.run = _ORIG_S                   # type: ignore[method-assign]
    asyncssh.connect, asyncssh.SSHClientConnection.run = _ORIG_F     # type: ignore[method-assign]


def ours_round(repo: DesiredRepo, env: dict[str, str], pids: HostPids, host: fleetlib.Host) -> Meter:
    meter = Meter(pids, host)
    instrument_ours(meter)
    from reconciler import cli
    saved = dict(os.environ)
    os.environ.update(env)
    sys.argv = ["reconcile", "--repo", str(repo.path), "--json"]
    try:
        with meter.step("whole run (in process, after start-up)"), \
                open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
            try:
                cli.main()
            except SystemExit as e:
                if e.code != 0:
                    raise SystemExit(f"reconcile exited {e.code}") from None
    finally:
        os.environ.clear()
        os.environ.update(saved)
        _restore()
    return meter


def floor_round(h: dict[str, Any], key: str, kh: str, pids: HostPids, host: fleetlib.Host) -> Meter:
    meter = Meter(pids, host)
    instrument_floor(meter)

    async def go() -> str:
        with meter.step("whole run (in process, after start-up)"):
            return await floor.converge(h, compare.SERVICE, key, asyncssh.read_known_hosts(kh))
    try:
        did = asyncio.run(go())
    finally:
        _restore()
    if did != "converged":
        raise SystemExit(f"floor: {did}")
    return meter


def env_spec(repo: DesiredRepo, host: fleetlib.Host, value: int) -> dict[str, Any]:
    """The floor's spec for one host: the repo's unit with env BENCH_VALUE=value."""
    svc = load.load_desired(source.snapshot(repo.repo)).hosts[host.name].services[compare.SERVICE]
    return {"address": host.address,
            "files": compare.floor_files(reconciler.values.replace(svc, env={**svc.env, "BENCH_VALUE": str(value)}))}


def table(title: str, rounds: list[Meter]) -> list[str]:
    by: Steps = defaultdict(list)
    order: list[str] = []
    for m in rounds:
        seen: dict[str, tuple[float, float, int, int]] = {}
        for name, wall, cpu, procs, on_host in m.steps:
            w, c, p, h = seen.get(name, (0.0, 0.0, 0, 0))
            seen[name] = (w + wall, c + cpu, p + procs, h + on_host)      # a step met twice in a run adds up
            if name not in order:
                order.append(name)
        for name, v in seen.items():
            by[name].append(v)
    out = [title, f"  {'step':<44}{'wall ms':>9}{'machine CPU ms':>16}{'processes':>11}{'on host':>9}"]
    whole = "whole run (in process, after start-up)"
    for name in [n for n in order if n != whole] + [whole]:
        v = by[name]
        out.append(f"  {name:<44}{statistics.median(x[0] for x in v):>9.1f}{statistics.median(x[1] for x in v):>16.0f}"
                   f"{statistics.median(x[2] for x in v):>11.0f}{statistics.median(x[3] for x in v):>9.0f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--scenario", choices=("converge", "env-change"), default="converge",
                    help="converge: a fresh host each round; env-change: one env value changes each round "
                         "(the host keeps its unit, records and lock holder)")
    args = ap.parse_args()
    fleetlib.build()
    hosts = fleetlib.up(1, first=FIRST, prefix=os.environ.get("RECONCILER_BENCH_PREFIX", "stp"))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            b = compare.Bench(hosts, Path(tmp))
            repo = DesiredRepo(Path(tmp) / "repo")
            b.value = 1
            b.desired(repo, hosts, b.value)
            state = load.load_desired(source.snapshot(repo.repo))
            svc = state.hosts[hosts[0].name].services[compare.SERVICE]
            spec = {"address": hosts[0].address, "files": compare.floor_files(svc)}
            ours: list[Meter] = []
            floors: list[Meter] = []
            b.reset(hosts)
            h, pids = hosts[0], b.pids
            ours_round(repo, b.env, pids, h)         # untimed: bytecode, the load cache, the version probe
            for _ in range(args.rounds):
                if args.scenario == "converge":
                    b.reset(hosts)
                    ours.append(ours_round(repo, b.env, pids, h))
                    b.reset(hosts)
                    floors.append(floor_round(spec, b.key, str(b.kh), pids, h))
                    continue
                # env-change, as bench/compare.py's: ours from the last value to a new one; the floor
                # to another; untimed, the reconciler's value back (its records name it)
                b.value += 1
                b.desired(repo, hosts, b.value)
                b.unlimit(hosts)
                ours.append(ours_round(repo, b.env, pids, h))
                b.unlimit(hosts)
                floors.append(floor_round(env_spec(repo, h, -b.value), b.key, str(b.kh), pids, h))
                b.unlimit(hosts)
                floor_round(env_spec(repo, h, b.value), b.key, str(b.kh), pids, h)
    finally:
        fleetlib.down(hosts)
    what = "converge from nothing" if args.scenario == "converge" else "one env change"
    print(f"one host, {what}; median of {args.rounds} rounds; systemd-only health, stable_for = 0")
    print("\n".join(table("reconcile", ours)))
    print("\n".join(table("floor (bench/floor.py)", floors)))


if __name__ == "__main__":
    main()
