"""Built-in rules on the model's shape per rank: MoE experts and FP8 weight blocks.

Both servers check these while building the model, on the GPUs, after the argument checks an
engine probe can run (an AssertionError or ValueError minutes into a start, after the old server
is stopped); config.json and the command line say it before anything stops. The numbers are the
engines' own, read in SGLang 0.5.23 and vLLM 0.33.0 (lines cited at each rule).

Per-rank widths: SGLang's MoE layers split the expert MLP over moe_tp = tp / ep / moe_dp
(runtime_context.py L154); vLLM's over tp x dp without --enable-expert-parallel and over 1
rank with it (fused_moe/config.py FusedMoEParallelConfig.make). Where a flag this module does
not model is given (context parallelism), the rules say nothing rather than guess.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._command import PARALLEL_FLAGS, Command
from ._models import ModelInfo, text_config
from ._registry import Failed, RuleFacts, builtin, positive_int

_SGL = "https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt"
_VLLM = "https://github.com/vllm-project/vllm/blob/v0.33.0/vllm"

# Keys of the routed-expert count, per model family (Qwen MoE / Qwen3.5: num_experts;
# DeepSeek, Kimi: n_routed_experts; Mixtral: num_local_experts).
_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def moe_shape(text: Mapping[str, Any]) -> tuple[int, int] | None:
    """(routed experts, one expert's intermediate size) of a MoE model; None for a dense one."""
    experts = next((positive_int(text.get(k)) for k in _EXPERT_KEYS if positive_int(text.get(k))), None)
    if experts is None or experts <= 1:
        return None
    size = positive_int(text.get("moe_intermediate_size"))
    if size is None and positive_int(text.get("num_local_experts")):
        size = positive_int(text.get("intermediate_size"))       # Mixtral: the experts' own size
    return (experts, size) if size else None


def _has_dense_mlp(text: Mapping[str, Any]) -> bool:
    """Whether some layers have a dense (tensor-parallel) MLP of intermediate_size: every dense
    model; MoE models only with dense layers first (DeepSeek first_k_dense_replace), listed
    (Qwen mlp_only_layers) or interleaved (decoder_sparse_step > 1)."""
    if moe_shape(text) is None:
        return True
    return bool(positive_int(text.get("first_k_dense_replace")) or text.get("mlp_only_layers")
                or (positive_int(text.get("decoder_sparse_step")) or 1) > 1)


def moe_ranks(cmd: Command) -> tuple[int, int] | None:
    """(moe_tp, ep): the ranks one expert's MLP is split over, and the expert-parallel size;
    None when the flags are not plain numbers or name a layout not modelled here."""
    if cmd.server == "sglang":
        tp = cmd.int_value("--tp-size", 1)
        default_ep = tp if cmd.has("--enable-ep-moe") else 1      # before --ep-size: ep = tp
        ep = cmd.int_value("--ep-size", default_ep or 1)
        moe_dp = cmd.int_value("--moe-dp-size", cmd.int_value("--moe-data-parallel-size", 1) or 1)
        if not tp or not ep or not moe_dp or tp % (ep * moe_dp):
            return None
        return tp // ep // moe_dp, ep
    if cmd.server == "vllm":
        tp = cmd.int_value("--tensor-parallel-size", 1)
        dp = cmd.int_value("--data-parallel-size", 1)
        if not tp or not dp or any(cmd.has(f) and cmd.value(f) != "1" for f in (
                "--prefill-context-parallel-size", "-pcp", "--decode-context-parallel-size", "-dcp")):
            return None
        if cmd.has("--enable-expert-parallel") or cmd.has("-ep"):
            return 1, tp * dp
        return tp * dp, 1
    return None


def _fp8_block(info: ModelInfo, cmd: Command) -> tuple[int, int] | None:
    """The checkpoint's FP8 weight block [n, k] (quantization_config.weight_block_size of an
    fp8 checkpoint), unless --quantization asks for another method."""
    if info.config is None:
        return None
    cli = (cmd.value("--quantization") or "").lower()
    if cli and cli != "fp8":
        return None
    for section in (info.config, text_config(info.config)):
        q = section.get("quantization_config")
        if isinstance(q, Mapping) and str(q.get("quant_method", "")).lower() == "fp8":
            block = q.get("weight_block_size")
            if isinstance(block, list) and len(block) == 2 and all(positive_int(b) for b in block):
                return int(block[0]), int(block[1])
            return None
    return None


@builtin("moe-experts-per-rank", sources={
    "sglang": f"{_SGL}/layers/moe/fused_moe_triton/layer.py#L414-L428",
    "vllm": f"{_VLLM}/model_executor/layers/fused_moe/config.py#L1352"})
def _moe_ranks(cmd: Command, info: ModelInfo, facts: RuleFacts) -> Failed | None:
    """A MoE model's experts must split evenly: the expert intermediate size over the MoE
    tensor-parallel ranks, and (SGLang) the routed experts over the expert-parallel ranks."""
    if info.config is None:
        return None
    shape = moe_shape(text_config(info.config))
    ranks = moe_ranks(cmd)
    if shape is None or ranks is None:
        return None
    (experts, size), (moe_tp, ep) = shape, ranks
    if moe_tp > 1 and size % moe_tp:
        return Failed(f"the model's expert intermediate size {size} does not split over {moe_tp} MoE "
                      f"tensor-parallel ranks{_ranks_text(cmd, moe_tp, ep)}: the server fails while "
                      f"building the model (AssertionError: intermediate_size % tp_size == 0)",
                      f"use a parallel layout whose MoE tensor-parallel size divides {size}"
                      + (" (or expert parallelism: --ep-size)" if cmd.server == "sglang"
                         else " (or --enable-expert-parallel)"))
    if cmd.server == "sglang" and ep > 1 and experts % ep:
        return Failed(f"--ep-size {ep} does not divide the model's {experts} routed experts: SGLang "
                      f"fails while building the model (AssertionError: num_experts % ep_size == 0)",
                      f"use an --ep-size that divides {experts}")
    return None


def _ranks_text(cmd: Command, moe_tp: int, ep: int) -> str:
    if cmd.server == "sglang":
        return f" (--tp-size / --ep-size {ep} / --moe-dp-size)" if ep > 1 else " (--tp-size)"
    return " (--tensor-parallel-size x --data-parallel-size, no --enable-expert-parallel)"


@builtin("fp8-block-partition", sources={
    "sglang": f"{_SGL}/layers/quantization/fp8.py#L570-L610",
    "vllm": f"{_VLLM}/model_executor/layers/quantization/utils/fp8_utils.py#L1296-L1372"})
def _fp8_blocks(cmd: Command, info: ModelInfo, facts: RuleFacts) -> Failed | None:
    """An FP8 block-quantized checkpoint needs every rank's slice of an MLP to be whole weight
    blocks (its weight_block_size [n, k]), dense and MoE alike."""
    block = _fp8_block(info, cmd)
    if block is None or info.config is None:
        return None
    text = text_config(info.config)
    bn, bk = block
    moe = moe_shape(text)
    ranks = moe_ranks(cmd)
    if moe is not None and ranks is not None and ranks[0] >= 1 and moe[1] % ranks[0] == 0:
        found = _moe_block(cmd, moe[1] // ranks[0], ranks[0], bn, bk, facts)
        if found is not None:
            return found
    tp = cmd.int_value(PARALLEL_FLAGS[cmd.server or "sglang"][0], 1)
    inter = positive_int(text.get("intermediate_size"))
    if (inter is None or not tp or tp <= 1 or not _has_dense_mlp(text) or inter % tp
            or (cmd.server == "sglang" and cmd.has("--enable-dp-attention"))):
        return None
    per = inter // tp
    for size, unit, what in ((bn, "block_n", "output_partition_size"), (bk, "block_k", "input_size_per_partition")):
        if per % size:
            return Failed(f"the MLP's intermediate size {inter} over {tp} tensor-parallel ranks is {per} per "
                          f"rank, not a multiple of the FP8 weight block {unit} = {size} "
                          f"(weight_block_size {[bn, bk]}): the server fails while building the model "
                          f"('Weight {what} = {per} is not divisible by weight quantization {unit} = {size}.')",
                          f"use a tensor-parallel size whose slice of {inter} is a multiple of {size} "
                          f"(e.g. {_good_split(inter, tp, bn, bk)}), or a checkpoint that is not block-quantized")
    return None


def _good_split(size: int, tp: int, bn: int, bk: int) -> int:
    """The largest size below tp whose per-rank slice of size is whole blocks (1 at worst)."""
    return max(d for d in range(1, tp) if size % d == 0 and (size // d) % bn == 0
               and (d == 1 or (size // d) % bk == 0)) if tp > 1 else 1


# SGLang's flashinfer_trtllm MoE runner rounds the per-rank size up to 128 before the block
# check (fused_moe_triton/layer.py L513-522), and may be chosen by itself on Blackwell.
_PADDING_BACKENDS = ("flashinfer_trtllm",)


def _moe_block(cmd: Command, per: int, moe_tp: int, bn: int, bk: int, facts: RuleFacts) -> Failed | None:
    backend = (cmd.value("--moe-runner-backend") or "").lower()
    if cmd.server == "sglang" and backend in _PADDING_BACKENDS:
        return None
    bad = [(size, unit, what) for size, unit, what in (
        (bn, "block_n", "The output_size of gate's and up's weight"),
        (bk, "block_k", "The input_size of down's weight")) if per % size and (unit == "block_n" or moe_tp > 1)]
    if not bad:
        return None
    size, unit, what = bad[0]
    blackwell = facts.hardware is not None and any(
        g.compute_capability is not None and g.compute_capability >= (10, 0) for g in facts.hardware.gpus)
    maybe_padded = cmd.server == "sglang" and not backend and blackwell
    return Failed(f"each of the {moe_tp} MoE tensor-parallel ranks gets {per} of an expert's intermediate "
                  f"size, not a multiple of the FP8 weight block {unit} = {size}: the server fails while "
                  f"building the model ('{what} = {per} is not divisible by weight quantization {unit} = {size}.')"
                  + (" unless SGLang picks the flashinfer_trtllm MoE runner on these Blackwell GPUs, which "
                     "pads it" if maybe_padded else ""),
                  "use fewer MoE tensor-parallel ranks, or expert parallelism ("
                  + ("--ep-size" if cmd.server == "sglang" else "--enable-expert-parallel")
                  + "), so that each rank's slice is a multiple of the block",
                  "warning" if maybe_padded else "error")
