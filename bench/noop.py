"""Benchmark: wall time of a no-change reconcile on 1, 10 and 30 real hosts, next to the floor.

The floor is a bare asyncssh fan-out that opens one connection per host and runs one command
(`true`). The target: a no-change run within 1.3x of that floor. Prints a table; asserts
nothing (speed goals live here, not in timed tests).

    sudo .venv/bin/python -m bench.noop            # 1, 10, 30 hosts, 5 rounds each
    sudo .venv/bin/python -m bench.noop --sizes 10 --rounds 3

Boots its own hosts on 127.0.0.40 and up, and stops them at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import asyncssh

from reconciler.desired import load, source
from reconciler.loop.fleet import run_fleet
from reconciler.loop.host_run import ssh_connector
from reconciler.loop.options import RunIO, RunOptions
from reconciler.loop.revision import Revision
from tests import fleet as fleetlib
from tests.conftest import DesiredRepo, write_fleet

FIRST = int(os.environ.get("RECONCILER_BENCH_FIRST", "40"))


async def floor(hosts: list[fleetlib.Host], known_hosts: Path, key: Path) -> float:
    """One connection per host, one command, all at once: the least any SSH tool can do."""
    async def one(h: fleetlib.Host) -> None:
        async with asyncssh.connect(h.address, username="root", client_keys=[str(key)],
                                    known_hosts=str(known_hosts), config=[]) as conn:
            await conn.run("true", check=True)
    t0 = time.perf_counter()
    await asyncio.gather(*(one(h) for h in hosts))
    return time.perf_counter() - t0


async def noop_run(state, key: Path) -> float:
    t0 = time.perf_counter()
    res = await run_fleet(Revision(state), RunOptions(concurrency=64), RunIO(connect=ssh_connector(str(key))))
    dt = time.perf_counter() - t0
    bad = [r for r in res.hosts if r.status != "in-sync"]
    if bad:
        raise SystemExit(f"not a no-change run: {[(r.host, r.status, r.message) for r in bad]}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 10, 30])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    fleetlib.build()
    key = fleetlib.client_key_path()
    hosts = fleetlib.up(max(args.sizes), first=FIRST, prefix="bench")
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            kh = fleetlib.write_known_hosts(hosts, Path(tmp) / "known_hosts")
            for n in args.sizes:
                sub = hosts[:n]
                repo = DesiredRepo(Path(tmp) / f"repo{n}")
                write_fleet(repo, sub)
                repo.commit()
                state = load.load_desired(source.snapshot(repo.repo))
                first = asyncio.run(run_fleet(Revision(state), RunOptions(concurrency=64),
                                              RunIO(connect=ssh_connector(str(key)))))
                assert all(r.status in ("converged", "in-sync") for r in first.hosts), first.to_json()
                floors, runs = [], []
                for _ in range(args.rounds):
                    floors.append(asyncio.run(floor(sub, kh, key)))
                    runs.append(asyncio.run(noop_run(state, key)))
                f, r = statistics.median(floors), statistics.median(runs)
                rows.append((n, f, r))
    finally:
        fleetlib.down(hosts)
    print(f"{'hosts':>5}  {'floor (asyncssh connect+true)':>30}  {'reconcile no-change':>20}  {'ratio':>6}")
    for n, f, r in rows:
        print(f"{n:>5}  {f * 1000:>27.0f} ms  {r * 1000:>17.0f} ms  {r / f:>6.2f}")
    print(f"(median of {args.rounds} rounds each; both in-process, Python start-up excluded)")


if __name__ == "__main__":
    main()
