"""End-to-end: every way a deploy can fail takes the one designed path (issue 9), on real hosts.

A start that fails (ExecStartPre=, a Type=notify start that times out, a oneshot that fails) is
rolled back like a crash loop; a unit someone made by hand is never touched unless adopted; a
hand-made drop-in is drift; a unit systemd would reject never replaces a working one; and a
controller killed at any point of a failing deploy leaves the host where the next run ends the
same way as an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import fleet as fleetlib
from tests.conftest import ROOT, SPEC_FLAGS, STANDIN_UNIT, run_cli, run_json, write_fleet

pytestmark = pytest.mark.fleet

INCIDENT_LINE = ("MTP with the hybrid GDN model needs --mamba-scheduler-strategy extra_buffer "
                 "and SGLANG_ENABLE_SPEC_V2=1")
QWEN35 = "Qwen3.5-122B-A10B"
UNIT = "/etc/systemd/system/m.service"
SERVER = "/usr/bin/python3 -m sglang.launch_server"      # the stand-in, run as SGLang is


def svc(**kw) -> dict:
    base = {"port": 30000, "model": "Qwen3-8B", "env": {"STANDIN_LOAD_SECONDS": "0.5"}}
    base.update(kw)
    return base


def record(fleet, h, name="m") -> dict:
    return json.loads(fleet.ssh(h, f"cat /var/lib/reconciler/services/{name}.json"))


def host_out(out: dict, name: str) -> dict:
    return next(r for r in out["hosts"] if r["host"] == name)


def sha(fleet, h, path: str) -> str:
    return fleet.ssh(h, f"sha256sum {path}").split()[0]


def argv(exec_start: str) -> str:
    """The command line of `systemctl show -p ExecStart` (without pid, times and status)."""
    return next(part for part in exec_start.split(" ; ") if part.startswith("argv[]="))


def with_unit(repo, extra_service_lines: str = "", replace: tuple[str, str] | None = None) -> None:
    """Rewrite the repo's stand-in unit: more [Service] lines, or one substitution."""
    text = STANDIN_UNIT.replace("[Service]\n", "[Service]\n" + extra_service_lines, 1)
    if replace:
        text = text.replace(*replace)
    repo.write("units/standin.service", text)


# ---- a start that fails is a health failure ----------------------------------------------------

START_FAILURES = {
    "exec-start-pre": ('ExecStartPre=/bin/sh -c "echo precheck: NCCL_SOCKET_IFNAME ib0 not found >&2; exit 3"\n',
                       "precheck: NCCL_SOCKET_IFNAME ib0 not found"),
    "notify-timeout": ("Type=notify\nTimeoutStartSec=2\n", "start operation timed out"),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", sorted(START_FAILURES))
def test_a_start_that_fails_is_rolled_back_and_not_reapplied(fleet, repo, kind):
    h = fleet.hosts[0]
    write_fleet(repo, [h], {"m": svc()})
    c1 = repo.commit("good")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    lines, quote = START_FAILURES[kind]
    write_fleet(repo, [h], {"m": svc()})
    with_unit(repo, lines, replace=("Type=simple\n", "") if "Type=" in lines else None)
    c2 = repo.commit(f"bad: {kind}")

    code, out = run_json("--repo", str(repo.path), check_codes=(3,))
    ev = host_out(out, h.name)["events"]
    assert ev[0]["action"] == "deploy" and ev[0]["outcome"]["reason"] == "StartFailed", ev
    assert quote in (ev[0]["outcome"]["quote"] or ""), ev[0]["outcome"]
    assert ev[1]["action"] == "rollback" and ev[1]["revision"] == c1 and ev[1]["outcome"]["healthy"]
    rec = record(fleet, h)
    assert rec["quarantine"]["revision"] == c2 and rec["quarantine"]["reason"] == "StartFailed"
    assert rec["last_good_revision"] == c1 and rec["pending"] is None
    p = fleet.show(h, "m", "ActiveState", "SubState", "InvocationID")
    assert (p["ActiveState"], p["SubState"]) == ("active", "running")
    assert "ExecStartPre" not in fleet.ssh(h, f"cat {UNIT}") and "Type=notify" not in fleet.ssh(h, f"cat {UNIT}")

    # The same commit again: the failed version is not re-applied; nothing restarts.
    res = run_cli("--repo", str(repo.path), check_codes=(3,))
    assert f"desired {c2[:7]} quarantined (StartFailed)" in res.stdout, res.stdout
    assert fleet.show(h, "m", "InvocationID")["InvocationID"] == p["InvocationID"]


@pytest.mark.timeout(60)
def test_a_failing_first_start_is_left_stopped_and_held(fleet, repo):
    h = fleet.hosts[0]
    write_fleet(repo, [h], {"m": svc()})
    repo.write("units/standin.service", "[Service]\nType=oneshot\nExecStart=/bin/sh -c 'echo cannot open "
                                        "/dev/nvidia0 >&2; exit 1'\n")
    c1 = repo.commit("a oneshot that fails")
    code, out = run_json("--repo", str(repo.path), check_codes=(4,))
    r = host_out(out, h.name)
    assert r["reason"] == "FirstDeployFailed" and r["events"][0]["outcome"]["reason"] == "StartFailed"
    assert fleet.show(h, "m", "ActiveState")["ActiveState"] in ("inactive", "failed")
    # dry-run shows the hold; a run does not start it again
    dry = run_cli("--repo", str(repo.path), "--dry-run", check_codes=(4,))
    assert f"hold m  (desired {c1[:7]} quarantined (StartFailed); first deploy failed: left stopped" in dry.stdout
    inv = fleet.show(h, "m", "InvocationID")["InvocationID"]
    run_cli("--repo", str(repo.path), check_codes=(4,))
    assert fleet.show(h, "m", "InvocationID")["InvocationID"] == inv


# ---- foreign units -----------------------------------------------------------------------------

HANDMADE = ("[Unit]\nDescription=made by hand\n\n[Service]\nExecStart=/bin/sleep infinity\n\n"
            "[Install]\nWantedBy=multi-user.target\n")


@pytest.mark.timeout(90)
def test_a_foreign_unit_is_never_touched_and_adopt_takes_it_over_and_gives_it_back(fleet, repo):
    h = fleet.hosts[0]
    fleet.ssh(h, f"printf '%s' '{HANDMADE}' > /etc/systemd/system/model-a.service && systemctl daemon-reload "
                 "&& systemctl enable --now model-a")
    before = sha(fleet, h, "/etc/systemd/system/model-a.service")
    inv = fleet.show(h, "model-a", "InvocationID")["InvocationID"]

    write_fleet(repo, [h], {"model-a": svc(port=30000), "model-b": svc(port=30001)})
    repo.commit("two services; one name is taken by a hand-made unit")
    dry = run_cli("--repo", str(repo.path), "--dry-run", check_codes=(4,))
    assert "/etc/systemd/system/model-a.service was not installed by the reconciler" in dry.stdout
    code, out = run_json("--repo", str(repo.path), check_codes=(4,))
    r = host_out(out, h.name)
    assert r["reason"] == "Foreign" and r["states"] == {"model-a": "Foreign", "model-b": "New"}
    assert sha(fleet, h, "/etc/systemd/system/model-a.service") == before        # byte for byte
    assert fleet.show(h, "model-a", "InvocationID")["InvocationID"] == inv       # never restarted
    assert fleet.show(h, "model-b", "ActiveState")["ActiveState"] == "active"    # the rest converged
    assert not fleet.exists(h, "/var/lib/reconciler/services/model-a.json")      # not in the inventory

    # adopt = true: taken over, the original kept ...
    text = (repo.path / f"hosts/{h.name}.toml").read_text()
    repo.write(f"hosts/{h.name}.toml", text.replace("[services.model-a]\n", "[services.model-a]\nadopt = true\n"))
    repo.commit("adopt model-a")
    code, out = run_json("--repo", str(repo.path), check_codes=(0,))
    assert host_out(out, h.name)["states"]["model-a"] == "Adopt"
    assert "sglang.launch_server" in fleet.ssh(h, "cat /etc/systemd/system/model-a.service")
    assert sha(fleet, h, "/var/lib/reconciler/adopted/model-a/etc/systemd/system/model-a.service") == before
    assert record(fleet, h, "model-a")["adopted"]["was_active"] is True

    # ... and put back, running, when the service leaves git.
    text = (repo.path / f"hosts/{h.name}.toml").read_text()
    repo.write(f"hosts/{h.name}.toml", text.split("[services.model-a]")[0] + "[services.model-b]" +
               text.split("[services.model-b]")[1])
    repo.commit("model-a leaves the desired state")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    assert sha(fleet, h, "/etc/systemd/system/model-a.service") == before
    p = fleet.show(h, "model-a", "ActiveState", "ExecStart", "UnitFileState")
    assert p["ActiveState"] == "active" and "/bin/sleep" in p["ExecStart"] and p["UnitFileState"] == "enabled"
    assert not fleet.exists(h, "/var/lib/reconciler/services/model-a.json")


# ---- drop-ins ----------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_a_hand_made_drop_in_is_drift_and_is_removed(fleet, repo):
    h = fleet.hosts[0]
    write_fleet(repo, [h], {"m": svc()})
    repo.commit()
    run_cli("--repo", str(repo.path), check_codes=(0,))
    want = argv(fleet.show(h, "m", "ExecStart")["ExecStart"])
    # `systemctl edit m` and `systemctl edit --runtime m`, as an operator would at 3 a.m.
    override = (f"[Service]\nExecStart=\nExecStart={SERVER} --model-path /models/Qwen3-8B "
                f"--host {h.address} --port 30000 --log-level debug\n")
    fleet.ssh(h, "mkdir -p /etc/systemd/system/m.service.d /run/systemd/system/m.service.d && "
                 f"printf '%s' '{override}' > /etc/systemd/system/m.service.d/override.conf && "
                 "printf '[Service]\\nEnvironment=STANDIN_LOAD_SECONDS=3\\n' > "
                 "/run/systemd/system/m.service.d/50-x.conf"
                 " && systemctl daemon-reload && systemctl restart m")
    assert "--log-level debug" in fleet.show(h, "m", "ExecStart")["ExecStart"]

    dry = run_cli("--repo", str(repo.path), "--dry-run", check_codes=(2,))
    assert f"{h.name}:/etc/systemd/system/m.service.d/override.conf" in dry.stdout
    assert f"{h.name}:/run/systemd/system/m.service.d/50-x.conf" in dry.stdout
    assert f"-ExecStart={SERVER} --model-path /models/Qwen3-8B" in dry.stdout      # its content
    assert "drop-in not written by the reconciler" in dry.stdout

    code, out = run_json("--repo", str(repo.path), check_codes=(0,))
    assert host_out(out, h.name)["states"]["m"] == "Drifted"
    assert not fleet.exists(h, "/etc/systemd/system/m.service.d/override.conf")
    assert not fleet.exists(h, "/run/systemd/system/m.service.d/50-x.conf")
    p = fleet.show(h, "m", "ExecStart", "MainPID", "DropInPaths")
    assert argv(p["ExecStart"]) == want and "override.conf" not in p["DropInPaths"]
    cmdline = fleet.ssh(h, f"tr '\\0' ' ' < /proc/{p['MainPID']}/cmdline")
    assert "--log-level" not in cmdline and "--model-path /models/Qwen3-8B" in cmdline   # the process runs git's
    assert "override.conf" in fleet.ssh(h, "find /var/lib/reconciler/removed -name override.conf")  # kept aside

    # A drop-in the service allows stays, and does not count as drift.
    fleet.ssh(h, "printf '[Service]\\nNice=5\\n' > /etc/systemd/system/m.service.d/10-nice.conf "
                 "&& systemctl daemon-reload")
    text = (repo.path / f"hosts/{h.name}.toml").read_text()
    repo.write(f"hosts/{h.name}.toml",
               text.replace("[services.m]\n", '[services.m]\nallow_dropins = ["10-nice.conf"]\n'))
    repo.commit("allow the nice drop-in")
    code, out = run_json("--repo", str(repo.path), check_codes=(0,))
    assert host_out(out, h.name)["states"]["m"] == "InSync"
    assert fleet.exists(h, "/etc/systemd/system/m.service.d/10-nice.conf")


@pytest.mark.timeout(60)
def test_pre_flight_judges_the_command_line_an_allowed_drop_in_makes(fleet, repo):
    """An allowed drop-in that adds the incident's flags is judged with them: blocked."""
    h = fleet.hosts[0]
    write_fleet(repo, [h], {"sglang": svc(model=QWEN35)}, extra={})
    repo.commit()
    run_cli("--repo", str(repo.path), check_codes=(0,))
    dropin = (f"[Service]\nExecStart=\nExecStart={SERVER} --model-path /models/" + QWEN35 +
              f" --host {h.address} --port 30000 {SPEC_FLAGS}\n")
    fleet.ssh(h, f"mkdir -p /etc/systemd/system/sglang.service.d && printf '%s' '{dropin}' > "
                 "/etc/systemd/system/sglang.service.d/20-mtp.conf")
    write_fleet(repo, [h], {"sglang": svc(model=QWEN35, env={"STANDIN_LOAD_SECONDS": "0.6"})}, extra={})
    text = (repo.path / f"hosts/{h.name}.toml").read_text()
    repo.write(f"hosts/{h.name}.toml", text.replace("[services.sglang]\n",
                                                    '[services.sglang]\nallow_dropins = ["20-mtp.conf"]\n'))
    repo.commit("allow a drop-in that turns on MTP")
    code, out = run_json("--repo", str(repo.path), check_codes=(4,))
    r = host_out(out, h.name)
    assert r["reason"] == "PreflightFailed" and "sglang-spec-hybrid-extra-buffer" in r["message"]


# ---- systemd's own check of the unit -----------------------------------------------------------

INVALID = {
    "unknown-key": ("FooBar=1\n", "line 7: Unknown key 'FooBar' in section [Service], ignoring. (`FooBar=1`)"),
    "bad-value": ("Restart=sometimes\n", "Failed to parse service restart specifier, ignoring: sometimes"),
    "no-exec-start": (None, "has no ExecStart="),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(INVALID))
def test_a_unit_systemd_would_reject_never_replaces_the_working_one(fleet, repo, kind):
    h = fleet.hosts[0]
    write_fleet(repo, [h], {"m": svc()})
    repo.commit("good")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    good = sha(fleet, h, UNIT)
    rec = fleet.ssh(h, "cat /var/lib/reconciler/services/m.json /var/lib/reconciler/host.json")
    inv = fleet.show(h, "m", "InvocationID")["InvocationID"]
    lines, quote = INVALID[kind]
    write_fleet(repo, [h], {"m": svc()})
    if lines is None:
        with_unit(repo, replace=("ExecStart=", "#ExecStart="))
    else:
        with_unit(repo, lines)
    repo.commit(f"bad unit: {kind}")
    dry = run_cli("--repo", str(repo.path), "--dry-run", check_codes=(4,))
    assert "UnitInvalid" in dry.stdout and quote in dry.stdout, dry.stdout
    code, out = run_json("--repo", str(repo.path), check_codes=(4,))
    r = host_out(out, h.name)
    assert r["reason"] == "UnitInvalid" and quote in r["message"]
    assert sha(fleet, h, UNIT) == good
    assert fleet.show(h, "m", "InvocationID")["InvocationID"] == inv
    assert fleet.ssh(h, "cat /var/lib/reconciler/services/m.json /var/lib/reconciler/host.json") == rec
    assert not fleet.ssh(h, "ls -a /etc/systemd/system | grep reconciler-tmp || true").strip()


# ---- quarantine shows as actions in a dry run ---------------------------------------------------


@pytest.mark.timeout(90)
def test_dry_run_shows_the_substitution_and_the_hold(fleet, repo):
    h = fleet.hosts[0]
    write_fleet(repo, [h], {"sglang": svc(model=QWEN35)})
    c1 = repo.commit("good")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    write_fleet(repo, [h], {"sglang": svc(model=QWEN35, args=SPEC_FLAGS)})
    c2 = repo.commit("the incident")
    run_cli("--repo", str(repo.path), check_codes=(3,))

    dry = run_cli("--repo", str(repo.path), "--dry-run", check_codes=(3,))
    assert f"hold sglang  (desired {c2[:7]} quarantined (CrashLoop), running {c1[:7]})" in dry.stdout, dry.stdout
    # The last good is stopped by hand: the dry run shows the substitution that will restart it.
    fleet.ssh(h, "systemctl stop sglang")
    dry = run_cli("--repo", str(repo.path), "--dry-run", check_codes=(3,))
    assert f"start sglang  (substitute last good {c1[:7]}" in dry.stdout, dry.stdout
    code, out = run_json("--repo", str(repo.path), check_codes=(3,))
    assert host_out(out, h.name)["events"][0]["action"] == "rollback"
    assert fleet.show(h, "sglang", "ActiveState")["ActiveState"] == "active"
    assert "--speculative" not in fleet.show(h, "sglang", "ExecStart")["ExecStart"]


# ---- the controller killed in the middle of a failing deploy -----------------------------------


def run_killed(point: str, repo) -> subprocess.CompletedProcess:
    env = {**os.environ, "RECONCILER_IDENTITY": str(fleetlib.client_key_path()), "RECONCILER_FAULT": point,
           "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "reconciler", "--repo", str(repo.path)], capture_output=True,
                          text=True, env=env, timeout=60, cwd=ROOT)


def end_state(fleet, h) -> tuple:
    rec = record(fleet, h, "sglang")
    q = rec["quarantine"] or {}
    p = fleet.show(h, "sglang", "ActiveState", "SubState", "ExecStart")
    return (rec["last_good_revision"], rec["hash"] == rec["last_good_hash"], q.get("revision"), q.get("reason"),
            bool(q.get("rollback_failed")), rec["pending"], p["ActiveState"], p["SubState"],
            "--speculative" in p["ExecStart"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", ["mid-apply", "before-apply", "after-apply", "in-watch", "after-verdict",
                                   "in-rollback-watch"])
def test_a_controller_killed_mid_deploy_ends_where_an_uninterrupted_run_ends(fleet, repo, point):
    h = fleet.hosts[0]
    write_fleet(repo, [h], {"sglang": svc(model=QWEN35)})
    c1 = repo.commit("good")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    write_fleet(repo, [h], {"sglang": svc(model=QWEN35, args=SPEC_FLAGS)})
    c2 = repo.commit("the incident")

    killed = run_killed(point, repo)
    assert killed.returncode == -9, (point, killed.returncode, killed.stdout[-2000:], killed.stderr[-2000:])
    # The next run finishes the job: rolled back to c1, c2 quarantined, nothing pending.
    res = run_cli("--repo", str(repo.path), check_codes=(3,))
    assert end_state(fleet, h) == (c1, True, c2, "CrashLoop", False, None, "active", "running", False), res.stdout
    assert INCIDENT_LINE in res.stdout or f"desired {c2[:7]} quarantined" in res.stdout
    # ... and stays there: no flapping, nothing restarted again.
    inv = fleet.show(h, "sglang", "InvocationID")["InvocationID"]
    run_cli("--repo", str(repo.path), check_codes=(3,))
    assert fleet.show(h, "sglang", "InvocationID")["InvocationID"] == inv
    leftovers = fleet.ssh(h, "ls -a /etc/systemd/system /var/lib/reconciler/services | grep reconciler-tmp || true")
    assert not leftovers.strip()


@pytest.mark.timeout(90)
def test_uninterrupted_reference_end_state(fleet, repo):
    """The end state the killed runs are compared with, reached without a kill."""
    h = fleet.hosts[0]
    write_fleet(repo, [h], {"sglang": svc(model=QWEN35)})
    c1 = repo.commit("good")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    write_fleet(repo, [h], {"sglang": svc(model=QWEN35, args=SPEC_FLAGS)})
    c2 = repo.commit("the incident")
    res = run_cli("--repo", str(repo.path), check_codes=(3,))
    assert INCIDENT_LINE in res.stdout
    assert end_state(fleet, h) == (c1, True, c2, "CrashLoop", False, None, "active", "running", False)
