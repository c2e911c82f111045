"""Pre-flight rules on the model's shape per rank (pure): attention and KV heads vs tensor
parallelism (SGLang, vLLM), MoE experts per rank, FP8 weight blocks per rank; and the rule-pack
entries that follow SGLang releases (an env var no longer read, the renamed mamba flag)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from reconciler import preflight as pf
from tests.preflight.test_preflight import RULES, config, ids, sglang, vllm

QWEN35 = config("Qwen3.5-122B-A10B")      # text_config: 32 heads, 2 KV heads, 256 experts x 1024
QWEN3 = config("Qwen3-8B")                 # 32 heads, 8 KV heads, intermediate 12288


def dense(heads: int = 32, kv: int | None = 8, inter: int = 12288, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
                           "num_attention_heads": heads, "intermediate_size": inter, **extra}
    if kv is not None:
        cfg["num_key_value_heads"] = kv
    return cfg


def fp8(cfg: dict[str, Any], block: list[int] | None = None) -> dict[str, Any]:
    out = copy.deepcopy(cfg)
    out["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": block or [128, 128]}
    return out


def moe(experts: int = 128, size: int = 768, **extra: Any) -> dict[str, Any]:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
            "num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": experts,
            "moe_intermediate_size": size, "intermediate_size": 6144, **extra}


def run(svc, cfg, **kw) -> list[pf.Finding]:
    return pf.check_service(svc, rules=RULES, model_config=cfg, gpu_count=None, **kw)


def only(findings: list[pf.Finding], rule: str) -> list[pf.Finding]:
    return [f for f in findings if f.rule_id == rule]


# ---- attention and KV heads vs tensor parallelism --------------------------------------------

@pytest.mark.parametrize("flags, cfg, fails", [
    ("--tp 3", QWEN3, "does not divide the model's 32 attention heads"),     # SGLang's own check passes it
    ("--tp 4", QWEN3, None),
    ("--tp 8", QWEN3, None),                                   # 8 KV heads: one per rank
    ("--tp 16", QWEN3, None),                                  # 8 KV heads replicated twice
    ("--tp 16", dense(heads=48, kv=12), "12 KV heads cannot be replicated evenly over 16 ranks"),
    ("--tp 8", dense(heads=48, kv=12), "12 KV heads cannot be split evenly over 8 ranks"),
    ("--tp 6", dense(heads=48, kv=12), None),
    ("--tp 3", dense(heads=48, kv=None), None),                # no num_key_value_heads: MHA, 48 of them
    ("--tp 3", QWEN35, "does not divide the model's 32 attention heads"),    # from text_config
    ("--tp 8 --dp 2 --enable-dp-attention", QWEN3, None),      # 4 attention ranks
    ("--tp 6 --dp 2 --enable-dp-attention", QWEN3, "does not divide"),       # 3 attention ranks
    ("--tp 3 --attn-cp-size 3", QWEN3, None),                  # context parallelism: not modelled, quiet
    ("--tp 3", None, None),                                    # no config.json (validate): quiet
    ("--tp ${TP}", QWEN3, None),                               # not a number: quiet
])
def test_sglang_heads_and_kv_heads_divide_over_attention_tp(flags, cfg, fails):
    found = only(run(sglang(flags), cfg), "sglang-tp-divides-attention-heads")
    if fails is None:
        assert found == []
        return
    [f] = found
    assert fails in f.message and f.severity == "error"
    assert "SGLang accepts the flags, then fails while building the model" in f.message
    assert f.source.startswith("https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/models/qwen3.py")


def test_sglang_heads_fix_names_a_size_that_fits():
    [f] = only(run(sglang("--tp 3"), QWEN3), "sglang-tp-divides-attention-heads")
    assert "e.g. --tp-size 2" in f.fix
    [f] = only(run(sglang("--tp 16"), dense(heads=48, kv=12)), "sglang-tp-divides-attention-heads")
    assert "e.g. --tp-size 12" in f.fix
    [f] = only(run(sglang("--tp 6 --dp 2 --enable-dp-attention"), QWEN3), "sglang-tp-divides-attention-heads")
    assert f.message.startswith("--tp-size 6 with --dp-size 2 (--enable-dp-attention: 3 attention ranks)")
    assert "e.g. --tp-size 4 with the same --dp-size" in f.fix


def test_vllm_kv_heads_checked_after_the_heads():
    [f] = only(run(vllm("-tp 8"), dense(heads=48, kv=12)), "vllm-tp-divides-attention-heads")
    assert "12 KV heads cannot be split evenly over 8 ranks" in f.message and "e.g. 6" in f.fix
    assert run(vllm("-tp 6"), dense(heads=48, kv=12)) == []
    assert only(run(vllm("-tp 4"), dense(heads=48, kv=12)), "vllm-tp-divides-attention-heads") == []
    # the SGLang rule stays off vLLM and the other way round
    assert ids(run(sglang("--tp 3"), QWEN3)) == ["sglang-tp-divides-attention-heads"]
    assert ids(run(vllm("-tp 3"), QWEN3)) == ["vllm-tp-divides-attention-heads"]


# ---- MoE experts per rank --------------------------------------------------------------------

@pytest.mark.parametrize("svc, cfg, fails", [
    (sglang("--tp 8"), QWEN35, None),                          # 1024 / 8 = 128
    (sglang("--tp 3 --disable-radix-cache"), moe(size=768, num_attention_heads=48, num_key_value_heads=3),
     None),                                                    # 768 / 3 = 256: even
    (sglang("--tp 16"), moe(size=1000), "expert intermediate size 1000 does not split over 16 MoE"),
    (sglang("--tp 16 --ep-size 2"), moe(size=1000), None),     # moe_tp 8: 125
    (sglang("--tp 8 --ep-size 3"), moe(experts=128), None),    # tp not a multiple of ep: not modelled
    (sglang("--tp 8 --ep-size 8"), moe(experts=100), "--ep-size 8 does not divide the model's 100 routed"),
    (sglang("--tp 8 --ep 4"), moe(experts=128), None),
    (vllm("-tp 4 -dp 4"), moe(size=1000), "does not split over 16 MoE"),      # vLLM: tp x dp
    (vllm("-tp 4 -dp 4 --enable-expert-parallel"), moe(size=1000), None),  # experts whole per rank
    (vllm("-tp 4"), dense(), None),                            # dense: no experts
    (sglang("--tp 16"), None, None),                           # no config.json
])
def test_moe_experts_per_rank(svc, cfg, fails):
    found = only(run(svc, cfg), "moe-experts-per-rank")
    if fails is None:
        assert found == []
    else:
        [f] = found
        assert fails in f.message and f.severity == "error"


def test_moe_shape_families():
    from reconciler.preflight._shapes import moe_shape
    assert moe_shape({"n_routed_experts": 256, "moe_intermediate_size": 2048}) == (256, 2048)   # DeepSeek
    assert moe_shape({"num_local_experts": 8, "intermediate_size": 14336}) == (8, 14336)     # Mixtral
    assert moe_shape(QWEN35["text_config"]) == (256, 1024)
    assert moe_shape(QWEN3) is None and moe_shape({"num_experts": 1, "moe_intermediate_size": 8}) is None


# ---- FP8 weight blocks per rank --------------------------------------------------------------

@pytest.mark.parametrize("svc, cfg, fails", [
    # DeepSeek-V3-like: 2048 per expert; tp 16 -> 128 per rank (fine), tp 32 -> 64 (not a block)
    (sglang("--tp 16"), fp8({"n_routed_experts": 256, "moe_intermediate_size": 2048,
                             "num_attention_heads": 128, "intermediate_size": 18432,
                             "first_k_dense_replace": 3}), None),
    (sglang("--tp 32"), fp8({"n_routed_experts": 256, "moe_intermediate_size": 2048,
                             "num_attention_heads": 128}), "gets 64 of an expert's intermediate size"),
    (sglang("--tp 32 --ep-size 4"), fp8({"n_routed_experts": 256, "moe_intermediate_size": 2048,
                                         "num_attention_heads": 128}), None),     # moe_tp 8: 256
    (sglang("--tp 32 --moe-runner-backend flashinfer_trtllm"),
     fp8({"n_routed_experts": 256, "moe_intermediate_size": 2048, "num_attention_heads": 128}), None),  # pads
    (vllm("-tp 4 -dp 8"), fp8(moe(size=2048)), "gets 64 of an expert's"),     # vLLM: tp x dp = 32
    (vllm("-tp 2"), fp8(moe(size=768)), None),                 # 384 per rank: 3 blocks
    # dense MLP: Qwen3-8B FP8 with 12288: tp 8 -> 1536 (12 blocks), tp 32 -> 384 (3 blocks)
    (sglang("--tp 8"), fp8(QWEN3), None),
    (vllm("-tp 16"), fp8(dense(heads=64, kv=16, inter=12288 * 2)), None),
    (vllm("-tp 4"), fp8(dense(inter=11008)), "11008 over 4 tensor-parallel ranks is 2752 per rank"),
    (vllm("-tp 4"), fp8(dense(inter=11008), [64, 64]), None),  # 2752 = 43 x 64
    (vllm("-tp 4 --quantization awq"), fp8(dense(inter=11008)), None),       # another method asked
    (vllm("-tp 4"), dense(inter=11008), None),                 # not quantized
    (sglang("--tp 4 --dp 2 --enable-dp-attention"), fp8(dense(inter=11008)), None),  # dense under DP attention: quiet
])
def test_fp8_block_partition(svc, cfg, fails):
    found = only(run(svc, cfg), "fp8-block-partition")
    if fails is None:
        assert found == []
    else:
        [f] = found
        assert fails in f.message and f.severity == "error"
        assert "is not divisible by weight quantization block_" in f.message


def test_fp8_moe_block_k_counts_only_when_split():
    # 192 per rank with block [128, 128]: block_n fails even on one rank (merged gate/up)
    [f] = only(run(vllm("-tp 4"), fp8(moe(size=768))), "fp8-block-partition") or [None]
    assert f is not None and "gets 192" in f.message and "block_n = 128" in f.message
    # block [64, 128] with 64 per rank on one MoE-TP rank: block_n fits, block_k is not checked
    assert only(run(sglang("--tp 1"), fp8(moe(size=64), [64, 128])), "fp8-block-partition") == []
    [f] = only(run(sglang("--tp 2"), fp8(moe(size=128), [64, 128])), "fp8-block-partition")
    assert "block_k = 128" in f.message


def test_fp8_moe_block_on_blackwell_is_a_warning_for_sglang():
    cfg = fp8({"n_routed_experts": 256, "moe_intermediate_size": 2048, "num_attention_heads": 128})
    hw = pf.Hardware(gpus=tuple(pf.GpuState(i, 184_000, 0, compute_capability=(10, 0)) for i in range(32)))
    [f] = only(run(sglang("--tp 32"), cfg, hardware=hw), "fp8-block-partition")
    assert f.severity == "warning" and "flashinfer_trtllm" in f.message
    [f] = only(run(vllm("-tp 32"), cfg, hardware=hw), "fp8-block-partition")
    assert f.severity == "error"


# ---- the rule pack's entries that follow SGLang releases --------------------------------------

@pytest.mark.parametrize("version, env, fires", [
    ("0.5.13", {"SGLANG_ENABLE_SPEC_V2": "1"}, False),      # still read
    ("0.5.14", {"SGLANG_ENABLE_SPEC_V2": "1"}, True),       # gone
    ("0.5.23", {"SGLANG_ENABLE_SPEC_V2": "1"}, True),
    ("0.5.23", {}, False),
    (None, {"SGLANG_ENABLE_SPEC_V2": "1"}, False),          # unknown version: it may be read
])
def test_env_var_no_longer_read(version, env, fires):
    svc = sglang("--tp 4", env=env)
    found = [f for f in pf.check_service(svc, rules=RULES, model_config=QWEN3, gpu_count=None, version=version)
             if f.rule_id == "sglang-env-spec-v2-removed"]
    assert bool(found) == fires
    if fires:
        assert found[0].severity == "warning" and "0.5.14 and later no longer read it" in found[0].message
        assert "SGLANG_ENABLE_SPEC_V2 = " not in found[0].message


SPEC = "--speculative-algo NEXTN --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"


@pytest.mark.parametrize("version, flag, rule, new_name", [
    ("0.5.13", "--mamba-scheduler-strategy extra_buffer_lazy", "sglang-spec-lazy-buffer", False),
    ("0.5.15", "--mamba-scheduler-strategy extra_buffer_lazy", "sglang-spec-lazy-buffer-old-name", True),
    ("0.5.15", "--mamba-radix-cache-strategy extra_buffer_lazy", "sglang-spec-lazy-radix-buffer", True),
    ("0.5.20", "--mamba-scheduler-strategy extra_buffer", "sglang-mamba-scheduler-strategy-removed", True),
    ("0.5.17", "--mamba-scheduler-strategy extra_buffer", "sglang-mamba-scheduler-strategy-renamed", True),
])
def test_mamba_fix_names_the_flag_of_the_release(version, flag, rule, new_name):
    svc = sglang(f"{SPEC} {flag}", env={"SGLANG_ENABLE_SPEC_V2": "1"})
    found = [f for f in pf.check_service(svc, rules=RULES, model_config=QWEN35, gpu_count=None, version=version)
             if f.rule_id.startswith("sglang-spec-lazy") or f.rule_id.startswith("sglang-mamba")]
    [f] = [f for f in found if f.rule_id == rule]
    assert ("--mamba-radix-cache-strategy" in f.fix) == new_name
    assert ("--mamba-scheduler-strategy" in f.fix) == (not new_name)
    # 0.5.14-0.5.19 also warn that the old name is deprecated; no finding names the old flag as the fix
    deprecated = version == "0.5.15" and "scheduler" in flag
    expected = {rule, "sglang-mamba-scheduler-strategy-renamed"} if deprecated else {rule}
    assert {f.rule_id for f in found} == expected


def test_incident_fix_says_which_release_knows_which_name():
    svc = sglang(SPEC)
    [f] = pf.check_service(svc, rules=RULES, model_config=QWEN35, gpu_count=None, version=None)
    assert f.rule_id == "sglang-spec-hybrid-extra-buffer"
    assert "these names are for SGLang 0.5.10-0.5.13" in f.fix
    assert "there the flag is --mamba-radix-cache-strategy, 0.5.20 and later know only that name" in f.fix
    assert pf.check_service(svc, rules=RULES, model_config=QWEN35, gpu_count=None, version="0.5.20") == []
