"""Several controllers on one fleet (issue 15, item 6), on real hosts.

Controllers split a fleet by label (`--label shard=a`, or `labels = ["shard=a"]` in the daemon's
config): each reads and changes only its shard. Where they overlap, the host lock keeps them
from touching one host at once; a run that finds a host in sync reads it without the lock,
so a controller busy deploying never blocks another's no-change rounds there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests import fleet as fleetlib
from tests.conftest import ROOT, run_cli, run_json, write_fleet

pytestmark = pytest.mark.fleet

UNIT = "/etc/systemd/system/model-a.service"


def label(repo, host: fleetlib.Host, **labels: str) -> None:
    """Give a host file labels (write_fleet writes none)."""
    path = repo.path / "hosts" / f"{host.name}.toml"
    text = path.read_text()
    first, rest = text.split("\n", 1)
    items = ", ".join(f'{k} = "{v}"' for k, v in labels.items())
    path.write_text(f"{first}\nlabels = {{ {items} }}\n{rest}")


def start(*args: str) -> subprocess.Popen:
    env = {**os.environ, "RECONCILER_IDENTITY": str(fleetlib.client_key_path()), "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.Popen([sys.executable, "-m", "reconciler", *args, "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


@pytest.mark.timeout(90)
def test_two_controllers_split_the_fleet_by_label_and_each_changes_only_its_shard(fleet, repo):
    hosts = fleet.hosts[:4]
    write_fleet(repo, hosts)
    for h, shard in zip(hosts, "aabb", strict=True):
        label(repo, h, shard=shard)
    repo.commit("four hosts, two shards")
    # Shard a first, alone: shard b's hosts are not even read.
    code, out = run_json("--repo", str(repo.path), "--label", "shard=a", check_codes=(0,))
    assert [r["host"] for r in out["hosts"]] == [h.name for h in hosts[:2]]
    assert all(fleet.exists(h, UNIT) for h in hosts[:2]) and not any(fleet.exists(h, UNIT) for h in hosts[2:])
    # Both controllers at once, as two daemons of two shards would: both succeed, each on its own.
    a, b = start("--repo", str(repo.path), "--label", "shard=a"), start("--repo", str(repo.path), "--label", "shard=b")
    outs = {}
    for name, p in (("a", a), ("b", b)):
        stdout, stderr = p.communicate(timeout=60)
        assert p.returncode == 0, f"shard {name}: exit {p.returncode}\n{stdout}\n{stderr}"
        outs[name] = json.loads(stdout)
    assert {r["host"]: r["status"] for r in outs["a"]["hosts"]} == {hosts[0].name: "in-sync", hosts[1].name: "in-sync"}
    assert {r["host"]: r["status"] for r in outs["b"]["hosts"]} == {hosts[2].name: "converged",
                                                                   hosts[3].name: "converged"}
    for h in hosts:
        assert fleet.show(h, "model-a", "ActiveState")["ActiveState"] == "active"
    # A label no host carries is an error that names the labels in use, never "nothing to do".
    res = run_cli("--repo", str(repo.path), "--label", "shard=c", check_codes=(1,))
    assert "no host matches --label shard=c" in res.stdout + res.stderr and "shard=a" in res.stdout + res.stderr


@pytest.mark.timeout(60)
def test_a_host_in_sync_is_read_without_its_lock_and_a_change_waits_for_it(fleet, repo):
    """Another controller holds the host's lock (here: by hand, as a long deploy would). A
    no-change run reads the host and reports it in sync at once; a run with a change waits for
    the lock and reports Locked, changing nothing."""
    h = fleet.hosts[0]
    write_fleet(repo, [h])
    repo.commit("v1")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    fleet.ssh(h, "nohup flock /var/lib/reconciler/.lock sleep 40 >/dev/null 2>&1 &")
    try:
        t0 = time.monotonic()
        code, out = run_json("--repo", str(repo.path), "--lock-wait", "2", check_codes=(0,))
        assert out["hosts"][0]["status"] == "in-sync"
        assert time.monotonic() - t0 < 15                    # never waited for the lock
        write_fleet(repo, [h], {"model-a": {"port": 30000, "env": {"LOG_LEVEL": "debug"}}})
        repo.commit("v2")
        code, out = run_json("--repo", str(repo.path), "--lock-wait", "2", check_codes=(4,))
        assert out["hosts"][0]["reason"] == "Locked"
        assert "LOG_LEVEL=info" in fleet.environment(h, "model-a")   # untouched
    finally:
        fleet.ssh(h, "pkill -f 'flock /var/lib/reconciler/.lock' || true", check=False)
