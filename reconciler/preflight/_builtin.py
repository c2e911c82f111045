"""The built-in rules: checks that need arithmetic or look across services (the registry, what a
check is given and returns, is in _registry).

Here: parallel sizes vs GPUs, GPUs and ports shared on one host, dp-attention, attention and KV
heads vs tensor parallelism, quantization vs checkpoint. The model-shape rules (FP8 blocks and
MoE partitions per rank) are in _shapes, the hardware rules (memory, compute capability) in
_capacity, what a stop does to the requests in flight in _drain; importing this module registers
all of them, in that order.
"""

from __future__ import annotations

from ._command import PARALLEL_FLAGS, WILDCARD_HOSTS, Command, gpu_claim, gpu_positions
from ._models import ModelInfo, checkpoint_quantization, text_config
from ._registry import BUILTIN_RULES, Failed, RuleFacts, builtin, positive_int

__all__ = ["BUILTIN_RULES", "Failed", "RuleFacts", "builtin"]

# The rules, in the order RuleSet.ids lists them.

_SGLANG_ARGS = "https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/server_args.py"
_VLLM_PARALLEL = "https://github.com/vllm-project/vllm/blob/main/vllm/config/parallel.py"
_VLLM_MODEL = "https://github.com/vllm-project/vllm/blob/main/vllm/config/model.py"
# Where SGLang asserts the head split (v0.5.23; every attention class does the same, e.g.
# qwen3_5.py L1293-1299 and qwen2_moe.py): models/qwen3.py L166 (heads), L169-176 (KV heads).
_SGLANG_QWEN3_ATTN = "https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/models/qwen3.py#L164-L177"


@builtin("tp-exceeds-gpus", sources={
    "sglang": "https://github.com/sgl-project/sglang/blob/main/docs/backend/server_arguments.md",
    "vllm": _VLLM_PARALLEL})
def _gpu_count(cmd: Command, info: ModelInfo, facts: RuleFacts) -> Failed | None:
    """The parallel size (tp x pp x dp) exceeds the GPUs the service may use."""
    world = cmd.world_size()
    if world is None or world < 1:
        return None
    visible = cmd.visible_devices
    if visible is not None:
        available, where = len(visible), f"CUDA_VISIBLE_DEVICES lists {len(visible)}"
    elif facts.gpu_count is not None:
        available, where = facts.gpu_count, f"the host has {facts.gpu_count}"
    else:
        return None                    # unknown: nothing to compare with
    positions = gpu_positions(cmd, world)
    if positions is not None and positions[-1] >= available:
        return Failed(f"{_parallel_text(cmd)} placed from --base-gpu-id {positions[0]} needs GPU "
                      f"position {positions[-1]}, but {where} GPU{'s' if available != 1 else ''}",
                      "lower --base-gpu-id or the parallel size, or give the service more GPUs")
    if world > available:
        return Failed(f"{_parallel_text(cmd)} needs {world} GPU{'s' if world != 1 else ''}, "
                      f"but {where}",
                      "lower the parallel size, or list more GPUs in CUDA_VISIBLE_DEVICES "
                      "(unset: every GPU of the host)")
    return None


def _parallel_text(cmd: Command) -> str:
    assert cmd.server is not None
    names = PARALLEL_FLAGS[cmd.server]
    given = [f"{n} {cmd.value(n)}" for n in names if cmd.has(n)]
    if cmd.server == "sglang" and cmd.has("--enable-dp-attention"):
        given = [g for g in given if not g.startswith("--dp-size")]
    return " x ".join(given) or f"{names[0]} 1"


@builtin("gpu-overlap", scope="host", sources={
    "sglang": _SGLANG_ARGS,
    "any": "https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#env-vars"})
def _gpu_overlap(mine: Command, other: str, theirs: Command) -> Failed | None:
    """Two services on one host claim the same GPUs."""
    shared = _overlap(gpu_claim(mine), gpu_claim(theirs))
    if shared is None:
        return None
    return Failed(f"claims {_describe_claim(gpu_claim(mine))} and service {other} claims "
                  f"{_describe_claim(gpu_claim(theirs))}: both would use {shared}",
                  "give each service its own GPUs with CUDA_VISIBLE_DEVICES in its env "
                  "(e.g. \"0,1\" and \"2,3\"), or for SGLang --base-gpu-id")


def _describe_claim(claim: frozenset[str] | None) -> str:
    return "every GPU (CUDA_VISIBLE_DEVICES unset)" if claim is None else "GPU " + ",".join(sorted(claim))


def _overlap(a: frozenset[str] | None, b: frozenset[str] | None) -> str | None:
    """The GPUs two claims share, described; None when they share none."""
    if a is None and b is None:
        return "every GPU"
    common = (b if a is None else a if b is None else a & b) or frozenset()
    return "GPU " + ",".join(sorted(common)) if common else None


@builtin("port-conflict", scope="host", sources={
    "sglang": _SGLANG_ARGS,
    "vllm": "https://github.com/vllm-project/vllm/blob/main/vllm/entrypoints/openai/cli_args.py"})
def _port_conflict(mine: Command, other: str, theirs: Command) -> Failed | None:
    """Two services on one host listen on the same port."""
    port = mine.port
    if port is None or port != theirs.port or not _hosts_overlap(mine.host, theirs.host):
        return None
    return Failed(f"listens on {mine.host or '*'}:{port} and service {other} on "
                  f"{theirs.host or '*'}:{theirs.port}: the second to start fails with "
                  f"'Address already in use'",
                  "give each service its own --port")


def _hosts_overlap(a: str, b: str) -> bool:
    return a == b or a in WILDCARD_HOSTS or b in WILDCARD_HOSTS


@builtin("sglang-dp-attention-tp-divisible", sources={"sglang": _SGLANG_ARGS})
def _dp_attention(cmd: Command, info: ModelInfo, facts: RuleFacts) -> Failed | None:
    """With --enable-dp-attention, --tp-size must be a multiple of --dp-size."""
    if cmd.server != "sglang" or not cmd.has("--enable-dp-attention"):
        return None
    tp, dp = cmd.int_value("--tp-size", 1), cmd.int_value("--dp-size", 1)
    if tp is None or dp is None or dp <= 1 or (tp % dp == 0):
        return None
    return Failed(f"--enable-dp-attention with --tp-size {tp} and --dp-size {dp}: tp must be a "
                  f"multiple of dp (SGLang asserts tp_size % dp_size == 0 at start-up)",
                  f"use a --dp-size that divides {tp}, e.g. "
                  f"{max(d for d in range(1, tp + 1) if tp % d == 0 and d <= dp)}")


def _heads_of(info: ModelInfo) -> tuple[int, int] | None:
    """(attention heads, KV heads) of the language model; KV heads default to the attention
    heads (no num_key_value_heads: multi-head attention). None without a usable config."""
    if info.config is None:
        return None
    text = text_config(info.config)
    heads = positive_int(text.get("num_attention_heads"))
    if heads is None:
        return None
    kv = text.get("num_key_value_heads", heads)
    return heads, positive_int(kv) or heads


def _kv_split(kv: int, tp: int) -> str | None:
    """Why kv heads cannot be spread over tp ranks, else None. Both servers shard KV heads when
    there are at least tp of them (kv % tp == 0) and otherwise replicate them (tp % kv == 0):
    QKVParallelLinear's divide(total_num_kv_heads, tp) / divide(tp, total_num_kv_heads)."""
    if kv >= tp and kv % tp:
        return f"its {kv} KV heads cannot be split evenly over {tp} ranks (kv heads % tp must be 0)"
    if kv < tp and tp % kv:
        return (f"its {kv} KV heads cannot be replicated evenly over {tp} ranks (with fewer KV heads "
                f"than ranks, tp must be a multiple of the KV heads)")
    return None


def _good_tp(heads: int, kv: int, tp: int) -> int:
    """The largest size below tp that splits both head counts (1 at worst)."""
    return max(d for d in range(1, tp) if heads % d == 0 and _kv_split(kv, d) is None) if tp > 1 else 1


@builtin("vllm-tp-divides-attention-heads", sources={"vllm": _VLLM_MODEL})
def _heads(cmd: Command, info: ModelInfo, facts: RuleFacts) -> Failed | None:
    """vLLM needs the attention heads (and the KV heads) to divide evenly over the tensor-parallel ranks."""
    shape = _heads_of(info)
    tp = cmd.int_value("--tensor-parallel-size", 1)
    if cmd.server != "vllm" or shape is None or not tp or tp <= 1:
        return None
    heads, kv = shape
    if heads % tp:
        return Failed(f"--tensor-parallel-size {tp} does not divide the model's {heads} attention "
                      f"heads (vLLM: 'Total number of attention heads ({heads}) must be divisible "
                      f"by tensor parallel size ({tp})')",
                      f"use a tensor-parallel size that divides {heads} (e.g. {_good_tp(heads, kv, tp)}), "
                      f"or add pipeline parallelism")
    kv_problem = _kv_split(kv, tp)
    if kv_problem:
        # vllm/model_executor/layers/linear.py (v0.33.0) QKVParallelLinear, L1066-1070: an
        # AssertionError while the model is built, after the engine's own argument checks.
        return Failed(f"--tensor-parallel-size {tp}: {kv_problem}; vLLM fails while building the "
                      f"model (QKVParallelLinear: '... is not divisible by ...')",
                      f"use a tensor-parallel size that fits {heads} attention and {kv} KV heads "
                      f"(e.g. {_good_tp(heads, kv, tp)})")
    return None


# SGLang shards attention over the attention-TP group: tp, divided by --dp-size under
# --enable-dp-attention (runtime_context.py derive_attn_tp_size: tp // attn_dp // attn_cp).
# Context parallelism (attention CP, decode CP) changes the KV group again: with those flags the
# rule says nothing rather than guess.
_SGLANG_CP_FLAGS = ("--attn-cp-size", "--attention-context-parallel-size", "--dcp-size",
                    "--decode-context-parallel-size", "--attn-dp-size")


def sglang_attention_tp(cmd: Command) -> int | None:
    """SGLang's attention tensor-parallel width for this command; None when not plain to tell."""
    tp = cmd.int_value("--tp-size", 1)
    dp = cmd.int_value("--dp-size", 1) if cmd.has("--enable-dp-attention") else 1
    if not tp or not dp or tp % dp or any(cmd.has(f) and cmd.value(f) != "1" for f in _SGLANG_CP_FLAGS):
        return None
    return tp // dp


@builtin("sglang-tp-divides-attention-heads", sources={"sglang": _SGLANG_QWEN3_ATTN})
def _sglang_heads(cmd: Command, info: ModelInfo, facts: RuleFacts) -> Failed | None:
    """SGLang needs the attention heads and the KV heads to divide over its attention-TP ranks;
    its argument checks do not look (--tp-size 3 with 32 heads starts, then fails building the model)."""
    shape = _heads_of(info)
    tp = sglang_attention_tp(cmd) if cmd.server == "sglang" else None
    if shape is None or tp is None or tp <= 1:
        return None
    heads, kv = shape
    what = (f"--tp-size {cmd.value('--tp-size')} with --dp-size {cmd.value('--dp-size')} "
            f"(--enable-dp-attention: {tp} attention ranks)" if cmd.has("--enable-dp-attention")
            else f"--tp-size {tp}")
    problem = (f"it does not divide the model's {heads} attention heads" if heads % tp
               else _kv_split(kv, tp))
    if problem is None:
        return None
    return Failed(f"{what}: {problem}; SGLang accepts the flags, then fails while building the model "
                  f"(the attention layer asserts total_num_heads % attn_tp_size == 0 and "
                  f"total_num_kv_heads % attn_tp_size == 0, or attn_tp_size % total_num_kv_heads "
                  f"== 0 when there are fewer KV heads than ranks)",
                  f"use an attention-TP size that fits {heads} attention and {kv} KV heads "
                  f"(e.g. --tp-size {_good_tp(heads, kv, tp) * ((cmd.int_value('--tp-size', 1) or tp) // tp)}"
                  f"{' with the same --dp-size' if cmd.has('--enable-dp-attention') else ''}), "
                  f"or add pipeline parallelism")


# CLI method -> checkpoint methods it may override (SGLang's compatible_quantization_methods,
# plus the kernel upgrades both servers apply themselves: gptq -> gptq_marlin, awq -> awq_marlin).
_QUANT_COMPATIBLE: dict[str, frozenset[str]] = {
    "modelopt_fp8": frozenset({"modelopt"}),
    "modelopt_fp4": frozenset({"modelopt", "fp8"}),
    "modelopt_mixed": frozenset({"modelopt"}),
    "nvfp4_online": frozenset({"fp8", "modelopt_fp8"}),
    "petit_nvfp4": frozenset({"modelopt"}),
    "w8a8_int8": frozenset({"compressed-tensors"}),
    "w8a8_fp8": frozenset({"compressed-tensors"}),
    "auto-round-int8": frozenset({"compressed-tensors"}),
    "gptq_marlin": frozenset({"gptq"}),
    "gptq_marlin_24": frozenset({"gptq"}),
    "gptq_bitblas": frozenset({"gptq"}),
    "marlin": frozenset({"gptq"}),
    "awq_marlin": frozenset({"awq"}),
    "moe_wna16": frozenset({"gptq", "awq"}),
}
# Methods that re-quantize whatever the checkpoint holds (SGLang REQUANTIZATION_METHODS).
_REQUANTIZE = frozenset({"quark_mxfp4"})


@builtin("quantization-mismatch", sources={
    "sglang": "https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/configs/model_config.py",
    "vllm": _VLLM_MODEL})
def _quantization(cmd: Command, info: ModelInfo, facts: RuleFacts) -> Failed | None:
    """--quantization contradicts the checkpoint's quantization_config."""
    if cmd.server is None or info.config is None:
        return None
    cli = (cmd.value("--quantization") or "").lower().replace("compressed_tensors", "compressed-tensors")
    ckpt = checkpoint_quantization(info.config)
    if not cli or not ckpt or cli == ckpt or cli in _REQUANTIZE:
        return None
    if ckpt in _QUANT_COMPATIBLE.get(cli, frozenset()):
        return None
    return Failed(f"--quantization {cli} contradicts the checkpoint, whose config.json says "
                  f"quant_method {ckpt} (the server refuses to start: 'Quantization method "
                  f"specified in the model config ({ckpt}) does not match the quantization "
                  f"method specified in the `quantization` argument ({cli})')",
                  "remove --quantization (the server reads the method from the checkpoint), "
                  "or point the service at a checkpoint quantized that way")


# The model-shape, hardware and stop rules register after these (RuleSet.ids keeps this order).
from . import _capacity, _drain, _shapes  # noqa: E402, F401
