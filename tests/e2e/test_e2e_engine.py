"""End-to-end: the engine probes (reconciler/engines/) inside a test host, with the REAL engine
packages (issue 35): SGLang 0.5.12 and 0.5.23 and vLLM 0.33.0, built by tests/engines.py and
seen by every host read-only at /opt/engines/<name>, with the model's config.json only.

Each probe is copied to the host and run over ssh as the reconciler runs it, but for systemd's
box (tests/e2e/test_e2e_engine_deploy.py runs it through the reconciler): the environment's own
interpreter, isolated (-I), GPUs hidden, no downloads, a timeout and the lowest priority, and
the facts of an SM90 host with 4 H200 GPUs. A probe takes 10-35 s (most of it importing the
engine), so each test runs its independent probes two at a time, and prints how long each took."""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests import engines
from tests import fleet as fleetlib

pytestmark = pytest.mark.fleet

MODEL = "/models/Qwen3.5-122B-A10B"
# The incident's unit (review 2026-12-02 §2): MTP on the hybrid model, strategy left to the engine.
SEED = ["--model-path", MODEL, "--tp-size", "4", "--speculative-algo", "NEXTN", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
OLD_FIX = ["--mamba-scheduler-strategy", "extra_buffer"]
INCIDENT = ("Speculative decoding for Qwen3_5MoeForConditionalGeneration is not compatible with radix cache "
            "when using --mamba-scheduler-strategy no_buffer.To use radix cache with speculative decoding, "
            "please use --mamba-scheduler-strategy extra_buffer and set SGLANG_ENABLE_SPEC_V2=1.")
PROBE_DIR = "/root/reconciler-engines"
# Probes at once: each is one cold interpreter importing torch and the engine (about 1 GB RSS,
# one core); CI runs on 2 cores.
AT_ONCE = 2


def _require_engines(fleet) -> None:
    if engines.built() is None:
        pytest.fail(f"the engine environments are not built ({engines.root()}): run .ci/setup "
                    "(python -m tests.engines build)", pytrace=False)
    missing = fleet.ssh(fleet.hosts[0], " ".join(f"test -x {engines.HOST_ROOT}/{e}/bin/python || echo {e};"
                                                 for e in engines.environments()))
    if missing.strip():
        pytest.fail(f"test host {fleet.hosts[0].name} has no {missing.split()}: the fleet was booted before "
                    "the engines were built", pytrace=False)


def _copy_probes(fleet, host: fleetlib.Host) -> None:
    for name in ("sglang_probe.py", "vllm_probe.py"):
        text = (engines.PROBES / name).read_text()
        subprocess.run([*fleetlib.ssh_base(host.address, fleet.known_hosts),
                        f"mkdir -p {PROBE_DIR} && cat > {PROBE_DIR}/{name}"], input=text, text=True, check=True,
                       timeout=30)


def run_probe(fleet, host: fleetlib.Host, python: str, probe: str, args: list[str],
              facts: dict | None = engines.H200_FACTS, label: str = "") -> dict:
    """Run `probe` on the host as the reconciler does; its verdict, plus the wall time."""
    opts = ["--facts", json.dumps(facts)] if facts is not None else []
    cmd = ("HF_HUB_OFFLINE=1 CUDA_VISIBLE_DEVICES= timeout 120 nice -n 19 "
           + shlex.join([python, "-I", f"{PROBE_DIR}/{probe}", *opts, "--", *args]) + " 2>/dev/null")
    t0 = time.monotonic()
    res = subprocess.run([*fleetlib.ssh_base(host.address, fleet.known_hosts), cmd], capture_output=True,
                         text=True, timeout=150)
    wall = time.monotonic() - t0
    last = res.stdout.rstrip("\n").rsplit("\n", 1)[-1]
    assert res.returncode == 0 and last.startswith("RECONCILER-ENGINE "), (res.returncode, res.stdout[-2000:])
    verdict = json.loads(last.removeprefix("RECONCILER-ENGINE "))
    verdict["wall"] = wall
    print(f"probe {label or probe}: {verdict['verdict']} in {wall:.1f}s wall "
          f"(import {verdict['seconds'].get('import', '-')}s, check {verdict['seconds'].get('check', '-')}s)")
    return verdict


def run_all(fleet, cases: dict[str, tuple[str, str, list[str]]], **kw) -> dict[str, dict]:
    """Several probes on the first host, AT_ONCE at a time: {label: verdict}."""
    _require_engines(fleet)
    h = fleet.hosts[0]
    _copy_probes(fleet, h)
    with ThreadPoolExecutor(AT_ONCE) as pool:
        futures = {label: pool.submit(run_probe, fleet, h, python, probe, args, label=label, **kw)
                   for label, (python, probe, args) in cases.items()}
        return {label: f.result() for label, f in futures.items()}


def env_python(name: str) -> str:
    return f"{engines.HOST_ROOT}/{name}/bin/python"


def sglang(version: str, *args: str) -> tuple[str, str, list[str]]:
    return env_python(f"sglang-{version}"), "sglang_probe.py", list(args)


@pytest.mark.timeout(300)
def test_sglang_0_5_12_refuses_the_seed_with_the_incident_error_and_takes_the_old_fix(fleet):
    out = run_all(fleet, {"0.5.12 seed": sglang("0.5.12", *SEED),
                          "0.5.12 seed + old fix": sglang("0.5.12", *SEED, *OLD_FIX)})
    seed = out["0.5.12 seed"]
    assert (seed["engine"], seed["version"], seed["verdict"], seed["stage"], seed["error"]) == \
        ("sglang", "0.5.12", "rejected", "parse", "ValueError")
    assert seed["message"] == INCIDENT
    assert seed["where"] == "sglang/srt/server_args.py:2568 ServerArgs._handle_mamba_radix_cache"

    fixed = out["0.5.12 seed + old fix"]
    assert (fixed["verdict"], fixed["stage"], fixed["error"]) == ("ok", None, None)
    assert fixed["resolved"] == {"mamba_scheduler_strategy": "extra_buffer", "attention_backend": "fa3",
                                 "page_size": 1, "context_length": 262144, "speculative_algorithm": "EAGLE",
                                 "disable_overlap_schedule": False, "tp_size": 4}


@pytest.mark.timeout(300)
def test_sglang_0_5_23_accepts_the_seed_and_refuses_the_old_fix_flag_an_unknown_flag_and_a_long_context(fleet):
    out = run_all(fleet, {"0.5.23 seed": sglang("0.5.23", *SEED),
                          "0.5.23 seed + old fix + unknown flag": sglang("0.5.23", *SEED, *OLD_FIX,
                                                                         "--bogus-flag", "1"),
                          "0.5.23 context 300000": sglang("0.5.23", "--model-path", MODEL, "--tp-size", "4",
                                                          "--context-length", "300000")})
    seed = out["0.5.23 seed"]
    assert (seed["version"], seed["verdict"], seed["error"]) == ("0.5.23", "ok", None)
    # The default strategy `auto` resolves to extra_buffer on an SM90 host; NEXTN runs as EAGLE
    # (what resolution changed comes as [asked, resolved]).
    assert seed["resolved"] == {"mamba_radix_cache_strategy": ["auto", "extra_buffer"], "attention_backend": "fa3",
                                "page_size": 1, "context_length": 262144, "speculative_algorithm": ["NEXTN", "EAGLE"],
                                "disable_overlap_schedule": False, "tp_size": 4}

    old = out["0.5.23 seed + old fix + unknown flag"]
    assert (old["verdict"], old["stage"], old["error"]) == ("rejected", "parse", "usage")
    assert old["message"] == "unrecognized arguments: --mamba-scheduler-strategy extra_buffer --bogus-flag 1"

    long = out["0.5.23 context 300000"]
    assert (long["verdict"], long["error"]) == ("rejected", "ValueError")
    assert long["message"].startswith("Warning: User-specified context_length (300000) is greater than the derived "
                                      "context_length (262144).")
    assert "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1" in long["message"]
    assert long["where"].startswith("sglang/srt/configs/model_config.py:")


@pytest.mark.timeout(300)
def test_vllm_accepts_tp4_refuses_tp3_on_32_heads_and_is_inconclusive_without_the_hosts_facts(fleet):
    vllm = env_python("vllm-0.33.0")
    out = run_all(fleet, {"vllm tp 4": (vllm, "vllm_probe.py", [MODEL, "--tensor-parallel-size", "4"]),
                          "vllm tp 3": (vllm, "vllm_probe.py", [MODEL, "--tensor-parallel-size", "3"])})
    ok = out["vllm tp 4"]
    assert (ok["engine"], ok["version"], ok["verdict"]) == ("vllm", "0.33.0", "ok")
    assert ok["resolved"] == {"max_model_len": 262144, "tensor_parallel_size": 4, "speculative_method": None,
                              "mamba_cache_mode": "align", "architecture": "Qwen3_5MoeForConditionalGeneration"}

    tp3 = out["vllm tp 3"]
    assert (tp3["verdict"], tp3["stage"], tp3["error"]) == ("rejected", "config", "ValidationError")
    assert tp3["message"] == "Total number of attention heads (32) must be divisible by tensor parallel size (3)."

    # Without the host's facts, with the GPUs hidden, vLLM cannot tell what it runs on: the probe's
    # environment is wrong, not the unit.
    blind = run_all(fleet, {"vllm tp 4, no facts": (vllm, "vllm_probe.py", [MODEL, "-tp", "4"])}, facts=None)
    blind = blind["vllm tp 4, no facts"]
    assert (blind["verdict"], blind["stage"], blind["error"]) == ("inconclusive", "parse", "RuntimeError")
    assert blind["message"].startswith("Failed to infer device type")


@pytest.mark.timeout(120)
def test_a_python_without_the_engine_or_with_a_module_missing_is_inconclusive(fleet):
    # /usr/bin/python3 has only the project's stand-in `sglang` package (no sglang.srt); a venv
    # with sglang 0.5.23 but without the shared base (torch, transformers, ...) misses modules.
    broken = "/tmp/engine-broken"
    fleet.ssh(fleet.hosts[0], f"python3 -m venv --without-pip {broken} && echo "
                              f"{engines.HOST_ROOT}/sglang-0.5.23/lib/python3.11/site-packages "
                              f"> {broken}/lib/python3.11/site-packages/only-sglang.pth")
    out = run_all(fleet, {"system python": ("/usr/bin/python3", "sglang_probe.py", SEED),
                          "sglang without its base": (f"{broken}/bin/python", "sglang_probe.py", SEED),
                          "system python, vllm": ("/usr/bin/python3", "vllm_probe.py", [MODEL])})
    none = out["system python"]
    assert (none["version"], none["verdict"], none["stage"], none["error"], none["message"]) == \
        (None, "inconclusive", "import", "ModuleNotFoundError", "No module named 'sglang.srt'")
    partial = out["sglang without its base"]
    assert (partial["version"], partial["verdict"], partial["stage"], partial["error"]) == \
        ("0.5.23", "inconclusive", "import", "ModuleNotFoundError")
    assert partial["message"].startswith("No module named ")
    novllm = out["system python, vllm"]
    assert (novllm["version"], novllm["verdict"], novllm["stage"], novllm["error"], novllm["message"]) == \
        (None, "inconclusive", "import", "ModuleNotFoundError", "No module named 'vllm'")
