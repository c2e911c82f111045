"""End-to-end: pre-flight on real hosts (issue 5). Rules see the model's own config.json on the
host; an incomplete model is named file by file; a blocked deploy writes nothing and the old
service keeps running."""

from __future__ import annotations

import json

import pytest

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
    assert not fleet.exists(h, UNIT) and not fleet.exists(h, "/var/lib/reconciler")


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
    assert not fleet.exists(h, UNIT) and not fleet.exists(h, "/var/lib/reconciler")
    hist = json.loads(run_cli("history", h.name, "--json", check_codes=(0,)).stdout)
    assert hist[0]["action"] == "blocked" and "missing" in hist[0]["message"]


@pytest.mark.timeout(60)
def test_complete_model_and_good_flags_pass_the_gate(fleet, repo):
    h = fleet.hosts[0]
    write_fleet(repo, [h], {"sglang": svc("Qwen3-8B", args=SPEC_FLAGS)}, extra={})   # dense: no extra buffer needed
    repo.commit()
    code, out = run_json("--repo", str(repo.path), check_codes=(0,))
    assert out["hosts"][0]["status"] == "converged"


@pytest.mark.timeout(60)
def test_model_fetch_downloads_a_missing_model_before_the_start(fleet, repo):
    h = fleet.hosts[0]
    write_fleet(repo, [h], {"sglang": svc("Qwen3-8B")}, extra={})
    # point the service at a directory that does not exist yet, with a fetch command that fills it
    text = (repo.path / f"hosts/{h.name}.toml").read_text().replace(
        'path = "/models/Qwen3-8B" }',
        'path = "/tmp/model-fetched/Qwen3-8B", fetch = "sleep 1 && cp -r /models/Qwen3-8B/. .", fetch_timeout = 20 }')
    repo.write(f"hosts/{h.name}.toml", text)
    repo.commit()
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
        write_fleet(repo, [h], {"sglang": svc("Qwen3-8B")}, extra={})
        text = (repo.path / f"hosts/{h.name}.toml").read_text().replace(
            'path = "/models/Qwen3-8B" }',
            f'path = "/tmp/model-fetched/X", fetch = "{fetch}", fetch_timeout = 2 }}')
        repo.write(f"hosts/{h.name}.toml", text)
        repo.commit(fetch)
        code, out = run_json("--repo", str(repo.path), check_codes=(4,))
        assert out["hosts"][0]["reason"] == "ModelFetchFailed" and expect in out["hosts"][0]["message"]
        assert not fleet.exists(h, UNIT)
