"""Benchmark: from the end of `git push` to the change being live on a host.

A bare repo made by `reconcile init-repo`, a clone, the `reconcile watch` daemon, and one real
test host. Each round changes one env value, commits, pushes, and measures the time from the
moment `git push` returned to the moment systemd started the service's new process with the
new environment (ExecMainStartTimestampMonotonic: the containers share this machine's
monotonic clock). The goal: under 1 s plus the service's own restart. Asserts nothing.

    sudo .venv/bin/python -m bench.push_to_live [--rounds 5]

Boots its own host on 127.0.0.180 and stops it at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests import fleet as fleetlib
from tests.conftest import DesiredRepo, write_fleet

ROOT = Path(__file__).resolve().parent.parent
GIT_ENV = {"GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@example.invalid",
           "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@example.invalid"}


def git(cwd: Path, *args: str, env: dict) -> str:
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    fleetlib.build()
    first = int(os.environ.get("RECONCILER_BENCH_FIRST", "180"))
    hosts = fleetlib.up(1, first=first, prefix="push")
    h = hosts[0]
    proc = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            env = {**os.environ, **GIT_ENV, "RECONCILER_IDENTITY": str(fleetlib.client_key_path()),
                   "RECONCILER_STATE_DIR": str(tmp / "state"), "RECONCILER_CONFIG": str(tmp / "none.toml"),
                   "PYTHONUNBUFFERED": "1"}
            bare, clone = tmp / "deploy.git", tmp / "work"
            subprocess.run([sys.executable, "-m", "reconciler", "init-repo", str(bare)], env=env, cwd=ROOT,
                           check=True, capture_output=True)
            git(tmp, "clone", "-q", str(bare), str(clone), env=env)
            git(clone, "checkout", "-q", "-b", "main", env=env)
            repo = DesiredRepo.__new__(DesiredRepo)
            repo.path = clone

            def change(i: int) -> None:
                write_fleet(repo, [h], {"model-a": {"port": 30000, "env": {"ROUND": str(i)},
                                                    "health": {"stable_for": 0.5}}})
                git(clone, "add", "-A", env=env)
                git(clone, "commit", "-q", "-m", f"round {i}", env=env)

            change(0)
            git(clone, "push", "-q", "origin", "HEAD:main", env=env)
            with open(tmp / "daemon.log", "wb") as log:   # the daemon keeps its own copy of the descriptor
                proc = subprocess.Popen([sys.executable, "-m", "reconciler", "watch", "--repo", str(bare),
                                         "--interval", "600", "--metrics", ""], env=env, cwd=ROOT,
                                        stdout=log, stderr=subprocess.STDOUT)
            kh = fleetlib.write_known_hosts(hosts, tmp / "known_hosts")

            def show() -> dict[str, str]:
                out = subprocess.run([
                    *fleetlib.ssh_base(h.address, kh),
                    "systemctl show model-a -p ActiveState,ExecMainStartTimestampMonotonic; "
                    "sed -n 's/^ROUND=\"\\(.*\\)\"$/Round=\\1/p' /etc/reconciler/env/model-a.env"],
                    capture_output=True, text=True).stdout
                return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

            def wait_live(i: int, timeout: float = 60) -> float:
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    p = show()
                    if p.get("Round") == str(i) and p.get("ActiveState") == "active":
                        return int(p["ExecMainStartTimestampMonotonic"]) / 1e6
                    time.sleep(0.05)
                raise SystemExit(f"round {i} never went live:\n{(tmp / 'daemon.log').read_text()[-3000:]}")

            wait_live(0)
            time.sleep(2)   # let the first run finish its health wait
            lat = []
            for i in range(1, args.rounds + 1):
                change(i)
                t0 = time.monotonic()
                git(clone, "push", "-q", "origin", "HEAD:main", env=env)
                pushed = time.monotonic()
                live = wait_live(i)
                lat.append(live - pushed)
                print(f"round {i}: git push took {pushed - t0:.3f} s; new process started with the change "
                      f"{live - t0:.3f} s after the push began, {live - pushed:+.3f} s after it returned")
                time.sleep(1.5)   # the run's health wait (stable_for) ends before the next push
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)
        fleetlib.down(hosts)
    print(f"push end -> live: median {statistics.median(lat):+.3f} s, max {max(lat):+.3f} s over {len(lat)} "
          f"pushes (negative: live before `git push` returned, since the daemon reacts to the ref update "
          f"while the post-receive hook still runs). Goal: under 1 s plus the service's own restart.")


if __name__ == "__main__":
    main()
