"""End-to-end: `reconcile` asks the REAL engine installed on the host before anything is stopped
(issue 35). The test hosts see SGLang 0.5.12 and 0.5.23 and vLLM 0.33.0 read-only at
/opt/engines/<name> (tests/engines.py) and the stand-in nvidia-smi with 4 H200s; a unit runs one
of them, and the dry run with --engine-check (the revision is not signed; issue 39) and the run
show the engine's own verdict: its message quoted and
its version named when it refuses (EngineRejected, nothing written), what it resolved when it
accepts. Each probe imports the engine (10-35 s on a loaded 2-core machine)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests import engines
from tests import fleet as fleetlib
from tests.conftest import run_json, write_fleet

pytestmark = pytest.mark.fleet

MODEL = "/models/Qwen3.5-122B-A10B"
SEED = ("--tp-size 4 --speculative-algo NEXTN --speculative-num-steps 3 --speculative-eagle-topk 1 "
        "--speculative-num-draft-tokens 4")
INCIDENT = ("ValueError: Speculative decoding for Qwen3_5MoeForConditionalGeneration is not compatible with "
            "radix cache when using --mamba-scheduler-strategy no_buffer.")


def unit(python: str, entry: str) -> str:
    return ("[Unit]\nDescription=a real engine's unit\n\n[Service]\nType=simple\n"
            f"ExecStart={engines.HOST_ROOT}/{python}/bin/python -m {entry} --host {{host.address}} "
            "--port {vars.port} {vars.args}\nRestart=always\nRestartSec=1\n\n[Install]\nWantedBy=multi-user.target\n")


def deploy(fleet, repo, python: str, entry: str, args: str) -> dict:
    """A dry run of one service on the first host, with the unit and arguments given."""
    if engines.built() is None:
        pytest.fail(f"the engine environments are not built ({engines.root()}): run .ci/setup", pytrace=False)
    h = fleet.hosts[0]
    fleet.ssh(h, fleetlib.gpu_host(4))
    write_fleet(repo, [h], {"llm": {"port": 30000, "model": None, "args": args}}, extra={})
    repo.write("units/standin.service", unit(python, entry))
    repo.commit(f"{python}: {args}")
    code, out = run_json("--repo", str(repo.path), "--dry-run", "--engine-check", check_codes=(2, 4))
    assert out["engine_check"] == {"ran": True, "why": "--engine-check", "services": 1,
                                   "line": "engine check ran: --engine-check"}
    return {"code": code, **out["hosts"][0]}


def engine_notes(r: dict) -> list[str]:
    return [n for n in r["notes"] if n.startswith("llm: ") and ("engine" in n or "accepts" in n)]


@pytest.mark.timeout(300)
def test_sglang_0_5_12_refuses_the_incident_unit_in_its_own_words_and_nothing_is_written(fleet, repo):
    r = deploy(fleet, repo, "sglang-0.5.12", "sglang.launch_server", f"--model-path {MODEL} {SEED}")
    assert (r["code"], r["reason"]) == (4, "EngineRejected"), r
    assert f"llm: the installed sglang 0.5.12 refuses this command line: {INCIDENT}" in r["message"], r["message"]
    assert "sglang/srt/server_args.py:" in r["message"] and "_handle_mamba_radix_cache" in r["message"]
    # The engine answered: the shipped flag rule for the same mistake is its to judge, not repeated.
    assert "sglang-spec-hybrid-extra-buffer" not in r["message"]
    assert not fleet.exists(fleet.hosts[0], "/etc/systemd/system/llm.service")


@pytest.mark.timeout(300)
def test_sglang_0_5_23_accepts_the_seed_resolving_auto_and_refuses_the_old_fix_flag(fleet, repo):
    r = deploy(fleet, repo, "sglang-0.5.23", "sglang.launch_server", f"--model-path {MODEL} {SEED}")
    assert r["code"] == 2, r
    [note] = engine_notes(r)
    assert note.startswith("llm: sglang 0.5.23 accepts the command line, "), note
    assert "mamba strategy auto -> extra_buffer" in note and "tp 4" in note, note
    # The verdict is cached with the host's stamp: the same request again does not run the engine.
    cache = json.loads((Path(os.environ["RECONCILER_STATE_DIR"]) / "engine-verdicts.json").read_text())
    assert [e["verdict"]["verdict"] for e in cache[fleet.hosts[0].name].values()] == ["ok"]
    code, out = run_json("--repo", str(repo.path), "--dry-run", "--engine-check", check_codes=(2,))
    [again] = engine_notes(out["hosts"][0])
    assert again.startswith("llm: sglang 0.5.23 accepts the command line: "), again      # no time: cached

    r = deploy(fleet, repo, "sglang-0.5.23", "sglang.launch_server",
               f"--model-path {MODEL} {SEED} --mamba-scheduler-strategy extra_buffer")
    assert (r["code"], r["reason"]) == (4, "EngineRejected"), r
    assert ("llm: the installed sglang 0.5.23 refuses this command line: unrecognized arguments: "
            "--mamba-scheduler-strategy extra_buffer") in r["message"], r["message"]


@pytest.mark.timeout(300)
def test_vllm_refuses_tensor_parallel_3_on_32_heads(fleet, repo):
    r = deploy(fleet, repo, "vllm-0.33.0", "vllm.entrypoints.cli.main serve", f"{MODEL} --tensor-parallel-size 3")
    assert (r["code"], r["reason"]) == (4, "EngineRejected"), r
    assert "llm: the installed vllm 0.33.0 refuses this command line: " in r["message"], r["message"]
    assert "Total number of attention heads (32) must be divisible by tensor parallel size (3)" in r["message"]
