"""Pre-flight on what the repo declares: `reconcile validate` rejects the incident's flags."""

from __future__ import annotations

from tests.conftest import DesiredRepo, run_cli, write_fleet
from tests.fleet import Host

HOST_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
SPEC = "--speculative-algo NEXTN --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
H = Host("g1", "127.0.0.2", 0)


def test_validate_rejects_incident_flags_from_the_model_id(tmp_path, monkeypatch):
    monkeypatch.setattr("tests.fleet.host_public_key", lambda: HOST_KEY)
    r = DesiredRepo(tmp_path / "r")
    write_fleet(r, [H], {"sglang": {"port": 30000, "model": "Qwen3.5-122B-A10B", "args": SPEC}}, extra={})
    r.commit("incident flags")
    res = run_cli("validate", "--repo", str(r.path), check_codes=(1,))
    assert "hosts/g1.toml: services.sglang: sglang-spec-hybrid-extra-buffer" in res.stderr
    assert "needs --mamba-scheduler-strategy extra_buffer and SGLANG_ENABLE_SPEC_V2=1" in res.stderr
    assert "Fix:" in res.stderr

    write_fleet(r, [H], {"sglang": {"port": 30000, "model": "Qwen3.5-122B-A10B",
                                    "args": SPEC + " --mamba-scheduler-strategy extra_buffer",
                                    "env": {"SGLANG_ENABLE_SPEC_V2": "1"}}}, extra={})
    r.commit("fixed")
    res = run_cli("validate", "--repo", str(r.path), check_codes=(0,))
    assert "valid (1 hosts, 1 services)" in res.stdout


def test_validate_accepts_speculative_decoding_on_a_dense_model(tmp_path, monkeypatch):
    monkeypatch.setattr("tests.fleet.host_public_key", lambda: HOST_KEY)
    r = DesiredRepo(tmp_path / "r")
    write_fleet(r, [H], {"sglang": {"port": 30000, "model": "Qwen3-8B", "args": SPEC}}, extra={})
    r.commit()
    run_cli("validate", "--repo", str(r.path), check_codes=(0,))
