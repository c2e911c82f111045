"""Pre-flight: command-line parsing, model knowledge, the rule pack and its evaluator (pure), and
the model-presence check run for real through a local shell against tests/models/."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest

from reconciler import preflight as pf
from reconciler.desired.spec import CallSpec, DrainSpec, HostSpec, ModelSpec, ServiceSpec, SSHSpec
from reconciler.errors import ConfigError, ObserveError
from reconciler.host.transport import LocalTransport

MODELS = Path(__file__).resolve().parents[1] / "models"
INCIDENT_PHRASE = "needs --mamba-scheduler-strategy extra_buffer and SGLANG_ENABLE_SPEC_V2=1"
# The flags the operator added in the incident (shared/context/incident.md).
INCIDENT_FLAGS = ("--speculative-algo NEXTN --speculative-num-steps 3 --speculative-eagle-topk 1 "
                  "--speculative-num-draft-tokens 4")


def config(name: str) -> dict:
    return json.loads((MODELS / name / "config.json").read_text())


def unit(exec_start: str, *extra: str) -> str:
    lines = "\n".join(extra)
    return (f"[Unit]\nDescription=test\n\n[Service]\nType=simple\n{lines}\n"
            f"ExecStart={exec_start}\nRestart=always\n\n[Install]\nWantedBy=multi-user.target\n")


def sglang(flags: str = "", *, name: str = "sglang-qwen", env: dict[str, str] | None = None,
           model_id: str = "Qwen/Qwen3.5-122B-A10B", path: str = "/models/Qwen3.5-122B-A10B",
           architecture: str | None = None, extra: tuple[str, ...] = ()) -> ServiceSpec:
    cmd = f"/usr/bin/python3 -m sglang.launch_server --model-path {path} {flags}".strip()
    return ServiceSpec(name=name, unit_text=unit(cmd, *extra), env=env or {},
                       model=ModelSpec(id=model_id, path=path, architecture=architecture))


# A drain declared (a balancer takes the host out first), so that vLLM's default stop, which
# aborts what is in flight, is no finding here; tests/preflight/test_drain_rules.py has those.
DRAINED = DrainSpec(leave=CallSpec("host", "true"), rejoin=CallSpec("host", "true"))


def vllm(flags: str = "", *, name: str = "vllm-qwen", env: dict[str, str] | None = None,
         model_id: str = "Qwen/Qwen3-8B", path: str = "/models/Qwen3-8B") -> ServiceSpec:
    return ServiceSpec(name=name, unit_text=unit(f"/usr/local/bin/vllm serve {path} {flags}".strip()),
                       env=env or {}, model=ModelSpec(id=model_id, path=path), drain=DRAINED)


RULES = pf.load_rules()


def ids(findings: list[pf.Finding]) -> list[str]:
    return sorted(f.rule_id for f in findings)


class Snap:
    """A revision held in memory: just read() and list(), what load_rules needs."""

    def __init__(self, files: dict[str, str]):
        self.files = {k: v.encode() for k, v in files.items()}

    def read(self, path: str) -> bytes | None:
        return self.files.get(path)

    def list(self, directory: str) -> list[str]:
        prefix = directory.rstrip("/") + "/"
        return sorted(p[len(prefix):] for p in self.files if p.startswith(prefix) and "/" not in p[len(prefix):])


# ---- parse_command ----------------------------------------------------------------------------


def test_parse_the_shipped_units_rendered():
    root = Path(__file__).resolve().parents[2] / "desired-state/units"
    values = {"{model.path}": "/models/M", "{model.id}": "Org/M", "{host.address}": "127.0.0.2",
              "{vars.port}": "30000", "{vars.tp}": "4", "{service.name}": "s"}
    for unit, server, tp_flag in (("sglang.service", "sglang", "--tp"), ("vllm.service", "vllm", "-tp")):
        text = (root / unit).read_text()
        for k, v in values.items():
            text = text.replace(k, v)
        cmd = pf.parse_command(ServiceSpec(name="s", unit_text=text))
        assert cmd.server == server and cmd.model == "/models/M"
        assert (cmd.host, cmd.port, cmd.value(tp_flag)) == ("127.0.0.2", 30000, "4")


def test_parse_prefixes_continuations_forms_and_aliases():
    text = unit("-/usr/bin/python3 -u -m sglang.launch_server \\\n"
                "    --model-path=/models/Qwen3.5-122B-A10B --tp 4 \\\n"
                "# a comment inside the continuation is skipped, as systemd does\n"
                "    --speculative-algo NEXTN --trust-remote-code --cuda-graph-bs 1 2 4 \\\n"
                "    --mem-fraction-static 0.85 --enable-metrics")
    cmd = pf.parse_command(ServiceSpec(name="s", unit_text=text))
    assert cmd.server == "sglang"
    assert cmd.flags["--model-path"] == "/models/Qwen3.5-122B-A10B"      # --flag=value
    assert cmd.flags["--tp-size"] == "4"                                 # --tp is an alias
    assert cmd.value("--tensor-parallel-size") == "4"                    # so is this one
    assert cmd.flags["--speculative-algorithm"] == "NEXTN"
    assert cmd.flags["--trust-remote-code"] is None                      # boolean
    assert cmd.flags["--cuda-graph-bs"] == "1 2 4"                       # several values
    assert cmd.flags["--enable-metrics"] is None                         # last, boolean
    assert cmd.has("--speculative-algorithm") and not cmd.has("--dp-size")


def test_parse_last_execstart_wins_and_empty_resets():
    text = ("[Service]\nExecStart=/usr/bin/python3 -m sglang.launch_server --model-path /a\n"
            "ExecStart=\nExecStart=/usr/bin/python3 -m sglang.launch_server --model-path /b\n")
    assert pf.parse_command(ServiceSpec(name="s", unit_text=text)).model == "/b"
    reset = "[Service]\nExecStart=/usr/bin/python3 -m sglang.launch_server --model-path /a\nExecStart=\n"
    cmd = pf.parse_command(ServiceSpec(name="s", unit_text=reset))
    assert cmd.server is None and cmd.error


def test_parse_execstart_outside_service_section_is_ignored():
    text = "[Unit]\nExecStart=/usr/bin/vllm serve /x\n[Service]\nExecStart=/bin/sleep infinity\n"
    assert pf.parse_command(ServiceSpec(name="s", unit_text=text)).server is None


def test_parse_at_prefix_skips_argv0():
    text = unit("@/usr/bin/python3 sglang-server -m sglang.launch_server --model-path /m --port 31000")
    cmd = pf.parse_command(ServiceSpec(name="s", unit_text=text))
    assert cmd.server == "sglang" and cmd.port == 31000


def test_parse_env_merge_order_and_expansion():
    text = unit("/usr/bin/env SGLANG_ENABLE_SPEC_V2=1 /usr/bin/python3 -m sglang.launch_server "
                "--model-path ${MODEL} --tp-size $TP",
                'Environment="CUDA_VISIBLE_DEVICES=0,1" TP=2 MODEL=/models/x',
                "Environment=LOG=debug")
    svc = ServiceSpec(name="s", unit_text=text, env={"TP": "4", "EXTRA": "y"})
    cmd = pf.parse_command(svc)
    # unit Environment= < the service's env (the drop-in) < `env VAR=` on the command line
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "0,1", "TP": "4", "MODEL": "/models/x",
                       "LOG": "debug", "EXTRA": "y", "SGLANG_ENABLE_SPEC_V2": "1"}
    assert cmd.value("--tp-size") == "4" and cmd.model == "/models/x"
    assert cmd.visible_devices == ["0", "1"]


def test_a_command_is_parsed_once_per_unit_text_and_env():
    # the pre-flight of a start reads a service's command four times: one parse serves them
    text = unit("/usr/bin/python3 -m sglang.launch_server --model-path /models/x --tp-size $TP")
    first = pf.parse_command(ServiceSpec(name="a", unit_text=text, env={"TP": "2"}))
    assert pf.parse_command(ServiceSpec(name="b", unit_text=text, env={"TP": "2"})) is first
    other = pf.parse_command(ServiceSpec(name="a", unit_text=text, env={"TP": "4"}))
    assert other is not first and other.value("--tp-size") == "4" and first.value("--tp-size") == "2"
    changed = pf.parse_command(ServiceSpec(name="a", unit_text=text.replace("/models/x", "/models/y"), env={"TP": "2"}))
    assert changed.model == "/models/y" and first.model == "/models/x"


def test_parse_shell_wrapper():
    text = unit("/bin/bash -c 'SGLANG_ENABLE_SPEC_V2=1 exec python3 -m sglang.launch_server "
                "--model-path /m --speculative-algorithm EAGLE'")
    cmd = pf.parse_command(ServiceSpec(name="s", unit_text=text))
    assert cmd.server == "sglang"
    assert cmd.env["SGLANG_ENABLE_SPEC_V2"] == "1"
    assert cmd.value("--speculative-algo") == "EAGLE"


@pytest.mark.parametrize("exec_start, server, model", [
    ("/usr/local/bin/vllm serve Qwen/Qwen3-8B -tp 2 --port=8001", "vllm", "Qwen/Qwen3-8B"),
    ("/usr/bin/python3 -m vllm.entrypoints.openai.api_server --model /m --tensor_parallel_size 2",
     "vllm", "/m"),
    ("/opt/venv/bin/sglang serve --model-path /m --tp 2", "sglang", "/m"),
    ("/usr/local/bin/sglang-standin --model-path /models/Qwen3-8B", None, None),   # not a server we know
    ("/usr/bin/numactl --cpunodebind=0 /usr/bin/python3 -m sglang.launch_server --model-path /m",
     "sglang", "/m"),
    ("/bin/bash -lc 'exec vllm serve /m -tp 2'", "vllm", "/m"),
    ("/usr/bin/python3 -X dev -W ignore -m vllm.entrypoints.openai.api_server --model /m -tp 2",
     "vllm", "/m"),
    ("/usr/bin/python3 /opt/sglang/python/sglang/launch_server.py --model-path /m", "sglang", "/m"),
    ("/usr/bin/python3 /opt/tool.py -m sglang.launch_server", None, None),
    ("/bin/sleep infinity", None, None),
    ("/usr/bin/python3 -m http.server", None, None),
])
def test_parse_detects_the_server(exec_start: str, server: str | None, model: str | None):
    cmd = pf.parse_command(ServiceSpec(name="s", unit_text=unit(exec_start)))
    assert cmd.server == server
    assert cmd.model == model
    if server == "vllm":
        assert cmd.value("--tensor-parallel-size") == "2"


def test_vllm_defaults_bind_everything_on_8000():
    cmd = pf.parse_command(vllm())
    assert (cmd.host, cmd.port) == ("0.0.0.0", 8000)
    cmd = pf.parse_command(sglang())
    assert (cmd.host, cmd.port) == ("127.0.0.1", 30000)


def test_world_size():
    def world(svc: ServiceSpec) -> int | None:
        return pf.parse_command(svc).world_size()
    assert world(sglang("--tp 2 --dp 2")) == 4                      # replicas: dp x tp GPUs
    assert world(sglang("--tp 4 --dp 2 --enable-dp-attention")) == 4   # dp inside tp
    assert world(sglang("--tp 2 --pp-size 2")) == 4
    assert world(vllm("-tp 2 --pipeline-parallel-size 2 --data-parallel-size 2")) == 8
    assert world(sglang("--tp ${TP}")) is None                      # unknown, not guessed


# ---- model knowledge --------------------------------------------------------------------------


def test_hybrid_from_config_layer_types_top_level_or_text_config():
    svc = sglang(model_id="acme/mystery")
    info = pf.model_info(svc, config("Qwen3.5-122B-A10B"), RULES.models)
    assert "hybrid" in info.traits
    assert "text_config.layer_types has 36 of 48 linear_attention" in info.why["hybrid"]
    info = pf.model_info(svc, config("Hybrid-Unknown"), RULES.models)   # unknown architecture
    assert "hybrid" in info.traits and info.architectures == ("AcmeHybridForCausalLM",)
    assert "hybrid" not in pf.model_info(svc, config("Qwen3-8B"), RULES.models).traits


@pytest.mark.parametrize("cfg", [
    {"architectures": ["X"], "layers_block_type": ["mamba", "attention", "mamba"]},     # Jamba
    {"architectures": ["X"], "hybrid_override_pattern": "M-M-M*-M"},                    # Nemotron-H
    {"architectures": ["Qwen3NextForCausalLM"]},                                        # the table
])
def test_hybrid_from_config_other_layer_lists(cfg: dict):
    assert "hybrid" in pf.model_info(sglang(model_id="acme/mystery"), cfg, RULES.models).traits


def test_config_decides_over_the_model_id():
    # A dense config under a Qwen3.5-looking id: the real config.json wins.
    info = pf.model_info(sglang(), config("Qwen3-8B"), RULES.models)
    assert "hybrid" not in info.traits


@pytest.mark.parametrize("model_id, architecture, hybrid", [
    ("Qwen/Qwen3.5-122B-A10B", None, True),
    ("Qwen/Qwen3.5-397B-A17B", None, True),
    ("nvidia/Qwen3.5-397B-A17B-NVFP4", None, True),
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", None, True),
    ("ai21labs/AI21-Jamba-Mini-1.7", None, True),
    ("acme/private-model", "Qwen3NextForCausalLM", True),      # declared architecture
    ("acme/private-model", "Qwen3_5MoeForConditionalGeneration", True),
    ("Qwen/Qwen3-8B", None, False),
    ("acme/private-model", None, False),
])
def test_hybrid_without_config_from_the_table(model_id: str, architecture: str | None, hybrid: bool):
    info = pf.model_info(sglang(model_id=model_id, architecture=architecture), None, RULES.models)
    assert ("hybrid" in info.traits) == hybrid


# ---- the incident rule ------------------------------------------------------------------------


def test_incident_flags_rejected_by_validate_from_the_model_id():
    svc = sglang(f"--tp 4 {INCIDENT_FLAGS}")
    findings = pf.check_service(svc, rules=RULES, model_config=None, gpu_count=None)
    assert ids(findings) == ["sglang-spec-hybrid-extra-buffer"]
    f = findings[0]
    assert f.blocking and f.service == "sglang-qwen"
    assert INCIDENT_PHRASE in f.message
    assert "--mamba-scheduler-strategy extra_buffer (not given)" in f.message
    assert "SGLANG_ENABLE_SPEC_V2=1 (not set)" in f.message
    line = str(f)
    assert line.startswith("sglang-qwen: sglang-spec-hybrid-extra-buffer: speculative decoding (NEXTN) on "
                           "Qwen/Qwen3.5-122B-A10B")
    assert ". Fix: add `--mamba-scheduler-strategy extra_buffer` to ExecStart and SGLANG_ENABLE_SPEC_V2" in line
    assert line.endswith("(source: https://github.com/sgl-project/sglang/pull/22908)")


def test_incident_flags_rejected_by_dry_run_from_a_hybrid_config_under_an_unknown_id():
    svc = sglang(INCIDENT_FLAGS, model_id="acme/mystery-1", path="/models/Hybrid-Unknown")
    assert pf.check_service(svc, rules=RULES, model_config=None, gpu_count=None) == []   # validate: unknown
    findings = pf.check_service(svc, rules=RULES, model_config=config("Hybrid-Unknown"), gpu_count=None)
    assert ids(findings) == ["sglang-spec-hybrid-extra-buffer"]
    assert INCIDENT_PHRASE in findings[0].message
    assert "config.json layer_types has 18 of 24 linear_attention layers" in findings[0].message


def test_incident_fixed_passes_and_half_fixed_names_what_is_missing():
    fixed = sglang(f"{INCIDENT_FLAGS} --mamba-scheduler-strategy extra_buffer",
                   env={"SGLANG_ENABLE_SPEC_V2": "1"})
    assert pf.check_service(fixed, rules=RULES, model_config=None, gpu_count=None) == []
    flag_only = sglang(f"{INCIDENT_FLAGS} --mamba-scheduler-strategy extra_buffer")
    [f] = pf.check_service(flag_only, rules=RULES, model_config=None, gpu_count=None)
    assert "missing: SGLANG_ENABLE_SPEC_V2=1 (not set))" in f.message
    wrong = sglang(f"{INCIDENT_FLAGS} --mamba-scheduler-strategy no_buffer",
                   env={"SGLANG_ENABLE_SPEC_V2": "0"})
    [f] = pf.check_service(wrong, rules=RULES, model_config=None, gpu_count=None)
    assert "--mamba-scheduler-strategy extra_buffer (given: no_buffer)" in f.message
    assert "SGLANG_ENABLE_SPEC_V2=1 (set to another value)" in f.message
    assert "=0" not in f.message                                     # env values never shown


def test_incident_env_from_the_unit_counts_too():
    svc = sglang(f"{INCIDENT_FLAGS} --mamba-scheduler-strategy extra_buffer",
                 extra=("Environment=SGLANG_ENABLE_SPEC_V2=true",))
    assert pf.check_service(svc, rules=RULES, model_config=None, gpu_count=None) == []


def test_incident_rule_does_not_apply_without_radix_cache_dense_models_or_vllm():
    no_radix = sglang(f"{INCIDENT_FLAGS} --disable-radix-cache")
    dense = sglang(INCIDENT_FLAGS, model_id="Qwen/Qwen3-8B", path="/models/Qwen3-8B")
    no_spec = sglang("--tp 4")
    for svc in (no_radix, dense, no_spec):
        assert pf.check_service(svc, rules=RULES, model_config=None, gpu_count=None) == [], svc.unit_text
    assert pf.check_service(dense, rules=RULES, model_config=config("Qwen3-8B"), gpu_count=None) == []
    v = vllm("--speculative-algorithm NEXTN", model_id="Qwen/Qwen3.5-122B-A10B")
    assert "sglang-spec-hybrid-extra-buffer" not in ids(pf.check_service(v, rules=RULES, model_config=None,
                                                                          gpu_count=None))


def test_spec_v2_topk_rule():
    hybrid = sglang("--speculative-algorithm EAGLE --speculative-eagle-topk 4 "
                    "--mamba-scheduler-strategy extra_buffer", env={"SGLANG_ENABLE_SPEC_V2": "1"})
    [f] = pf.check_service(hybrid, rules=RULES, model_config=None, gpu_count=None)
    assert (f.rule_id, f.severity) == ("sglang-spec-v2-hybrid-topk", "error")
    assert "--speculative-eagle-topk 4" in f.message
    dense = sglang("--speculative-algorithm EAGLE --speculative-eagle-topk 4",
                   model_id="Qwen/Qwen3-8B", env={"SGLANG_ENABLE_SPEC_V2": "1"})
    [f] = pf.check_service(dense, rules=RULES, model_config=None, gpu_count=None)
    assert (f.rule_id, f.severity, f.blocking) == ("sglang-spec-v2-topk", "warning", False)
    ok = sglang("--speculative-algorithm EAGLE --speculative-eagle-topk 1",
                model_id="Qwen/Qwen3-8B", env={"SGLANG_ENABLE_SPEC_V2": "1"})
    assert pf.check_service(ok, rules=RULES, model_config=None, gpu_count=None) == []


def test_vllm_auto_tool_choice_needs_a_parser():
    bad = vllm("--enable-auto-tool-choice")
    [f] = pf.check_service(bad, rules=RULES, model_config=None, gpu_count=None)
    assert f.rule_id == "vllm-auto-tool-choice-needs-parser" and "--tool-call-parser" in f.message
    good = vllm("--enable-auto-tool-choice --tool-call-parser hermes")
    assert pf.check_service(good, rules=RULES, model_config=None, gpu_count=None) == []


# ---- built-in checks --------------------------------------------------------------------------


@pytest.mark.parametrize("svc, gpu_count, fails", [
    (sglang("--tp 4", env={"CUDA_VISIBLE_DEVICES": "0,1"}), None, True),
    (sglang("--tp 2", env={"CUDA_VISIBLE_DEVICES": "0,1"}), None, False),
    (sglang("--tp 4", env={"CUDA_VISIBLE_DEVICES": "0,1"}), 8, True),     # CVD is what it may use
    (sglang("--tp 4"), None, False),                                       # unknown: skipped
    (sglang("--tp 4"), 4, False),
    (sglang("--tp 8"), 4, True),
    (sglang("--tp 2 --dp 2"), 4, False),
    (sglang("--tp 2 --dp 4"), 4, True),                                    # 8 GPUs
    (sglang("--tp 4 --dp 4 --enable-dp-attention"), 4, False),
    (sglang("--tp 2 --base-gpu-id 2"), 4, False),                          # GPUs 2,3
    (sglang("--tp 2 --base-gpu-id 3"), 4, True),                           # GPU position 4
    (vllm("-tp 2 -pp 2"), 2, True),
    (vllm("-tp 2"), 2, False),
    (sglang("--tp ${TP}"), 1, False),                                      # not a number: skipped
    (sglang("--tp 2", env={"CUDA_VISIBLE_DEVICES": "0,-1,1"}), None, True),  # CUDA stops at -1
])
def test_parallel_size_vs_gpus(svc: ServiceSpec, gpu_count: int | None, fails: bool):
    findings = pf.check_service(svc, rules=RULES, model_config=None, gpu_count=gpu_count)
    assert ("tp-exceeds-gpus" in ids(findings)) == fails


def test_parallel_size_message():
    svc = sglang("--tp 4", env={"CUDA_VISIBLE_DEVICES": "0,1"})
    [f] = pf.check_service(svc, rules=RULES, model_config=None, gpu_count=None)
    assert f.message == "--tp-size 4 needs 4 GPUs, but CUDA_VISIBLE_DEVICES lists 2"
    assert f.source.startswith("https://github.com/sgl-project/sglang/")


def test_sglang_dp_attention_needs_tp_multiple_of_dp():
    [f] = pf.check_service(sglang("--tp 4 --dp 3 --enable-dp-attention"), rules=RULES,
                           model_config=None, gpu_count=None)
    assert f.rule_id == "sglang-dp-attention-tp-divisible" and "e.g. 2" in f.fix
    assert pf.check_service(sglang("--tp 4 --dp 2 --enable-dp-attention"), rules=RULES,
                            model_config=None, gpu_count=None) == []


def test_vllm_tp_must_divide_attention_heads():
    cfg = config("Qwen3-8B")                                # 32 attention heads
    [f] = pf.check_service(vllm("-tp 3"), rules=RULES, model_config=cfg, gpu_count=None)
    assert f.rule_id == "vllm-tp-divides-attention-heads"
    assert "does not divide the model's 32 attention heads" in f.message and "e.g. 2" in f.fix
    assert pf.check_service(vllm("-tp 4"), rules=RULES, model_config=cfg, gpu_count=None) == []
    assert pf.check_service(vllm("-tp 3"), rules=RULES, model_config=None, gpu_count=None) == []
    # heads of a multimodal wrapper come from text_config (vLLM's hf_text_config)
    q35 = config("Qwen3.5-122B-A10B")                       # text_config: 32 heads
    assert pf.check_service(vllm("-tp 4"), rules=RULES, model_config=q35, gpu_count=None) == []


@pytest.mark.parametrize("quant_method, flag, fails", [
    ("fp8", "--quantization awq", True),
    ("compressed-tensors", "--quantization awq_marlin", True),
    ("fp8", "--quantization gguf", True),
    ("fp8", "--quantization fp8", False),
    ("gptq", "--quantization gptq_marlin", False),
    ("awq", "--quantization awq_marlin", False),
    ("modelopt", "--quantization modelopt_fp4", False),
    ("compressed-tensors", "--quantization w8a8_fp8", False),
    (None, "--quantization fp8", False),                     # online quantization of a bf16 model
    ("fp8", "", False),
])
def test_quantization_vs_checkpoint(quant_method: str | None, flag: str, fails: bool):
    cfg = dict(config("Qwen3-8B"))
    if quant_method:
        cfg["quantization_config"] = {"quant_method": quant_method}
    for svc in (sglang(flag, model_id="acme/x"), vllm(flag.replace("--quantization", "-q"))):
        findings = pf.check_service(svc, rules=RULES, model_config=cfg, gpu_count=None)
        assert ("quantization-mismatch" in ids(findings)) == fails, (svc.name, quant_method, flag)


def test_services_that_are_not_model_servers_are_not_checked():
    svc = ServiceSpec(name="sidecar", unit_text=unit("/bin/sleep infinity"))
    assert pf.check_service(svc, rules=RULES, model_config=None, gpu_count=0) == []


# ---- across the services of one host ----------------------------------------------------------


def host(*services: ServiceSpec) -> HostSpec:
    return HostSpec(name="gpu-01", ssh=SSHSpec(address="127.0.0.1"),
                    services={s.name: s for s in services})


def test_two_services_on_all_gpus_overlap_and_both_are_blocked():
    a = sglang("--port 30000", name="a", model_id="Qwen/Qwen3-8B")
    b = sglang("--port 30001", name="b", model_id="Qwen/Qwen3-8B")
    findings = pf.check_host(host(a, b), rules=RULES, model_configs={}, gpu_count=None)
    assert [(f.rule_id, f.service) for f in findings] == [("gpu-overlap", "a"), ("gpu-overlap", "b")]
    assert "service b claims every GPU (CUDA_VISIBLE_DEVICES unset)" in findings[0].message


@pytest.mark.parametrize("env_a, env_b, flags_a, flags_b, shared", [
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}, "", "", None),
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "1,2"}, "", "", "GPU 1"),
    ({}, {"CUDA_VISIBLE_DEVICES": "3"}, "", "", "GPU 3"),          # unset means all GPUs
    ({}, {}, "--tp 2 --base-gpu-id 0", "--tp 2 --base-gpu-id 2", None),   # SGLang's own placement
    ({}, {}, "--tp 2", "--tp 2 --base-gpu-id 2", "GPU 2,3"),       # implicit: all GPUs
    ({}, {}, "--tp 2 --base-gpu-id 0", "--tp 2 --base-gpu-id 1", "GPU 1"),
    ({"CUDA_VISIBLE_DEVICES": ""}, {}, "", "", None),              # no GPU at all
])
def test_gpu_claims(env_a, env_b, flags_a, flags_b, shared):
    a = sglang(f"--port 1 {flags_a}", name="a", env=env_a, model_id="Qwen/Qwen3-8B")
    b = sglang(f"--port 2 {flags_b}", name="b", env=env_b, model_id="Qwen/Qwen3-8B")
    findings = [f for f in pf.check_host(host(a, b), rules=RULES, model_configs={}, gpu_count=4)
                if f.rule_id == "gpu-overlap"]
    if shared is None:
        assert findings == []
    else:
        assert len(findings) == 2 and f"both would use {shared}" in findings[0].message


@pytest.mark.parametrize("flags_a, flags_b, conflict", [
    ("", "", True),                                                 # both 127.0.0.1:30000
    ("--port 30001", "", False),
    ("--host 127.0.0.2", "--host 127.0.0.3", False),                # the test fleet's way
    ("--host 0.0.0.0", "--host 127.0.0.1", True),                   # a wildcard covers all
])
def test_port_conflicts(flags_a: str, flags_b: str, conflict: bool):
    a = sglang(flags_a, name="a", model_id="Qwen/Qwen3-8B", env={"CUDA_VISIBLE_DEVICES": "0"})
    b = sglang(flags_b, name="b", model_id="Qwen/Qwen3-8B", env={"CUDA_VISIBLE_DEVICES": "1"})
    findings = pf.check_host(host(a, b), rules=RULES, model_configs={}, gpu_count=None)
    assert ids(findings) == (["port-conflict", "port-conflict"] if conflict else [])
    if conflict:
        assert "'Address already in use'" in findings[0].message


def test_vllm_default_port_collides_with_an_sglang_on_8000():
    a = vllm(name="a", env={"CUDA_VISIBLE_DEVICES": "0"})                       # 0.0.0.0:8000
    b = sglang("--port 8000", name="b", model_id="Qwen/Qwen3-8B", env={"CUDA_VISIBLE_DEVICES": "1"})
    assert ids(pf.check_host(host(a, b), rules=RULES, model_configs={}, gpu_count=None)) == [
        "port-conflict", "port-conflict"]


def test_check_host_uses_each_models_config_by_path():
    a = sglang(f"{INCIDENT_FLAGS} --port 1", name="a", model_id="acme/a", path="/models/Hybrid-Unknown",
               env={"CUDA_VISIBLE_DEVICES": "0"})
    b = sglang(f"{INCIDENT_FLAGS} --port 2", name="b", model_id="acme/b", path="/models/Qwen3-8B",
               env={"CUDA_VISIBLE_DEVICES": "1"})
    configs = {"/models/Hybrid-Unknown": config("Hybrid-Unknown"), "/models/Qwen3-8B": config("Qwen3-8B")}
    findings = pf.check_host(host(a, b), rules=RULES, model_configs=configs, gpu_count=2)
    assert [(f.rule_id, f.service) for f in findings] == [("sglang-spec-hybrid-extra-buffer", "a")]


# ---- rule files -------------------------------------------------------------------------------


def test_shipped_rules_load_with_sources():
    assert {"sglang-spec-hybrid-extra-buffer", "sglang-spec-v2-hybrid-topk", "sglang-spec-v2-topk",
            "vllm-auto-tool-choice-needs-parser"} <= {r.id for r in RULES.rules}
    assert set(pf.BUILTIN_RULES) <= set(RULES.ids)
    for r in RULES.rules:
        assert r.source.startswith("https://"), r.id
    for b in pf.BUILTIN_RULES.values():
        assert all(u.startswith("https://") for u in b.sources.values()), b.id


REPO_RULE = """
[[rule]]
id = "site-trust-remote-code"
server = "any"
when = { model = ["custom-code"] }
require = { flags = { "--trust-remote-code" = true } }
message = "{model} ships custom code; it needs --trust-remote-code (missing: {missing})"
fix = "add --trust-remote-code"
source = "https://huggingface.co/docs/transformers/custom_models"

[[model]]
ids = ["acme/*"]
traits = ["custom-code", "hybrid"]
"""


def test_repo_rules_and_model_knowledge_extend_the_pack():
    rules = pf.load_rules(Snap({"rules/site.toml": REPO_RULE, "rules/README.md": "not a rule file"}))
    svc = sglang(INCIDENT_FLAGS, model_id="acme/private-hybrid")
    findings = pf.check_service(svc, rules=rules, model_config=None, gpu_count=None)
    assert ids(findings) == ["sglang-spec-hybrid-extra-buffer", "site-trust-remote-code"]
    site = next(f for f in findings if f.rule_id == "site-trust-remote-code")
    assert site.message == ("acme/private-hybrid ships custom code; it needs --trust-remote-code "
                            "(missing: --trust-remote-code (not given))")
    assert rules.origin["site-trust-remote-code"] == "rules/site.toml"


def test_a_rule_file_too_big_or_nested_too_deep_is_a_problem_of_that_file_and_not_read():
    """The limits of every desired-state TOML file (desired/toml_files.py) hold for rules/ too:
    a parse bomb pushed to the repo is refused by name, never parsed into a crash."""
    from reconciler.desired.toml_files import MAX_DEPTH, MAX_FILE_BYTES
    big = "# " + "x" * MAX_FILE_BYTES + "\n"
    bomb = "x = " + "[" * 50_000 + "]" * 50_000 + "\n"
    deep = "x = " + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1) + "\n"
    with pytest.raises(ConfigError) as e:
        pf.load_rules(Snap({"rules/big.toml": big, "rules/bomb.toml": bomb, "rules/deep.toml": deep,
                            "rules/site.toml": REPO_RULE}))
    nested = f"tables or arrays nested more than {MAX_DEPTH} deep: not a rule file; it was not read"
    assert [(p.file, p.key, p.message) for p in e.value.problems] == [
        ("rules/big.toml", "", f"the file is {MAX_FILE_BYTES + 3:,} bytes: a rule file may be at most "
                               f"{MAX_FILE_BYTES:,} bytes (1 MiB); it was not read"),
        ("rules/bomb.toml", "", nested),
        ("rules/deep.toml", "", nested)]


def test_repo_rule_replaces_a_shipped_rule_and_disable_turns_rules_off():
    override = """
disable = ["gpu-overlap", "vllm-auto-tool-choice-needs-parser"]

[[rule]]
id = "sglang-spec-hybrid-extra-buffer"
server = "sglang"
severity = "warning"
when = { flag_any = ["--speculative-algorithm"], model = ["hybrid"] }
require = { flags = { "--mamba-scheduler-strategy" = "extra_buffer" } }
message = "site policy: {missing}"
fix = "add the flag"
source = "https://example.invalid/our-runbook"
"""
    rules = pf.load_rules(Snap({"rules/override.toml": override}))
    [f] = pf.check_service(sglang(INCIDENT_FLAGS), rules=rules, model_config=None, gpu_count=None)
    assert (f.rule_id, f.severity) == ("sglang-spec-hybrid-extra-buffer", "warning")
    a, b = sglang(name="a", model_id="Qwen/Qwen3-8B", flags="--port 1"), sglang(
        name="b", model_id="Qwen/Qwen3-8B", flags="--port 2")
    assert pf.check_host(host(a, b), rules=rules, model_configs={}, gpu_count=None) == []
    assert pf.check_service(vllm("--enable-auto-tool-choice"), rules=rules, model_config=None,
                            gpu_count=None) == []


def problems(files: dict[str, str]) -> list[str]:
    with pytest.raises(ConfigError) as e:
        pf.load_rules(Snap(files))
    return [str(p) for p in e.value.problems]


def test_bad_rule_files_name_file_and_key():
    bad = """
[[rule]]
id = "my-rule"
server = "sglang"
when = { flagz = ["--tp"] }
require = { flags = { "tp-size" = 2 } }
message = "x {modle}"
fix = "y"
source = "not a url"

[[rule]]
server = "sglang"
message = "m"
fix = "f"
source = "https://x.invalid"

[[model]]
ids = ["x/*"]
traits = []
"""
    found = problems({"rules/bad.toml": bad, "rules/syntax.toml": "[[rule]\nid = 1\n"})
    text = "\n".join(found)
    assert ("rules/bad.toml: rule[my-rule].when.flagz: unknown key (did you mean 'flags'? allowed: "
            "flag_any, flag_none, flags, flags_not, env_any, env, env_not, model, architecture, "
            "model_type, model_id)") in found
    assert ("rules/bad.toml: rule[my-rule].require.flags.tp-size: expected a flag such as '--tp-size', "
            "got 'tp-size'") in found
    assert any(p.startswith("rules/bad.toml: rule[my-rule].message: unknown placeholder {modle}") for p in found)
    assert any(p.startswith("rules/bad.toml: rule[my-rule].source: expected the URL") for p in found)
    assert "rules/bad.toml: rule[#2].id: required key missing" in found
    assert any(p.startswith("rules/bad.toml: model[#1].traits:") for p in found)
    assert any(p.startswith("rules/syntax.toml: invalid TOML") for p in found), text


def test_duplicate_builtin_and_unknown_ids():
    rule = """
[[rule]]
id = "{id}"
server = "vllm"
message = "m"
fix = "f"
source = "https://x.invalid"
"""
    found = problems({
        "rules/a.toml": rule.replace("{id}", "dup"),
        "rules/b.toml": rule.replace("{id}", "dup"),
        "rules/c.toml": rule.replace("{id}", "port-conflict"),
        "rules/d.toml": 'disable = ["gpu-overlapp"]\n',
    })
    assert "rules/b.toml: rule[dup].id: duplicate rule id (also in rules/a.toml)" in found
    assert any(p.startswith("rules/c.toml: rule[port-conflict].id: this id belongs to a built-in rule")
               for p in found)
    assert "rules/d.toml: disable: unknown rule id 'gpu-overlapp' (did you mean 'gpu-overlap'?)" in found


def test_rule_without_require_fires_whenever_when_holds():
    text = """
[[rule]]
id = "no-eager"
server = "vllm"
severity = "warning"
when = { flag_any = ["--enforce-eager"] }
message = "--enforce-eager disables CUDA graphs"
fix = "drop --enforce-eager"
source = "https://docs.vllm.ai/en/latest/"
"""
    rules = pf.load_rules(Snap({"rules/perf.toml": text}))
    [f] = pf.check_service(vllm("--enforce-eager"), rules=rules, model_config=None, gpu_count=None)
    assert (f.rule_id, f.blocking) == ("no-eager", False)
    assert pf.check_service(vllm(), rules=rules, model_config=None, gpu_count=None) == []


# ---- model presence ---------------------------------------------------------------------------


def run_check(paths: list[str], spaces: tuple[str, ...] = ()) -> dict[str, pf.ModelFacts]:
    from reconciler.host import programs
    return asyncio.run(programs.run(LocalTransport(), pf.ModelCheck(paths, spaces), what="model check"))


def test_model_check_on_the_fixture_models():
    paths = [str(MODELS / n) for n in ("Qwen3-8B", "Broken-MissingShard", "Qwen3.5-122B-A10B",
                                       "Hybrid-Unknown")] + ["/nonexistent/model dir"]
    facts = run_check(paths, (paths[0], paths[4]))
    assert list(facts) == paths
    good = facts[paths[0]]
    assert good.exists and good.complete and good.problems() == []
    assert good.config == config("Qwen3-8B")
    assert set(good.files) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert good.total_size is not None and good.free_bytes and good.free_bytes > 0
    broken = facts[paths[1]]
    assert broken.missing == ["model-00003-of-00003.safetensors"]
    assert broken.empty == ["model-00002-of-00003.safetensors"]
    assert broken.problems() == ["model-00003-of-00003.safetensors missing",
                                 "model-00002-of-00003.safetensors is empty (0 bytes)"]
    assert facts[paths[2]].complete and "hybrid" in pf.model_info(
        sglang(model_id="acme/x"), facts[paths[3]].config, RULES.models).traits
    gone = facts[paths[4]]
    assert not gone.exists and gone.problems() == ["model directory /nonexistent/model dir missing"]
    assert gone.free_bytes is not None                  # of the nearest existing parent (/)
    assert broken.free_bytes is None                    # not asked: no fetch would fill it


def test_model_check_edge_cases(tmp_path: Path):
    # A Hugging Face cache snapshot: weights are symlinks into blobs/.
    snap = tmp_path / "hf" / "snapshots" / "abc"
    blobs = tmp_path / "hf" / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    shutil.copy(MODELS / "Qwen3-8B" / "config.json", snap / "config.json")
    shutil.copy(MODELS / "Qwen3-8B" / "model.safetensors.index.json", snap / "model.safetensors.index.json")
    (blobs / "b1").write_bytes(b"x" * 120)
    os.symlink(blobs / "b1", snap / "model-00001-of-00002.safetensors")
    os.symlink(blobs / "missing-blob", snap / "model-00002-of-00002.safetensors")   # dangling
    # A single-file checkpoint without an index, and a directory with bad JSON and no weights.
    single = tmp_path / "single"
    single.mkdir()
    (single / "config.json").write_text("{}")
    (single / "model.safetensors").write_bytes(b"y" * 10)
    bad = tmp_path / "bad dir"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    empty_cfg = tmp_path / "empty-config"
    empty_cfg.mkdir()
    (empty_cfg / "config.json").write_text("")
    (empty_cfg / "model.safetensors").write_bytes(b"")
    facts = run_check([str(snap), str(single), str(bad), str(empty_cfg)])
    assert facts[str(snap)].problems() == ["model-00002-of-00002.safetensors missing"]
    assert facts[str(snap)].files["model-00001-of-00002.safetensors"] == 120
    assert facts[str(single)].complete
    assert facts[str(bad)].problems() == [
        "model weights (no model.safetensors.index.json, no *.safetensors) missing",
        "config.json is invalid JSON"]
    assert facts[str(empty_cfg)].problems() == ["config.json is invalid JSON",
                                                "model.safetensors is empty (0 bytes)"]


def test_model_check_reads_any_weight_file_name(tmp_path: Path):
    """One stat sizes every weight file; names with spaces, newlines, UTF-8 or a leading '@',
    dangling links and a directory named like a weight file come back right, in glob order."""
    d = tmp_path / "odd model"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text("{}")
    for name, size in [("a b.safetensors", 5), ("new\nline.safetensors", 3), ("caf\u00e9.safetensors", 0),
                       ("sub/x.safetensors", 7), ("-dash.bin", 9), ("@at.gguf", 11)]:
        (d / name).write_bytes(b"x" * size)
    os.symlink(tmp_path / "gone", d / "dangling.safetensors")
    (d / "dir.safetensors").mkdir()
    plain = tmp_path / "plain"                       # no newline in a name: the one stat answers
    plain.mkdir()
    (plain / "model.safetensors").write_bytes(b"y" * 4)
    (plain / "x y.gguf").write_bytes(b"y" * 2)
    os.symlink(tmp_path / "gone", plain / "model-2.bin")
    facts = run_check([str(d), str(plain)])
    odd = facts[str(d)]
    dir_size = os.stat(d / "dir.safetensors").st_size
    assert list(odd.files.items()) == [
        ("a b.safetensors", 5), ("caf\u00e9.safetensors", 0), ("dangling.safetensors", None),
        ("dir.safetensors", dir_size), ("new\nline.safetensors", 3), ("sub/x.safetensors", 7),
        ("-dash.bin", 9), ("@at.gguf", 11)]
    assert odd.problems() == ["dangling.safetensors missing", "caf\u00e9.safetensors is empty (0 bytes)"]
    assert list(facts[str(plain)].files.items()) == [("model.safetensors", 4), ("model-2.bin", None), ("x y.gguf", 2)]


def test_parse_model_check_is_framed_and_complete_or_refused():
    import base64

    def b(s: str) -> str:
        return base64.b64encode(s.encode()).decode()

    cfg = json.dumps({"architectures": ["X"]})
    index = json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})
    out = "\n".join([
        "noise from a login script",
        f"T P {b('/m')}", "T D 1",
        f"T F config.json P {cfg}", "T F config.json E",
        f"T F model.safetensors.index.json L {index}", "T F model.safetensors.index.json E",
        f"T S 5 {b('s1.safetensors')}", "T S - @s2.safetensors", "T S 3 @@x.bin", "T A 1000",
        "other-token P xxx",
        "T END",
    ])
    [m] = pf.parse_model_check(out, "T").values()
    assert m.config == {"architectures": ["X"]} and m.missing == ["s2.safetensors"]
    assert m.files == {"s1.safetensors": 5, "s2.safetensors": None, "@x.bin": 3}   # '@': as it is
    assert m.free_bytes == 1000 * 1024
    with pytest.raises(ObserveError):
        pf.parse_model_check(out.replace("T END", ""), "T")
    with pytest.raises(ObserveError):
        pf.parse_model_check("T P !!notbase64\nT END\n", "T")
    with pytest.raises(ObserveError):                  # a file line that is none
        pf.parse_model_check(f"T P {b('/m')}\nT D 1\nT F config.json X y\nT END\n", "T")


def test_dry_run_path_model_facts_feed_the_rules():
    """The dry-run flow: read the model on the host, then check the service with its config."""
    path = str(MODELS / "Hybrid-Unknown")
    facts = run_check([path])[path]
    svc = sglang(INCIDENT_FLAGS, model_id="acme/never-heard-of-it", path=path)
    findings = pf.check_service(svc, rules=RULES, model_config=facts.config, gpu_count=None)
    assert ids(findings) == ["sglang-spec-hybrid-extra-buffer"]
    assert INCIDENT_PHRASE in str(findings[0])


# ---- the server version on the host (versions.py) --------------------------------------------


def _python_that_marks(tmp_path: Path, name: str = "python3") -> str:
    """An "interpreter" that leaves a marker when anything runs it: the version read must not."""
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True, exist_ok=True)
    py = bindir / name
    py.write_text(f"#!/bin/sh\ntouch {tmp_path / 'ran'}\n")
    py.chmod(0o755)
    return str(py)


def _dist(d: Path, module: str, version: str) -> None:
    info = d / f"{module}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: {version}\n\n"
                                   f"Version: 9.9.9 (the long description, not the header)\n")


def test_versions_are_read_from_the_files_in_import_order_and_nothing_is_run(tmp_path: Path):
    """Review 2026-12-03 N2: the version read ran the unit's interpreter as root with its
    PYTHONPATH. It reads files now: the first directory in the interpreter's import order that
    holds the package's dist-info (its Version:) or the package (its __version__ line)."""
    from reconciler.host import programs
    from reconciler.plan.facts.versions import VersionRead as Probe
    from reconciler.plan.facts.versions import Versions
    py = _python_that_marks(tmp_path)
    venv = tmp_path / "venv"
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = false\n")
    own = venv / "lib" / "python3.11" / "site-packages"
    own.mkdir(parents=True)
    _dist(own, "sglang", "0.5.12")
    pp1, pp2, src = tmp_path / "pp1", tmp_path / "pp2", tmp_path / "src"
    (pp2 / "sglang").mkdir(parents=True)
    (pp2 / "sglang" / "__init__.py").write_text('"""docs"""\n__version__ = "0.5.14"\n')
    pp1.mkdir()
    (src / "vllm").mkdir(parents=True)
    (own / "__editable__.vllm.pth").write_text(f"import os\n{src}\n")
    _dist(src, "vllm", "0.33.0")
    odd = tmp_path / "odd"
    for mod, v in {"p1": "' 1.0+cu121.post1 '", "p2": "'v1.2'", "p3": "'0.5\\n0.6'", "p4": "'1.0 beta'"}.items():
        (odd / mod).mkdir(parents=True)
        (odd / mod / "__init__.py").write_text(f"__version__ = {v}\n")
    bindir = venv / "bin"
    (bindir / "vllm").write_text(f"#!  {py} -s\nprint(1)\n")
    (bindir / "vllm").chmod(0o755)
    (tmp_path / "wrapper").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "wrapper").chmod(0o755)
    probes = [Probe("venv", py, "sglang"),
              Probe("pythonpath-first", py, "sglang", f"{pp1}:relative:{pp2}:/no such dir"),
              Probe("editable", py, "vllm"),
              Probe("shebang", str(bindir / "vllm"), "vllm"),
              *(Probe(f"odd-{m}", py, m, str(odd)) for m in ("p1", "p2", "p3", "p4")),
              Probe("wrapper", str(tmp_path / "wrapper"), "sglang"),
              Probe("missing", "/no/such/python3", "sglang"),
              Probe("not-there", py, "nothing")]
    got = asyncio.run(programs.run(LocalTransport(), Versions(probes), timeout=120, what="versions"))
    assert got == {
        "venv": "0.5.12", "pythonpath-first": "0.5.14", "editable": "0.33.0", "shebang": "0.33.0",
        "odd-p1": "1.0+cu121.post1", "odd-p2": None, "odd-p3": None, "odd-p4": None,
        "wrapper": None, "missing": None, "not-there": None}
    assert not (tmp_path / "ran").exists()               # no interpreter was started


def test_a_venv_with_the_system_site_reads_the_users_dir_first_and_without_it_only_its_own(tmp_path: Path):
    """A venv without the system's site packages sees only its own; with them, the user's site
    directory (the unit's user's home: none here, root's) comes before its own, as site.py
    orders them; `-s` (user_site off) leaves the user's out."""
    from reconciler.host import programs
    from reconciler.plan.facts.versions import VersionRead as Probe
    from reconciler.plan.facts.versions import Versions
    py = _python_that_marks(tmp_path)
    venv = tmp_path / "venv"
    own = venv / "lib" / "python3.11" / "site-packages"
    own.mkdir(parents=True)
    _dist(own, "reconciler_probe_test_pkg", "1.0")
    user_site = Path("/root/.local/lib/python3.11/site-packages")
    if list(user_site.glob("reconciler_probe_test_pkg*")):
        pytest.fail(f"{user_site} holds this test's package already")

    def read(system: bool, user_site_on: bool = True) -> str | None:
        (venv / "pyvenv.cfg").write_text(f"include-system-site-packages = {'true' if system else 'false'}\n")
        read = Versions([Probe("s", py, "reconciler_probe_test_pkg", user_site=user_site_on)])
        return asyncio.run(programs.run(LocalTransport(), read, timeout=60, what="versions"))["s"]
    made = [p for p in (user_site, *user_site.parents) if not p.exists()]
    user_site.mkdir(parents=True, exist_ok=True)
    try:
        _dist(user_site, "reconciler_probe_test_pkg", "2.0")
        assert (read(system=False), read(system=True), read(system=True, user_site_on=False)) == ("1.0", "2.0", "1.0")
    finally:
        shutil.rmtree(user_site / "reconciler_probe_test_pkg-2.0.dist-info")
        for p in made:
            p.rmdir()
    assert not (tmp_path / "ran").exists()


def test_parse_versions_payloads():
    from reconciler.plan.facts.versions import parse_versions
    out = "\n".join(["T V a @0.5.12", "T V b -", "T V c @", "T V d @!!", "T V e 0.5.13", "U V g @1", "T V h @1 x"])
    assert parse_versions(out, "T") == {"a": "0.5.12", "b": None, "c": None, "d": None, "e": None}


@pytest.mark.parametrize(("env", "fires"), [({}, False), ({"A": ""}, False), ({"A": "1"}, True), ({"B": "1"}, True),
                                            ({"A": "1", "B": "1"}, True), ({"C": "1"}, False)])
def test_env_any_holds_when_any_one_of_its_variables_is_set(env: dict[str, str], fires: bool) -> None:
    """`env_any`, like `flag_any`: one of the variables set and not empty is enough (it used to
    need every one of them)."""
    text = """
[[rule]]
id = "either-var"
server = "vllm"
severity = "warning"
when = { env_any = ["A", "B"] }
message = "m"
fix = "f"
source = "https://docs.vllm.ai/en/latest/"
"""
    rules = pf.load_rules(Snap({"rules/env.toml": text}))
    found = pf.check_service(vllm(env=env), rules=rules, model_config=None, gpu_count=None)
    assert [f.rule_id for f in found] == (["either-var"] if fires else [])
