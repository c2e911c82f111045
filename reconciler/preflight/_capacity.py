"""Built-in rules against the host's GPUs: will the weights fit, can the GPUs run the quantization.

Neither engine's argument stage sees the real GPUs (an engine probe runs with them hidden), and
both find these only on the GPUs, after the old server is stopped: the memory rule and the
compute-capability rule read `RuleFacts.hardware` (nvidia-smi's memory per GPU, the holders
with their units, compute_cap) and say nothing where it is None (validate, no nvidia-smi).

Memory, per GPU the service's ranks run on (assumptions, all on the side of not blocking):
* weights per GPU = checkpoint bytes / (tp x pp) (vLLM with --enable-expert-parallel and dp:
  / (tp x pp x dp), the experts being spread over every rank); activations, CUDA graphs and
  the KV cache come on top and are what the margins below are for;
* free after the stop = memory.total - memory.used + what the service's own unit holds there
  (the old server's memory comes back at the stop); memory held by a process whose unit is not
  known may be the service's own: a verdict that depends on it is a warning, not an error;
* SGLang sizes its KV pool as free x mem_fraction_static - weights
  (mem_cache/kv_cache_configurator.py L2990-3007, v0.5.23) and stops with "Not enough memory"
  when that is not positive; without --mem-fraction-static its default reserves at least
  3.5 GiB + tp x pp / 8 GiB, and 10 GiB on GPUs over 60 GiB (arg_groups/memory_hook.py L309-315);
* vLLM asks for gpu_memory_utilization x memory.total (default 0.92 from 0.33.0, 0.9 before)
  and refuses to start with less free (v1/worker/utils.py L761, v0.33.0);
* close: the weights take more than 85% of that budget, leaving the KV cache little: a warning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._command import Command
from ._hardware import GpuState, Hardware, service_gpus
from ._models import ModelInfo, checkpoint_quantization, text_config
from ._registry import Failed, RuleFacts, builtin, positive_int
from ._shapes import moe_shape
from ._versions import covers

_SGL = "https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt"
_VLLM = "https://github.com/vllm-project/vllm/blob/v0.33.0/vllm"
MIB = 1024 * 1024
CLOSE = 0.85


def _float(cmd: Command, flag: str) -> float | None:
    raw = cmd.value(flag)
    try:
        value = float(raw) if raw is not None else None
    except ValueError:
        return None
    return value if value is not None and 0 < value <= 1 else None


def _shards(cmd: Command) -> int | None:
    """Over how many GPUs one copy of the weights is spread (a lower bound)."""
    if cmd.server == "sglang":
        tp, pp = cmd.int_value("--tp-size", 1), cmd.int_value("--pp-size", 1)
        return tp * pp if tp and pp else None
    tp, pp = cmd.int_value("--tensor-parallel-size", 1), cmd.int_value("--pipeline-parallel-size", 1)
    dp = cmd.int_value("--data-parallel-size", 1)
    if not tp or not pp or not dp:
        return None
    ep = cmd.has("--enable-expert-parallel") or cmd.has("-ep")
    return tp * pp * (dp if ep else 1)


def _at_least(version: str | None, release: str) -> bool:
    """Whether a known version is at least this release (unknown or unreadable: False)."""
    return covers(f">={release}", "skip", version or None)


def _budget(cmd: Command, gpu: GpuState, free: int, version: str | None) -> tuple[float, str]:
    """(MiB the weights and the KV cache may use on this GPU, how the server decides it)."""
    total = gpu.total_mib or 0
    if cmd.server == "vllm":
        util = _float(cmd, "--gpu-memory-utilization")
        given = util is not None
        util = util if util is not None else (0.92 if _at_least(version, "0.33.0") else 0.9)
        return util * total, (f"--gpu-memory-utilization {util:g}" if given else f"vLLM's default "
                              f"gpu_memory_utilization {util:g}") + f" of {total} MiB"
    mfs = _float(cmd, "--mem-fraction-static")
    if mfs is not None:
        return free * mfs, f"--mem-fraction-static {mfs:g} of the {free} MiB free"
    world = (cmd.int_value("--tp-size", 1) or 1) * (cmd.int_value("--pp-size", 1) or 1)
    reserved = max(512 + 2048 * 1.5 + world / 8 * 1024, 10 * 1024 if total > 60 * 1024 else 0)
    mfs = (total - reserved) / total if total > reserved else 0.0
    return free * mfs, (f"SGLang's default mem_fraction_static (at most {mfs:.3f} on a {total} MiB GPU) "
                        f"of the {free} MiB free")


def estimate_weights(config: Mapping[str, Any]) -> int | None:
    """A rough checkpoint size from config.json (embeddings, attention, MLP or experts x bytes per
    weight), for when the host gave no size; None when the config lacks the numbers."""
    text = text_config(config)
    hidden, layers = positive_int(text.get("hidden_size")), positive_int(text.get("num_hidden_layers"))
    vocab, heads = positive_int(text.get("vocab_size")), positive_int(text.get("num_attention_heads"))
    if not (hidden and layers and vocab and heads):
        return None
    head_dim = positive_int(text.get("head_dim")) or hidden // heads
    kv = positive_int(text.get("num_key_value_heads")) or heads
    attn = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim
    moe = moe_shape(text)
    inter = positive_int(text.get("intermediate_size")) or 0
    mlp = moe[0] * 3 * hidden * moe[1] if moe else 3 * hidden * inter
    tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings")) is True
    params = vocab * hidden * (1 if tied else 2) + layers * (attn + mlp)
    method = checkpoint_quantization(config) or ""
    dtype = str(text.get("torch_dtype") or config.get("torch_dtype") or "bfloat16")
    per = (1.0 if "fp8" in method or method in ("w8a8_int8", "w8a8_fp8") else
           0.5 if any(k in method for k in ("fp4", "awq", "gptq", "mxfp4")) else
           4.0 if dtype == "float32" else 2.0)
    return int(params * per)


@builtin("gpu-memory-fit", sources={
    "sglang": f"{_SGL}/mem_cache/kv_cache_configurator.py#L2990-L3007",
    "vllm": f"{_VLLM}/v1/worker/utils.py#L718-L770"})
def _memory(cmd: Command, info: ModelInfo, facts: RuleFacts) -> Failed | None:
    """The weights per GPU must fit in the memory the server may use on its GPUs once the old
    server has stopped (an estimate: a clear miss is an error, a close call a warning)."""
    hw, shards = facts.hardware, _shards(cmd)
    if hw is None or shards is None or cmd.server is None:
        return None
    weights, estimated = facts.weights_bytes, False
    if weights is None and info.config is not None:
        weights, estimated = estimate_weights(info.config), True
    gpus = service_gpus(cmd, hw)
    if not weights or not gpus:
        return None
    need = weights / shards / MIB
    worst: Failed | None = None
    for gpu in gpus:
        found = _fit(cmd, gpu, hw, facts, need, estimated)
        if found is not None and (worst is None or (found.severity == "error" and worst.severity != "error")):
            worst = found
    return worst


def _fit(cmd: Command, gpu: GpuState, hw: Hardware, facts: RuleFacts, need: float,
         estimated: bool) -> Failed | None:
    if gpu.total_mib is None or gpu.used_mib is None:
        return None
    own = hw.held(gpu.index, facts.unit) if facts.unit else 0
    unknown = hw.held(gpu.index, None)
    free = max(0, gpu.total_mib - gpu.used_mib + own)
    budget, how = _budget(cmd, gpu, free, facts.version)
    size = f"{'about ' if estimated else ''}{need:,.0f} MiB of weights per GPU"
    credit = f" (counting the {own} MiB the service's own unit holds as freed at the stop)" if own else ""
    where = f"GPU {gpu.index} has {free} MiB free after the stop{credit}"
    fix = ("spread the model over more GPUs (a larger tensor- or pipeline-parallel size), free the GPUs, "
           "or use a smaller or quantized checkpoint")
    if cmd.server == "vllm" and free < budget:
        text = (f"{where}, less than the {budget:,.0f} MiB vLLM asks for ({how}): vLLM refuses to start "
                f"('Free memory on device ... on startup is less than desired GPU memory utilization')")
        held = ("free the GPU (other processes hold the memory: stop them or move the service to other "
                "GPUs), or lower --gpu-memory-utilization")
        if free + unknown >= budget:
            return Failed(f"{text}, unless the {unknown} MiB held by processes of unknown unit there are "
                          f"the service's own", held, "warning")
        return Failed(text, held)
    if need >= budget:
        text = f"{size}, but {where} and the server may use {budget:,.0f} MiB of it ({how})"
        if estimated or (unknown and need < _budget(cmd, gpu, free + unknown, facts.version)[0]):
            why = ("the size is estimated from config.json" if estimated else
                   f"the {unknown} MiB held by processes of unknown unit may be the service's own")
            return Failed(f"{text}: it likely fails with out-of-memory at load ({why})", fix, "warning")
        return Failed(f"{text}: the server fails at load (out of memory, or "
                      f"{'Not enough memory' if cmd.server == 'sglang' else 'no memory left for the KV cache'})", fix)
    if need >= CLOSE * budget:
        return Failed(f"{size} take {need / budget:.0%} of the {budget:,.0f} MiB the server may use on GPU "
                      f"{gpu.index} ({how}): little is left for the KV cache and CUDA graphs", fix, "warning")
    return None


# The lowest compute capability (major x 10 + minor) each method's quantization config accepts:
# get_min_capability() of its config class, compared at load (SGLang model_loader/loader.py L259,
# vLLM config/vllm.py L930) with the GPU's, after the old server is stopped. Read in SGLang
# 0.5.13, 0.5.20 and 0.5.23 (the same values in all three; nvfp4_online from 0.5.20) and vLLM
# 0.33.0. Several are lower than the hardware's native support (fp8 on SM 8.0, NVFP4 on 8.0 or
# 7.5): both engines fall back to Marlin weight-only kernels there.
MIN_CAPABILITY: dict[str, dict[str, int]] = {
    "sglang": {"fp8": 80, "modelopt_fp8": 89, "modelopt_fp4": 80, "modelopt_mixed": 80,
               "nvfp4_online": 100, "petit_nvfp4": 90, "w4afp8": 90, "w8a8_fp8": 89, "w8a8_int8": 75,
               "mxfp4": 80, "awq": 75, "awq_marlin": 80, "gptq": 60, "gptq_marlin": 80, "marlin": 80,
               "blockwise_int8": 80, "compressed-tensors": 70, "bitsandbytes": 70, "moe_wna16": 70},
    "vllm": {"fp8": 75, "modelopt": 80, "modelopt_fp4": 75, "modelopt_mxfp8": 80, "modelopt_mixed": 75,
             "mxfp4": 80, "fp_quant": 100, "experts_int8": 80, "fbgemm_fp8": 80, "compressed-tensors": 70,
             "moe_wna16": 70, "quark": 70, "torchao": 75},
}
VERIFIED_UP_TO = {"sglang": "0.5.23", "vllm": "0.33.0"}


def _next_release(release: str) -> str:
    """The first release after this one (0.5.23 -> 0.5.24): a later one may have other numbers."""
    head, _, last = release.rpartition(".")
    return f"{head}.{int(last) + 1}"


def quantization_method(cmd: Command, config: Mapping[str, Any] | None) -> str | None:
    """The method the server will load with: --quantization, else the checkpoint's; a ModelOpt
    checkpoint is told apart by its quant_algo (FP8 -> modelopt_fp8 on SGLang, modelopt on vLLM;
    NVFP4 -> modelopt_fp4)."""
    cli = (cmd.value("--quantization") or "").lower().replace("compressed_tensors", "compressed-tensors")
    if cli:
        return cli
    method = checkpoint_quantization(config) if config is not None else None
    if method == "modelopt" and config is not None:
        q = config.get("quantization_config") or text_config(config).get("quantization_config") or {}
        algo = str(q.get("quant_algo", "")).upper() if isinstance(q, Mapping) else ""
        if "FP4" in algo:
            return "modelopt_fp4"
        if "FP8" in algo:
            return "modelopt_fp8" if cmd.server == "sglang" else "modelopt"
    return method


@builtin("quantization-compute-capability", sources={
    "sglang": f"{_SGL}/model_loader/loader.py#L253-L265",
    "vllm": f"{_VLLM}/config/vllm.py#L925-L937"})
def _capability(cmd: Command, info: ModelInfo, facts: RuleFacts) -> Failed | None:
    """The quantization method needs a GPU generation the service's GPUs do not have."""
    hw = facts.hardware
    method = quantization_method(cmd, info.config)
    if hw is None or cmd.server is None or method is None:
        return None
    need = MIN_CAPABILITY[cmd.server].get(method)
    gpus = service_gpus(cmd, hw) or list(hw.gpus)
    caps = [g.compute_capability for g in gpus if g.compute_capability is not None]
    if need is None or not caps:
        return None
    low = min(caps)
    if low[0] * 10 + low[1] >= need:
        return None
    newer = _at_least(facts.version, _next_release(VERIFIED_UP_TO[cmd.server]))
    note = (f" (read in {cmd.server} up to {VERIFIED_UP_TO[cmd.server]}; {facts.version} may differ)"
            if newer else "")
    return Failed(f"quantization {method} needs compute capability {need // 10}.{need % 10} or newer, "
                  f"but the service's GPUs are {low[0]}.{low[1]}: the server fails at load ('The "
                  f"quantization method {method} is not supported for the current GPU. Minimum "
                  f"capability: {need}. Current capability: {low[0]}{low[1]}.'){note}",
                  "use a checkpoint quantized for these GPUs (or unquantized), or GPUs of a newer generation",
                  "warning" if newer else "error")
