"""Benchmark: wall time of a good rollout over 30 real hosts that share one definition, in waves
(canary 1, max_unavailable = 10) next to all at once (canary 0, max_unavailable = "100%").

Each round commits a good change (a new env value: every host restarts), then runs the whole
reconcile in-process: survey, waves, health waits (the stand-in loads for --load seconds, then
must stay healthy for --stable seconds). The waved run costs about one load + stable window per
wave; in exchange, a bad change costs one host instead of thirty. Prints a table; asserts only
that every host converged.

    sudo .venv/bin/python -m bench.rollout                    # 30 hosts, load 5 s, 1 round
    sudo .venv/bin/python -m bench.rollout --hosts 12 --load 3 --rounds 2

Boots its own hosts on 127.0.0.140 and up (RECONCILER_BENCH_FIRST), and stops them at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from reconciler.desired import load, source
from reconciler.loop.fleet import run_fleet
from reconciler.loop.host_run import ssh_connector
from reconciler.loop.options import RunIO, RunOptions
from reconciler.loop.results import FleetResult
from reconciler.loop.revision import Revision
from tests import fleet as fleetlib
from tests.conftest import STANDIN_UNIT, DesiredRepo, fleet_known_hosts

FIRST = int(os.environ.get("RECONCILER_BENCH_FIRST", "140"))
WAVED = 'canary = 1\nmax_unavailable = 10'
ALL_AT_ONCE = 'canary = 0\nmax_unavailable = "100%"'


def write(repo: DesiredRepo, hosts: list[fleetlib.Host], *, rollout: str, generation: int, load_s: float,
          stable_s: float) -> None:
    """One shared definition on every host; `generation` changes the env (a restart everywhere)."""
    repo.write("fleet.toml", f'[ssh]\nknown_hosts = "known_hosts"\n\n[rollout]\n{rollout}\n')
    repo.write("known_hosts", fleet_known_hosts(hosts))
    repo.write("units/standin.service", STANDIN_UNIT)
    repo.write("services/qwen.toml", "\n".join([
        'unit_file = "units/standin.service"',
        'model = { id = "Qwen/Qwen3-8B", path = "/models/Qwen3-8B" }',
        'vars = { port = "30000", args = "" }',
        f'env = {{ STANDIN_LOAD_SECONDS = "{load_s}", GENERATION = "{generation}" }}',
        'health = { http = "http://{host.address}:{vars.port}/health", startup_timeout = 120, '
        f'stable_for = {stable_s}, interval = 0.5 }}',
        ""]))
    for h in hosts:
        repo.write(f"hosts/{h.name}.toml", f'address = "{h.address}"\n\n[services.model]\nuse = "qwen"\n')


def run_once(repo: DesiredRepo, key: Path) -> tuple[float, FleetResult]:
    state = load.load_desired(source.snapshot(repo.repo))
    t0 = time.perf_counter()
    res = asyncio.run(run_fleet(Revision(state), RunOptions(concurrency=64), RunIO(connect=ssh_connector(str(key)))))
    dt = time.perf_counter() - t0
    bad = [(r.host, r.status, r.message) for r in res.hosts if r.status != "converged"]
    if bad:
        raise SystemExit(f"not a good rollout: {bad}")
    return dt, res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=30)
    ap.add_argument("--load", type=float, default=5.0, help="stand-in model load, seconds")
    ap.add_argument("--stable", type=float, default=2.0, help="health stable_for, seconds")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    fleetlib.build()
    key = fleetlib.client_key_path()
    hosts = fleetlib.up(args.hosts, first=FIRST, prefix="rbench")
    rows: dict[str, list[tuple[float, int]]] = {WAVED: [], ALL_AT_ONCE: []}
    gen = 0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            repo = DesiredRepo(Path(tmp) / "desired")
            write(repo, hosts, rollout=ALL_AT_ONCE, generation=gen, load_s=args.load, stable_s=args.stable)
            repo.commit("first deploy")
            run_once(repo, key)
            for _ in range(args.rounds):
                for policy in (WAVED, ALL_AT_ONCE):
                    gen += 1
                    write(repo, hosts, rollout=policy, generation=gen, load_s=args.load, stable_s=args.stable)
                    repo.commit(f"generation {gen}")
                    dt, res = run_once(repo, key)
                    (ro,) = res.rollouts
                    assert ro.status == "done" and len(ro.plan.pending) == args.hosts, ro.to_json()
                    rows[policy].append((dt, len(ro.plan.waves)))
    finally:
        fleetlib.down(hosts)
    print(f"good rollout over {args.hosts} hosts; stand-in load {args.load:g}s, stable_for {args.stable:g}s")
    print(f"{'policy':<52} {'waves':>5} {'bound':>6} {'wall':>9}")
    for policy, label in ((WAVED, "canary = 1, max_unavailable = 10"),
                          (ALL_AT_ONCE, 'canary = 0, max_unavailable = "100%" (all at once)')):
        wall = statistics.median(dt for dt, _ in rows[policy])
        waves = rows[policy][0][1]
        down = 10 if policy == WAVED else args.hosts
        print(f"{label:<52} {waves:>5} {min(down, args.hosts):>6} {wall:>8.1f}s")
    print(f"(median of {args.rounds} round(s); in-process, Python start-up excluded; every host converged)")


if __name__ == "__main__":
    main()
