"""End-to-end: safe under concurrency and disconnection (issue 12), on real hosts.

One reconcile of a host at a time; an older revision is refused by what the host records as
applied; a controller that dies during the health wait leaves the host to its dead-man's switch;
a push during a health wait supersedes it; the daemon's loop survives any exception. (The cut,
blackholed and killed connections at each step of an apply are in tests/e2e/test_e2e_faults.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests import fleet as fleetlib
from tests import signing
from tests.conftest import ROOT, STANDIN_UNIT, run_cli, run_json, wait_for, write_fleet
from tests.e2e.test_e2e_push import Deploy, git

pytestmark = pytest.mark.fleet


def svc(**env: str) -> dict:
    return {"port": 30000, "env": {"STANDIN_LOAD_SECONDS": "0.5", **env}}


def cli_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "RECONCILER_IDENTITY": str(fleetlib.client_key_path()), "COLUMNS": "200",
            "NO_COLOR": "1", **extra}


def record(fleet, h, name="model-a") -> dict:
    return json.loads(fleet.ssh(h, f"cat /var/lib/reconciler/services/{name}.json"))


@pytest.mark.timeout(90)
def test_two_runs_at_once_one_deploys_the_other_is_locked(fleet, repo):
    h = fleet.hosts[0]
    write_fleet(repo, [h], {"model-a": svc()})
    repo.commit()
    run_cli("--repo", str(repo.path), check_codes=(0,))
    before = fleet.show(h, "model-a", "InvocationID", "NRestarts")
    write_fleet(repo, [h], {"model-a": svc(STANDIN_LOAD_SECONDS="3", V="2")})
    repo.commit("a slow change")
    cmd = [sys.executable, "-m", "reconciler", "--repo", str(repo.path), "--json", "--lock-wait", "1"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    results = sorted((p.returncode, json.loads(o)["hosts"][0]) for p, (o, _) in zip(procs, outs, strict=True))
    (code_a, a), (code_b, b) = results
    assert (code_a, a["status"]) == (0, "converged"), a
    assert (code_b, b["reason"]) == (4, "Locked") and "held by reconcile on" in b["message"], b
    after = fleet.show(h, "model-a", "InvocationID", "NRestarts")
    assert after["InvocationID"] != before["InvocationID"]
    # exactly one restart: the deploying run's (the locked one changed nothing)
    assert sum(e["action"] == "deploy" for e in a["events"]) == 1 and b["events"] == []
    # released: the owner file emptied (a look reads that as no holder), the lock free
    assert fleet.ssh(h, "cat /var/lib/reconciler/.lock.owner 2>/dev/null; "
                        "flock -n /var/lib/reconciler/.lock echo free") == "free\n"


@pytest.mark.timeout(90)
def test_an_older_revision_is_refused_by_what_the_host_records(fleet, repo):
    h = fleet.hosts[0]
    write_fleet(repo, [h], {"model-a": svc()})
    c1 = repo.commit("v1")
    since = fleet.ssh(h, "date +%s").strip()
    run_cli("--repo", str(repo.path), check_codes=(0,))
    # a confirmed deploy never made its switch's timer: the lock's holder arms one only if the
    # controller goes without a verdict (no systemd-run, no stop)
    made = fleet.ssh(h, f"journalctl --no-pager -o cat --since @{since} -u reconciler-confirm-model-a.timer "
                        "-u reconciler-confirm-model-a.service", check=False)
    assert "reconciler-confirm-model-a" not in made, made
    # the healthy verdict disarmed the deploy's switch: no files, no enablement link, not active
    assert not fleet.exists(h, "/var/lib/reconciler/confirm/model-a.sh")
    assert not fleet.ssh(h, "ls -a /etc/systemd/system/timers.target.wants/ 2>/dev/null | grep confirm || true")
    assert fleet.show(h, "reconciler-confirm-model-a.timer", "ActiveState")["ActiveState"] == "inactive"
    write_fleet(repo, [h], {"model-a": svc(V="2")})
    c2 = repo.commit("v2")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    inv = fleet.show(h, "model-a", "InvocationID")["InvocationID"]
    # a fresh state store (another machine, a wiped cache): the host still knows
    code, out = run_json("--repo", str(repo.path), "--rev", c1, "--state-dir", "/tmp/reconciler-other-store",
                         check_codes=(4,))
    r = out["hosts"][0]
    assert r["reason"] == "NotDescendant" and f"{c1[:7]} does not descend from {c2[:7]}" in r["message"]
    assert "--allow-rewind" in r["message"]
    assert fleet.show(h, "model-a", "InvocationID")["InvocationID"] == inv
    code, out = run_json("--repo", str(repo.path), "--rev", c1, "--dry-run", check_codes=(4,))
    assert out["hosts"][0]["reason"] == "NotDescendant"       # a dry run says so too
    code, out = run_json("--repo", str(repo.path), "--rev", c1, "--allow-rewind", check_codes=(0,))
    assert out["hosts"][0]["status"] == "converged"
    assert "V=2" not in fleet.environment(h, "model-a")


@pytest.mark.timeout(120)
def test_a_controller_killed_in_the_health_wait_leaves_the_host_to_its_switch(fleet, repo):
    """Nobody comes back: within start-up timeout + stable_for + margin the host puts its last
    good version back by itself, and records why."""
    h = fleet.hosts[0]
    health = {"startup_timeout": 6, "stable_for": 1}
    write_fleet(repo, [h], {"model-a": {**svc(), "health": health}})
    c1 = repo.commit("v1")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    write_fleet(repo, [h], {"model-a": {**svc(STANDIN_HANG="1"), "health": health}})
    c2 = repo.commit("v2 never gets healthy")
    env = cli_env(RECONCILER_FAULT="in-watch", RECONCILER_CONFIRM_MARGIN="3")
    killed = subprocess.run([sys.executable, "-m", "reconciler", "--repo", str(repo.path)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert killed.returncode == -9
    armed = time.monotonic()
    # no timer while the controller held the host: its lock's holder arms the switch as it goes
    wait_for("the holder to arm the switch", lambda: fleet.show(h, "reconciler-confirm-model-a.timer", "ActiveState")
             ["ActiveState"] == "active", timeout=5)
    count = int(fleet.ssh(h, "cat /var/lib/reconciler/.lock.count"))
    deadline = armed + 6 + 1 + 3 + 20
    while record(fleet, h).get("quarantine") is None:
        assert time.monotonic() < deadline, fleet.ssh(h, "journalctl -u reconciler-confirm-model-a -n 20")
        time.sleep(0.5)
    fired = time.monotonic() - armed
    rec = record(fleet, h)
    assert rec["quarantine"]["reason"] == "NotConfirmed" and rec["quarantine"]["revision"] == c2
    assert rec["revision"] == c1 and rec["pending"] is None
    deadline = time.monotonic() + 15
    while fleet.show(h, "model-a", "ActiveState")["ActiveState"] != "active":
        assert time.monotonic() < deadline
        time.sleep(0.3)
    assert "STANDIN_HANG" not in fleet.environment(h, "model-a")
    assert not fleet.exists(h, "/var/lib/reconciler/confirm/model-a.sh")   # it cleaned up
    assert fleet.show(h, "reconciler-confirm-model-a.timer", "ActiveState")["ActiveState"] == "inactive"
    # It held the host lock as every holder does: counted itself, and let go of its owner line
    assert int(fleet.ssh(h, "cat /var/lib/reconciler/.lock.count")) == count + 1
    assert not fleet.exists(h, "/var/lib/reconciler/.lock.owner")
    print(f"switch fired {fired:.1f}s after the controller died (window {6 + 1 + 3}s)")
    # the next run finds v1 running, v2 quarantined, and restarts nothing
    inv = fleet.show(h, "model-a", "InvocationID")["InvocationID"]
    res = run_cli("--repo", str(repo.path), check_codes=(3,))
    assert f"desired {c2[:7]} quarantined (NotConfirmed)" in res.stdout
    assert fleet.show(h, "model-a", "InvocationID")["InvocationID"] == inv


@pytest.mark.timeout(120)
def test_a_push_during_the_stable_for_window_goes_live_at_once(fleet, tmp_path):
    h = fleet.hosts[0]
    d = Deploy(tmp_path)
    try:
        health = {"stable_for": 30}
        d.write([h], {"model-a": {**svc(), "health": health}})
        d.start()
        c1 = d.commit("v1")
        d.push()
        assert d.wait_exit_file(c1, timeout=60) == 0
        d.write([h], {"model-a": {**svc(V="2"), "health": health}})
        c2 = d.commit("v2: 30 s of stable_for")
        d.push()
        deadline = time.monotonic() + 20          # v2 healthy, now in its 30 s stable_for window
        while "stable for" not in d.daemon_log().split(f"reconcile {c2[:7]}")[-1]:
            assert time.monotonic() < deadline, d.daemon_log()[-2000:]
            time.sleep(0.2)
        d.write([h], {"model-a": {**svc(V="3"), "health": {"stable_for": 1}}})
        c3 = d.commit("v3")
        pushed = time.monotonic()
        d.push()
        deadline = pushed + 15
        while "V=3" not in fleet.environment(h, "model-a"):
            assert time.monotonic() < deadline, d.daemon_log()[-3000:]
            time.sleep(0.1)
        live = time.monotonic() - pushed
        assert d.wait_exit_file(c3, timeout=30) == 0
        assert "superseding the run of " + c2[:7] in d.daemon_log()
        rec = record(fleet, h)
        assert rec["last_good_revision"] == c3                  # never c2: it had no verdict
        print(f"v3 live {live:.1f}s after the push, during v2's stable_for window")
        assert live < 10
    finally:
        d.stop()


@pytest.mark.timeout(60)
def test_a_fresh_deploy_repo_is_not_refused_by_another_repos_history(fleet, tmp_path):
    """The daemon's cache of the last applied revision is per repo and branch: a new deploy repo
    (here: the same history, pushed to a new path) is never refused by the old one's entry."""
    h = fleet.hosts[0]
    old = Deploy(tmp_path / "old")
    old.write([h], {"model-a": svc()})
    old.commit("v1")
    old.start()
    old.push()
    old.stop()
    new = Deploy(tmp_path / "new")
    new.state = old.state                  # the same controller state directory
    new.env = {**new.env, "RECONCILER_STATE_DIR": str(old.state)}
    git(new.clone, "pull", "-q", str(old.bare), "main")
    new.write([h], {"model-a": svc(V="2")})
    c2 = new.commit("v2, pushed to the new repo")
    new.start()
    try:
        new.push()
        assert new.wait_exit_file(c2, timeout=60) == 0
        assert "NotDescendant" not in new.daemon_log()
    finally:
        new.stop()


@pytest.mark.timeout(120)
def test_a_rollback_to_an_unsigned_last_good_is_refused(fleet, repo, tmp_path):
    """A host's record names an unsigned revision as its last good (deployed before signing was
    required, or written by a compromised host): under the signing policy a failed deploy is
    not rolled back to it (the service is left stopped, and the run says why); without the
    policy the same host rolls back to it."""
    h = fleet.hosts[0]
    key = signing.keypair(tmp_path)
    signers = signing.allowed_signers(tmp_path / "allowed_signers", key)
    write_fleet(repo, [h], {"model-a": svc(V="1")})
    c1 = signing.commit(repo.path, "good, unsigned")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    assert record(fleet, h)["last_good_revision"] == c1
    write_fleet(repo, [h], {"model-a": svc(V="2")})
    repo.write("units/standin.service", STANDIN_UNIT.replace(
        "[Service]\n", '[Service]\nExecStartPre=/bin/sh -c "echo precheck failed >&2; exit 3"\n', 1))
    c2 = signing.commit(repo.path, "bad, signed", key)
    code, out = run_json("--repo", str(repo.path), "--allowed-signers", str(signers), check_codes=(4,))
    r = next(x for x in out["hosts"] if x["host"] == h.name)
    assert r["events"][0]["action"] == "deploy" and r["events"][0]["outcome"]["reason"] == "StartFailed"
    assert "rollback" not in [e["action"] for e in r["events"]], r["events"]
    assert r["states"]["model-a"] == "QuarantinedNoLastGood" and r["reason"] == "RollbackFailed", r
    assert f"last good {c1[:7]} cannot be rendered: left stopped" in r["message"], r["message"]
    rec = record(fleet, h)
    assert rec["quarantine"]["revision"] == c2 and rec["last_good_revision"] == c1
    assert fleet.show(h, "model-a", "ActiveState")["ActiveState"] in ("inactive", "failed")
    res = run_cli("--repo", str(repo.path), "--allowed-signers", str(signers), check_codes=(4,))
    assert f"refused to roll back to {c1[:7]}: Unsigned: commit {c1[:7]} is not signed" in res.stderr, res.stderr
    assert f"last good {c1[:7]} cannot be rendered" in res.stdout
    # the control: no signing policy, the same host rolls back to c1
    run_cli("--repo", str(repo.path), check_codes=(3,))
    assert fleet.show(h, "model-a", "ActiveState")["ActiveState"] == "active"
    assert "V=1" in fleet.environment(h, "model-a")
