"""Pre-flight rules against the host's GPUs (pure): weights vs the memory free after the stop,
and the quantization method vs the GPUs' compute capability."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from reconciler import preflight as pf
from reconciler.preflight._hardware import capability, service_gpus
from tests.preflight.test_preflight import RULES, config, sglang, vllm

GIB = 1024 ** 3
H200 = 143_771                              # MiB, as nvidia-smi reports an H200
FULL3 = pf.GpuState(3, H200, H200, uuid="GPU-3")
QWEN3 = config("Qwen3-8B")


def gpus(n: int = 4, used: int = 0, total: int = H200, cc: tuple[int, int] | None = (9, 0)) -> tuple[pf.GpuState, ...]:
    return tuple(pf.GpuState(i, total, used, uuid=f"GPU-{i}", compute_capability=cc) for i in range(n))


def hw(n: int = 4, used: int = 0, holders: tuple[pf.GpuHolder, ...] = (), **kw) -> pf.Hardware:
    return pf.Hardware(gpus=gpus(n, used, **kw), holders=holders)


def memory(svc, hardware, weights: int | None, cfg=QWEN3, version=None) -> list[pf.Finding]:
    return [f for f in pf.check_service(svc, rules=RULES, model_config=cfg, gpu_count=None, version=version,
                                        hardware=hardware, weights_bytes=weights) if f.rule_id == "gpu-memory-fit"]


def own(unit: str, mib: int, n: int = 4) -> tuple[pf.GpuHolder, ...]:
    return tuple(pf.GpuHolder(unit, mib, (i,)) for i in range(n))


# ---- memory ----------------------------------------------------------------------------------

@pytest.mark.parametrize("svc, hardware, weights, severity, phrase", [
    # 240 GiB over 4 H200s: 60 GiB each, in about 130 GiB of SGLang budget
    (sglang("--tp 4"), hw(), 240 * GIB, None, None),
    # 480 GiB on one GPU: cannot load
    (sglang("--tp 1"), hw(), 480 * GIB, "error", "the server fails at load"),
    # the old server holds 120 GiB per GPU, and it is this service's: freed at the stop
    (sglang("--tp 4"), hw(used=123_000, holders=own("sglang-qwen.service", 123_000)), 240 * GIB, None, None),
    # ... held by another unit: it stays, 20 GiB free for 60 GiB per GPU
    (sglang("--tp 4"), hw(used=123_000, holders=own("other.service", 123_000)), 240 * GIB, "error",
     "the server fails at load"),
    # ... held by processes whose unit is unknown: may be the service's own, a warning
    (sglang("--tp 4"), hw(used=123_000, holders=own(None, 123_000)), 240 * GIB, "warning",
     "may be the service's own"),
    # close: 120 GiB per GPU in SGLang's default budget (at most about 133 GiB)
    (sglang("--tp 4"), hw(), 480 * GIB, "warning", "little is left for the KV cache"),
    # --mem-fraction-static is the budget's fraction of the free memory: 0.5 x 140 GiB < 100 GiB
    (sglang("--tp 4 --mem-fraction-static 0.5"), hw(), 400 * GIB, "error", "--mem-fraction-static 0.5"),
    # vLLM asks for gpu_memory_utilization x total free at start: 0.9 x 140 GiB > 100 GiB free
    (vllm("-tp 4"), hw(used=43_771), 80 * GIB, "error", "vLLM refuses to start"),
    (vllm("-tp 4 --gpu-memory-utilization 0.6"), hw(used=43_771), 80 * GIB, None, None),
    # the weights on CUDA_VISIBLE_DEVICES' GPUs: GPU 3 is full, the service runs on 0 and 1
    (sglang("--tp 2", env={"CUDA_VISIBLE_DEVICES": "0,1"}),
     pf.Hardware(gpus=(*gpus(2), FULL3)), 120 * GIB, None, None),
    (sglang("--tp 2", env={"CUDA_VISIBLE_DEVICES": "GPU-3,GPU-0"}),
     pf.Hardware(gpus=(*gpus(2), FULL3)), 120 * GIB, "error", "GPU 3"),
    # unknown: no hardware, no size and no config, or a size that is not a number
    (sglang("--tp 1"), None, 480 * GIB, None, None),
    (sglang("--tp ${TP}"), hw(), 480 * GIB, None, None),
])
def test_memory_fit(svc, hardware, weights, severity, phrase):
    found = memory(svc, hardware, weights)
    if severity is None:
        assert found == []
        return
    [f] = found
    assert (f.severity, phrase in f.message) == (severity, True), f.message


def test_memory_counts_the_service_own_memory_as_freed_and_says_so():
    [f] = memory(sglang("--tp 4"), hw(used=123_000, holders=own("sglang-qwen.service", 100_000)), 480 * GIB)
    assert "counting the 100000 MiB the service's own unit holds as freed at the stop" in f.message


def test_memory_without_a_size_estimates_from_config_and_only_warns():
    big = {"architectures": ["X"], "hidden_size": 8192, "num_hidden_layers": 80, "vocab_size": 128256,
           "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672,
           "torch_dtype": "bfloat16"}                          # a 70B dense model: about 131 GiB in bf16
    est = pf.check_service(sglang("--tp 1"), rules=RULES, model_config=big, gpu_count=None, hardware=hw(1))
    [f] = [x for x in est if x.rule_id == "gpu-memory-fit"]
    assert f.severity == "warning" and "the size is estimated from config.json" in f.message
    assert memory(sglang("--tp 4"), hw(), None, cfg=big) == []
    assert memory(sglang("--tp 1"), hw(1), None, cfg=None) == []


def test_vllm_default_utilization_follows_the_release():
    # 130 GiB free of 140.4: under 0.92 x total (129.2 GiB)? no; under 0.9? no -> both fine
    assert memory(vllm("-tp 1"), hw(1, used=10_000), 10 * GIB, version="0.33.0") == []
    # 128 GiB free: below 0.92 x 140.4 GiB (0.33.0's default), above 0.9 x 140.4 (older)
    [f] = memory(vllm("-tp 1"), hw(1, used=12_700), 10 * GIB, version="0.33.0")
    assert "vLLM's default gpu_memory_utilization 0.92" in f.message
    assert memory(vllm("-tp 1"), hw(1, used=12_700), 10 * GIB, version="0.11.0") == []


def test_service_gpus_follow_placement():
    h = pf.Hardware(gpus=gpus(8))
    assert [g.index for g in service_gpus(pf.parse_command(sglang("--tp 2 --base-gpu-id 4")), h)] == [4, 5]
    assert [g.index for g in service_gpus(pf.parse_command(vllm("-tp 2 -dp 2")), h)] == [0, 1, 2, 3]
    assert service_gpus(pf.parse_command(sglang("--tp 16")), h) is None          # too few: tp-exceeds-gpus says it
    assert service_gpus(pf.parse_command(sglang("--tp 2", env={"CUDA_VISIBLE_DEVICES": "GPU-9,0"})), h) is None


# ---- Hardware.of: what the host side feeds -----------------------------------------------------

@dataclass
class _Gpu:                      # the shape of host/gpu.py's Gpu, with the field the lead adds
    index: int
    used_mib: int | None
    total_mib: int | None
    uuid: str = ""
    compute_capability: str | None = None


@dataclass
class _Holder:
    pid: int
    unit: str | None
    used_mib: int | None
    gpus: tuple[int, ...]


@dataclass
class _Facts:
    gpus: list[_Gpu]
    holders: list[_Holder]


def test_hardware_of_gpu_facts():
    facts = _Facts([_Gpu(0, 1000, H200, "GPU-a", "9.0"), _Gpu(1, None, H200, "GPU-b", "[N/A]")],
                   [_Holder(7, "sglang-qwen.service", 3000, (0, 1)), _Holder(8, None, None, ())])
    h = pf.Hardware.of(facts)
    assert h.gpus[0] == pf.GpuState(0, H200, 1000, "GPU-a", (9, 0))
    assert h.gpus[1].compute_capability is None and h.gpus[1].used_mib is None
    assert h.held(0, "sglang-qwen.service") == 1500 and h.held(1, "sglang-qwen.service") == 1500
    assert h.held(0, None) == 0
    assert capability("10.0") == (10, 0) and capability((8, 9)) == (8, 9) and capability("9") is None


def test_weights_bytes_from_model_facts():
    assert pf.weights_bytes(pf.ModelFacts("/m", True, index={"metadata": {"total_size": 42}})) == 42
    assert pf.weights_bytes(pf.ModelFacts("/m", True, files={"a.safetensors": 10, "b.safetensors": 5})) == 15
    assert pf.weights_bytes(pf.ModelFacts("/m", True, files={"a.safetensors": 10, "b.safetensors": None})) is None
    assert pf.weights_bytes(None) is None


# ---- quantization vs compute capability --------------------------------------------------------

def quantized(method: str, **extra) -> dict:
    return {**QWEN3, "quantization_config": {"quant_method": method, **extra}}


def cc_findings(svc, cfg, cc, version=None) -> list[pf.Finding]:
    return [f for f in pf.check_service(svc, rules=RULES, model_config=cfg, gpu_count=None, version=version,
                                        hardware=hw(4, cc=cc)) if f.rule_id == "quantization-compute-capability"]


@pytest.mark.parametrize("svc, cfg, cc, version, severity", [
    (sglang("--tp 4"), quantized("fp8"), (9, 0), None, None),           # H100/H200
    (sglang("--tp 4"), quantized("fp8"), (8, 0), None, None),           # A100: SGLang's fp8 minimum is 8.0
    (sglang("--tp 4"), quantized("fp8"), (7, 5), None, "error"),        # T4
    (vllm("-tp 4"), quantized("fp8"), (7, 5), None, None),              # vLLM's is 7.5 (Marlin)
    (sglang("--tp 4"), quantized("modelopt", quant_algo="FP8"), (8, 0), None, "error"),  # modelopt_fp8: 8.9
    (sglang("--tp 4"), quantized("modelopt", quant_algo="FP8"), (8, 9), None, None),
    (sglang("--tp 4"), quantized("modelopt", quant_algo="NVFP4"), (8, 0), None, None),   # Marlin FP4
    (sglang("--tp 4 --quantization w8a8_fp8"), QWEN3, (8, 6), "0.5.23", "error"),
    (sglang("--tp 4 --quantization w8a8_fp8"), QWEN3, (8, 6), "0.5.24", "warning"),      # past what was read
    (sglang("--tp 4 --quantization w8a8_fp8"), QWEN3, (8, 6), "0.5.13.post1", "error"),
    (vllm("-tp 4 --quantization fp_quant"), QWEN3, (9, 0), "0.33.0", "error"),
    (sglang("--tp 4"), QWEN3, (7, 0), None, None),                      # not quantized
    (sglang("--tp 4 --quantization some_new_method"), QWEN3, (7, 0), None, None),  # not in the table
    (sglang("--tp 4"), quantized("fp8"), None, None, None),             # capability unknown
])
def test_quantization_vs_compute_capability(svc, cfg, cc, version, severity):
    found = cc_findings(svc, cfg, cc, version)
    if severity is None:
        assert found == []
        return
    [f] = found
    assert f.severity == severity
    assert "is not supported for the current GPU. Minimum capability:" in f.message


def test_compute_capability_message():
    [f] = cc_findings(sglang("--tp 4"), quantized("fp8"), (7, 5))
    assert f.message.startswith("quantization fp8 needs compute capability 8.0 or newer, but the service's "
                                "GPUs are 7.5")
    assert f.source == ("https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/"
                        "model_loader/loader.py#L253-L265")
    assert pf.check_service(sglang("--tp 4"), rules=RULES, model_config=quantized("fp8"), gpu_count=None) == []
