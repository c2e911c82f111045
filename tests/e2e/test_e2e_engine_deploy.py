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
import subprocess
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
    return unit_at(f"{engines.HOST_ROOT}/{python}/bin/python", entry)


def unit_at(interpreter: str, entry: str) -> str:
    return ("[Unit]\nDescription=a real engine's unit\n\n[Service]\nType=simple\n"
            f"ExecStart={interpreter} -m {entry} --host {{host.address}} "
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


# An SGLang shaped like a release older than any the probe was written against: the launcher's
# calls are there, but no runtime_context.override_platform and no hardware probes imported into
# server_args, so the host's GPU facts have nowhere to go.
OLD_RELEASE = {
    "sglang-0.5.11.dist-info/METADATA": "Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.11\n",
    "sglang/__init__.py": "__version__ = \"0.5.11\"\n",
    "sglang/srt/__init__.py": "",
    "sglang/srt/server_args.py": """import argparse


class ServerArgs:
    def __init__(self, ns):
        self.__dict__.update(vars(ns))

    @staticmethod
    def add_cli_args(parser):
        for flag in ("--model-path", "--host", "--device", "--speculative-algorithm"):
            parser.add_argument(flag)
        for flag in ("--port", "--tp-size", "--speculative-num-steps", "--speculative-eagle-topk",
                     "--speculative-num-draft-tokens"):
            parser.add_argument(flag, type=int)

    def check_server_args(self):
        pass


def prepare_server_args(argv):
    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    return ServerArgs(parser.parse_args(argv))
""",
}


def install_old_release(fleet, host) -> str:
    """A venv at /opt/sglang-old on the host with OLD_RELEASE as its sglang; its python."""
    site = "/opt/sglang-old/lib/python3.11/site-packages"
    fleet.ssh(host, f"python3 -m venv --without-pip /opt/sglang-old && mkdir -p {site}/sglang/srt "
                    f"{site}/sglang-0.5.11.dist-info")
    for rel, text in OLD_RELEASE.items():
        subprocess.run([*fleetlib.ssh_base(host.address, fleet.known_hosts), f"cat > {site}/{rel}"], input=text,
                       text=True, check=True, timeout=30)
    return "/opt/sglang-old/bin/python"


@pytest.mark.timeout(300)
def test_a_release_without_its_platform_hook_is_inconclusive_naming_it_and_the_rules_decide(fleet, repo):
    h = fleet.hosts[0]
    fleet.ssh(h, fleetlib.gpu_host(4))
    python = install_old_release(fleet, h)
    write_fleet(repo, [h], {"llm": {"port": 30000, "model": None, "args": f"--model-path {MODEL} {SEED}"}}, extra={})
    repo.write("units/standin.service", unit_at(python, "sglang.launch_server"))
    repo.commit("the seed on an SGLang older than the probe's hooks")
    code, out = run_json("--repo", str(repo.path), "--dry-run", "--engine-check", check_codes=(4,))
    r = out["hosts"][0]
    [note] = [n for n in r["notes"] if n.startswith("llm: engine check inconclusive")]
    assert note == ("llm: engine check inconclusive (sglang 0.5.11): sglang 0.5.11 has no platform hook: no "
                    "sglang.srt.runtime_context.override_platform, and none of the hardware probes "
                    "sglang.srt.server_args imports (is_cuda, get_device_sm) to answer; its own checks need the "
                    "host's GPUs, which the probe hides; the static rules decide"), note
    # the engine did not answer, so the shipped rule for the incident decides, and blocks it
    assert r["reason"] == "PreflightFailed", r
    assert "sglang-spec-hybrid-extra-buffer" in r["message"], r["message"]
    assert not fleet.exists(h, "/etc/systemd/system/llm.service")

    # its argument stage still speaks: a flag it does not know is refused in its words
    write_fleet(repo, [h], {"llm": {"port": 30000, "model": None, "args": f"--model-path {MODEL} --bogus 1"}},
                extra={})
    repo.write("units/standin.service", unit_at(python, "sglang.launch_server"))
    repo.commit("an unknown flag on the same release")
    code, out = run_json("--repo", str(repo.path), "--dry-run", "--engine-check", check_codes=(4,))
    r = out["hosts"][0]
    assert (r["reason"], r["message"].split(". Nothing")[0]) == \
        ("EngineRejected", "llm: the installed sglang 0.5.11 refuses this command line: unrecognized arguments: "
                           "--bogus 1"), r


@pytest.mark.timeout(600)
def test_an_engine_upgrade_is_a_new_interpreter_path_checked_by_the_new_engine_before_anything_stops(fleet, repo):
    """The incident's unit, fixed as SGLang 0.5.12's error said, upgraded to 0.5.23 (a venv side
    by side): the dry run shows what 0.5.23 says of its flags and variables; after the fix it is
    accepted; a revert (the rollback) brings back the old path, which 0.5.12 accepts."""
    h = fleet.hosts[0]
    fleet.ssh(h, fleetlib.gpu_host(4))
    fixed = f"--model-path {MODEL} {SEED} --mamba-scheduler-strategy extra_buffer"
    write_fleet(repo, [h], {"llm": {"port": 30000, "model": None, "args": fixed,
                                    "env": {"SGLANG_ENABLE_SPEC_V2": "1"}}}, extra={})

    def dry_run(python: str, message: str) -> dict:
        repo.write("units/standin.service", unit(python, "sglang.launch_server"))
        repo.commit(message)
        code, out = run_json("--repo", str(repo.path), "--dry-run", "--engine-check", check_codes=(2, 4))
        return {"code": code, **out["hosts"][0]}

    before = dry_run("sglang-0.5.12", "llm on SGLang 0.5.12, fixed as its error said")
    assert before["code"] == 2, before
    [note] = engine_notes(before)
    assert note.startswith("llm: sglang 0.5.12 accepts the command line, "), note
    assert "mamba strategy extra_buffer" in note and "warns" not in note, note

    upgraded = dry_run("sglang-0.5.23", "llm: SGLang 0.5.23 (a new venv)")
    assert (upgraded["code"], upgraded["reason"]) == (4, "EngineRejected"), upgraded
    assert upgraded["message"].startswith(
        "llm: the installed sglang 0.5.23 refuses this command line: unrecognized arguments: "
        "--mamba-scheduler-strategy extra_buffer. Nothing was stopped."), upgraded["message"]
    assert upgraded["message"].endswith(
        "; sglang 0.5.23 warns: SGLANG_ENABLE_SPEC_V2 is set, but sglang 0.5.23 does not know it (not in its "
        "environment registry, not named in its code): it has no effect there"), upgraded["message"]
    assert not fleet.exists(h, "/etc/systemd/system/llm.service")

    write_fleet(repo, [h], {"llm": {"port": 30000, "model": None, "args": f"--model-path {MODEL} {SEED}"}}, extra={})
    after = dry_run("sglang-0.5.23", "llm on 0.5.23: the flag and the variable it no longer knows removed")
    assert after["code"] == 2, after
    [note] = engine_notes(after)
    assert note.startswith("llm: sglang 0.5.23 accepts the command line, "), note
    assert "mamba strategy auto -> extra_buffer" in note and "warns" not in note, note

    # the rollback: the previous revision's interpreter path, checked by the old engine again
    subprocess.run(["git", "-C", str(repo.path), "revert", "--no-edit", "HEAD", "HEAD~1"], check=True,
                   capture_output=True, timeout=30)
    code, out = run_json("--repo", str(repo.path), "--dry-run", "--engine-check", check_codes=(2,))
    [note] = engine_notes(out["hosts"][0])
    assert note.startswith("llm: sglang 0.5.12 accepts the command line"), note
