"""End-to-end: pre-flight on real hosts (issue 5). Rules see the model's own config.json on the
host; an incomplete model is named file by file; a blocked deploy writes nothing and the old
service keeps running."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests import fleet as fleetlib
from tests.conftest import SPEC_FLAGS, run_cli, run_json, write_fleet

pytestmark = pytest.mark.fleet
UNIT = "/etc/systemd/system/sglang.service"


def svc(model: str, **kw) -> dict:
    return {"port": 30000, "model": model, "env": {"STANDIN_LOAD_SECONDS": "0.5"}, **kw}


@pytest.mark.timeout(60)
def test_incident_flags_blocked_before_the_old_service_stops(fleet, repo):
    h = fleet.hosts[0]
    write_fleet(repo, [h], {"sglang": svc("Qwen3.5-122B-A10B")}, extra={})
    repo.commit("healthy")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    inv = fleet.show(h, "sglang", "InvocationID")["InvocationID"]
    unit = fleet.ssh(h, f"cat {UNIT}")
    record = fleet.ssh(h, "cat /var/lib/reconciler/services/sglang.json /var/lib/reconciler/host.json")

    write_fleet(repo, [h], {"sglang": svc("Qwen3.5-122B-A10B", args=SPEC_FLAGS)}, extra={})
    repo.commit("add MTP")
    code, out = run_json("--repo", str(repo.path), "--dry-run", check_codes=(4,))
    r = out["hosts"][0]
    assert r["reason"] == "PreflightFailed"
    assert "needs --mamba-scheduler-strategy extra_buffer and SGLANG_ENABLE_SPEC_V2=1" in r["message"]
    assert "Fix:" in r["message"]
    res = run_cli("--repo", str(repo.path), check_codes=(4,))
    assert "PreflightFailed" in res.stdout and "sglang-spec-hybrid-extra-buffer" in res.stdout
    # nothing changed on the host: same process, same files, same record
    assert fleet.show(h, "sglang", "InvocationID")["InvocationID"] == inv
    assert fleet.ssh(h, f"cat {UNIT}") == unit
    assert fleet.ssh(h, "cat /var/lib/reconciler/services/sglang.json /var/lib/reconciler/host.json") == record


@pytest.mark.timeout(60)
def test_hybrid_config_under_an_unknown_model_id_is_caught_on_the_host(fleet, repo):
    h = fleet.hosts[0]
    # "Qwen/Hybrid-Unknown" is no model the rule pack knows: validate has nothing to go on...
    write_fleet(repo, [h], {"sglang": svc("Hybrid-Unknown", args=SPEC_FLAGS)}, extra={})
    repo.commit()
    run_cli("validate", "--repo", str(repo.path), check_codes=(0,))
    # ...but its config.json on the host has linear-attention layers.
    code, out = run_json("--repo", str(repo.path), "--dry-run", check_codes=(4,))
    msg = out["hosts"][0]["message"]
    assert "sglang-spec-hybrid-extra-buffer" in msg and "Fix:" in msg
    run_cli("--repo", str(repo.path), check_codes=(4,))
    assert not fleet.exists(h, UNIT) and fleet.no_records(h)


@pytest.mark.timeout(60)
def test_incomplete_model_names_the_missing_files_and_writes_nothing(fleet, repo):
    h = fleet.hosts[0]
    write_fleet(repo, [h], {"sglang": svc("Broken-MissingShard")}, extra={})
    repo.commit()
    code, out = run_json("--repo", str(repo.path), "--dry-run", check_codes=(4,))
    msg = out["hosts"][0]["message"]
    assert "model-incomplete" in msg
    assert "model-00003-of-00003.safetensors missing" in msg
    assert "model-00002-of-00003.safetensors is empty (0 bytes)" in msg
    run_cli("--repo", str(repo.path), check_codes=(4,))
    assert not fleet.exists(h, UNIT) and fleet.no_records(h)
    hist = json.loads(run_cli("history", h.name, "--json", check_codes=(0,)).stdout)
    assert hist[0]["action"] == "blocked" and "missing" in hist[0]["message"]


@pytest.mark.timeout(60)
def test_complete_model_and_good_flags_pass_the_gate(fleet, repo):
    h = fleet.hosts[0]
    write_fleet(repo, [h], {"sglang": svc("Qwen3-8B", args=SPEC_FLAGS)}, extra={})   # dense: no extra buffer needed
    repo.commit()
    code, out = run_json("--repo", str(repo.path), check_codes=(0,))
    assert out["hosts"][0]["status"] == "converged"


def commit_model_fetch(repo, h, model: str, message: str = "a model to fetch") -> None:
    """The fleet with h's service loading `model` (what follows `path = ` in its model table:
    a directory, a fetch command and their settings) in place of /models/Qwen3-8B."""
    write_fleet(repo, [h], {"sglang": svc("Qwen3-8B")}, extra={})
    text = (repo.path / f"hosts/{h.name}.toml").read_text().replace('path = "/models/Qwen3-8B" }', f"path = {model} }}")
    repo.write(f"hosts/{h.name}.toml", text)
    repo.commit(message)


@pytest.mark.timeout(60)
def test_model_fetch_downloads_a_missing_model_before_the_start(fleet, repo):
    h = fleet.hosts[0]
    # point the service at a directory that does not exist yet, with a fetch command that fills it
    commit_model_fetch(repo, h, '"/tmp/model-fetched/Qwen3-8B", fetch = "sleep 1 && cp -r /models/Qwen3-8B/. .", '
                                'fetch_timeout = 20')
    code, out = run_json("--repo", str(repo.path), "--dry-run", check_codes=(2,))
    fetch = [a for a in out["hosts"][0]["actions"] if a["kind"] == "fetch-model"]
    assert fetch and "fetch Qwen/Qwen3-8B into /tmp/model-fetched/Qwen3-8B first" in fetch[0]["detail"]
    assert not fleet.exists(h, "/tmp/model-fetched")               # a dry run fetches nothing
    code, out = run_json("--repo", str(repo.path), check_codes=(0,))
    assert any("fetched Qwen/Qwen3-8B" in n for n in out["hosts"][0]["notes"])
    assert fleet.exists(h, "/tmp/model-fetched/Qwen3-8B/model-00002-of-00002.safetensors")
    assert fleet.show(h, "sglang", "ActiveState")["ActiveState"] == "active"


@pytest.mark.timeout(60)
def test_failing_or_slow_fetch_blocks_the_deploy(fleet, repo):
    h = fleet.hosts[0]
    for fetch, expect in (("echo 'hub: 401 Unauthorized' >&2; exit 3", "401 Unauthorized"),
                          ("sleep 30", "did not finish within 2s")):
        commit_model_fetch(repo, h, f'"/tmp/model-fetched/X", fetch = "{fetch}", fetch_timeout = 2', fetch)
        code, out = run_json("--repo", str(repo.path), check_codes=(4,))
        assert out["hosts"][0]["reason"] == "ModelFetchFailed" and expect in out["hosts"][0]["message"]
        assert not fleet.exists(h, UNIT)


@pytest.mark.timeout(60)
def test_a_fetch_the_disk_has_no_room_for_is_refused_before_it_runs(fleet, repo):
    """The host's free space (df, read only for a model a fetch may fill) against the model's
    size: 1,000,000 GB does not fit, so the fetch never runs and nothing is written."""
    h = fleet.hosts[0]
    commit_model_fetch(repo, h, '"/tmp/model-fetched/Z", fetch = "touch /tmp/fetch-ran", size_gb = 1000000',
                       "a model no disk holds")
    code, out = run_json("--repo", str(repo.path), check_codes=(4,))
    r = out["hosts"][0]
    assert r["reason"] == "ModelFetchFailed", r
    assert "not enough disk for Qwen/Qwen3-8B at /tmp/model-fetched/Z: needs 1000000.0 GB" in r["message"]
    assert not fleet.exists(h, "/tmp/fetch-ran") and not fleet.exists(h, UNIT)

# ---- issue 11: what the server will load, which release it is, the GPU gate on every start ----

QWEN35 = "Qwen3.5-122B-A10B"
COMMAND_LINE_MODEL_UNIT = (
    "[Service]\nType=simple\nExecStart=/usr/bin/python3 -m sglang.launch_server --model-path /models/" + QWEN35 +
    " --host {host.address} --port {vars.port} {vars.args}\nRestart=always\nRestartSec=1\n")


@pytest.mark.timeout(60)
def test_the_incident_unit_with_the_model_only_on_the_command_line_is_blocked(fleet, repo):
    h = fleet.hosts[0]
    write_fleet(repo, [h], {"sglang": svc(None)}, extra={})
    repo.write("units/standin.service", COMMAND_LINE_MODEL_UNIT)
    repo.commit("no [model] table: the unit names the model")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    inv = fleet.show(h, "sglang", "InvocationID")["InvocationID"]

    write_fleet(repo, [h], {"sglang": svc(None, args=SPEC_FLAGS)}, extra={})
    repo.write("units/standin.service", COMMAND_LINE_MODEL_UNIT)
    repo.commit("the incident's flags")
    for dry in (True, False):
        code, out = run_json("--repo", str(repo.path), *(["--dry-run"] if dry else []), check_codes=(4,))
        r = out["hosts"][0]
        assert r["reason"] == "PreflightFailed" and "sglang-spec-hybrid-extra-buffer" in r["message"], r
        assert "Fix: add `--mamba-scheduler-strategy extra_buffer`" in r["message"]
        # A dry run of an unsigned revision runs no engine check (issue 39); the real run does.
        # The stand-in sglang package has no argument stage: the engine check is inconclusive
        # (told without starting python) and the rule pack decides (above).
        note = ("sglang: engine check skipped (the revision is not signed; --engine-check runs it); the static "
                "rules decide") if dry else (
                "sglang: engine check inconclusive (sglang): sglang is not installed for /usr/bin/python3 (no "
                "sglang/srt/server_args.py in its package directories); the static rules decide")
        assert note in r["notes"], r["notes"]
    assert fleet.show(h, "sglang", "InvocationID")["InvocationID"] == inv


@pytest.mark.timeout(90)
def test_a_rule_fires_on_one_server_version_and_not_on_another(fleet, repo):
    """The incident rule holds for SGLang 0.5.10-0.5.13: the same flags are blocked where the
    host's sglang is 0.5.12 and deploy (healthy) where it is 0.5.14."""
    old, new = fleet.hosts[0], fleet.hosts[1]
    newer = fleet.ssh(new, fleetlib.standin_package("0.5.14")).strip()
    write_fleet(repo, [old, new], {"sglang": svc(QWEN35, args=SPEC_FLAGS)}, extra={})
    text = (repo.path / f"hosts/{new.name}.toml").read_text()
    repo.write(f"hosts/{new.name}.toml", text.replace('env = { ', f'env = {{ PYTHONPATH = "{newer}", '))
    repo.commit("MTP on two hosts: sglang 0.5.12 on one, 0.5.14 on the other")
    code, out = run_json("--repo", str(repo.path), check_codes=(4,))
    by = {r["host"]: r for r in out["hosts"]}
    assert by[old.name]["reason"] == "PreflightFailed" and "sglang-spec-hybrid-extra-buffer" in by[old.name]["message"]
    assert by[new.name]["status"] == "converged", by[new.name]
    assert fleet.show(new, "sglang", "ActiveState")["ActiveState"] == "active"
    assert not fleet.exists(old, UNIT)
    # The version was read from the host's files (no python started, nothing cached: issue 39).
    assert not (Path(os.environ["RECONCILER_STATE_DIR"]) / "server-versions.json").exists()


def gpu_svc(gpus: str, **kw) -> dict:
    env = {"STANDIN_LOAD_SECONDS": "0.3", "CUDA_VISIBLE_DEVICES": gpus, "FAKE_GPU_HOLD": gpus, **kw.pop("env", {})}
    return svc("Qwen3-8B", env=env, **kw)


def gate_steps(out: dict) -> list[str]:
    return [f"{a['kind']} {a['service']}" for a in out["hosts"][0]["actions"]
            if a["kind"] in ("stop", "wait-gpus", "start", "restart")]


@pytest.mark.timeout(90)
def test_first_deploys_and_rollback_starts_are_gated(fleet, repo):
    h = fleet.hosts[0]
    fleet.ssh(h, fleetlib.gpu_host(2))
    write_fleet(repo, [h], {"m": gpu_svc("0")})
    c1 = repo.commit("first deploy on a GPU host")
    code, out = run_json("--repo", str(repo.path), "--dry-run", check_codes=(2,))
    assert gate_steps(out) == ["wait-gpus m", "start m"]
    code, out = run_json("--repo", str(repo.path), check_codes=(0,))
    assert any(n.startswith("m: GPUs free for the start") for n in out["hosts"][0]["notes"]), out["hosts"][0]["notes"]

    write_fleet(repo, [h], {"m": gpu_svc("0", env={"STANDIN_CRASH_AFTER": "0.2"}, health={"stable_for": 2})})
    repo.commit("crashes after start")
    code, out = run_json("--repo", str(repo.path), check_codes=(3,))
    r = out["hosts"][0]
    assert [e["action"] for e in r["events"]] == ["deploy", "rollback"] and r["events"][1]["revision"] == c1
    # the deploy's restart and the rollback's start both went through the gate
    assert gate_steps(out).count("wait-gpus m") == 2, gate_steps(out)
    assert sum(n.startswith("m: GPUs free") for n in r["notes"]) == 2, r["notes"]


@pytest.mark.timeout(60)
def test_a_stray_on_the_claimed_gpu_blocks_before_anything_stops(fleet, repo):
    h = fleet.hosts[0]
    fleet.ssh(h, fleetlib.gpu_host(2))
    write_fleet(repo, [h], {"m": gpu_svc("0")})
    repo.commit()
    run_cli("--repo", str(repo.path), check_codes=(0,))
    inv = fleet.show(h, "m", "InvocationID")["InvocationID"]
    stray = fleet.ssh(h, fleetlib.stray("0")).strip()
    write_fleet(repo, [h], {"m": gpu_svc("0", env={"LOG_LEVEL": "debug"})})
    repo.commit("a change while a stray holds GPU 0")
    code, out = run_json("--repo", str(repo.path), check_codes=(4,))
    r = out["hosts"][0]
    assert r["reason"] == "GpuBusy" and f"pid {stray} (sleep" in r["message"] and "Nothing was stopped" in r["message"]
    assert fleet.show(h, "m", "InvocationID")["InvocationID"] == inv          # never stopped
    assert fleet.ssh(h, f"kill -0 {stray} && echo alive").strip() == "alive"   # "report": left alone


@pytest.mark.timeout(60)
def test_kill_takes_the_stray_on_the_claimed_gpu_and_leaves_another_gpus_holder_alone(fleet, repo):
    h = fleet.hosts[0]
    fleet.ssh(h, fleetlib.gpu_host(2))
    write_fleet(repo, [h], {"m": gpu_svc("0")})
    text = (repo.path / f"hosts/{h.name}.toml").read_text()
    repo.write(f"hosts/{h.name}.toml", text.replace("[services.m]\n", '[services.m]\ngpu_policy = "kill"\n'))
    repo.commit()
    run_cli("--repo", str(repo.path), check_codes=(0,))
    on_mine, on_other = (fleet.ssh(h, fleetlib.stray(g)).strip() for g in ("0", "1"))
    write_fleet(repo, [h], {"m": gpu_svc("0", env={"LOG_LEVEL": "debug"})})
    text = (repo.path / f"hosts/{h.name}.toml").read_text()
    repo.write(f"hosts/{h.name}.toml", text.replace("[services.m]\n", '[services.m]\ngpu_policy = "kill"\n'))
    repo.commit("a change; strays on GPU 0 (claimed) and GPU 1 (not)")
    code, out = run_json("--repo", str(repo.path), check_codes=(0,))
    notes = out["hosts"][0]["notes"]
    assert any(f"stray pid {on_mine} (sleep) on its GPUs: " in n for n in notes), notes
    assert not any(f"pid {on_other}" in n for n in notes), notes
    assert fleet.ssh(h, f"kill -0 {on_mine} 2>/dev/null && echo alive || echo gone").strip() == "gone"
    assert fleet.ssh(h, f"kill -0 {on_other} && echo alive").strip() == "alive"
