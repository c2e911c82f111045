"""The built-in rules: checks that need arithmetic or look across services, in one registry.

A built-in rule is one decorated function; its docstring is the rule's summary::

    @builtin("tp-exceeds-gpus", sources={"sglang": "https://...", "vllm": "https://..."})
    def _gpu_count(cmd: Command, info: ModelInfo, gpu_count: int | None) -> Failed | None:
        \"\"\"The parallel size (tp x pp x dp) exceeds the GPUs the service may use.\"\"\"

`BUILTIN_RULES` is all the rest of the package knows of them: `RuleSet.ids` lists them in the
order they are defined here, `disable = [...]` turns one off by id, a repo rule may not take
an id, and a finding cites the rule's source for the service's server. A check returns what is
wrong (`Failed`) or None; every built-in finding is an error.

scope="service" checks one service: (its command, its model, the host's GPU count or None).
scope="host" checks one service against another service of the same host: (its command, the
other's name, the other's command); it is called for both orders of every pair, so that a
conflict is reported on both services.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, overload

from ._command import PARALLEL_FLAGS, WILDCARD_HOSTS, Command, gpu_claim, gpu_positions
from ._models import ModelInfo, checkpoint_quantization, text_config


class Failed(NamedTuple):
    """What a built-in check found wrong: the message and the fix of its finding."""

    message: str
    fix: str


ServiceCheck = Callable[[Command, ModelInfo, int | None], Failed | None]
HostCheck = Callable[[Command, str, Command], Failed | None]


@dataclass(frozen=True)
class BuiltinRule:
    """A check written in Python (arithmetic, or across services), with its id and sources."""

    id: str
    sources: Mapping[str, str]       # server ("sglang", "vllm", "any") -> URL
    summary: str

    def source(self, server: str | None) -> str:
        """The URL that justifies the rule for this server (else the general one)."""
        return self.sources.get(server or "any") or self.sources.get("any") or next(iter(self.sources.values()))


@dataclass(frozen=True)
class ServiceRule(BuiltinRule):
    """A built-in rule with scope="service"."""

    check: ServiceCheck


@dataclass(frozen=True)
class HostRule(BuiltinRule):
    """A built-in rule with scope="host"."""

    check: HostCheck


BUILTIN_RULES: dict[str, ServiceRule | HostRule] = {}


@overload
def builtin(rule_id: str, *, sources: Mapping[str, str],
            scope: Literal["service"] = "service") -> Callable[[ServiceCheck], ServiceCheck]: ...


@overload
def builtin(rule_id: str, *, sources: Mapping[str, str],
            scope: Literal["host"]) -> Callable[[HostCheck], HostCheck]: ...


def builtin(rule_id: str, *, sources: Mapping[str, str],
            scope: Literal["service", "host"] = "service") -> Callable[[Any], Any]:
    """Register the decorated check as built-in rule `rule_id`, justified by `sources`."""

    def register(check: Callable[..., Failed | None]) -> Callable[..., Failed | None]:
        if rule_id in BUILTIN_RULES:
            raise ValueError(f"built-in rule {rule_id!r} is registered twice")
        summary = (check.__doc__ or "").strip().split("\n")[0]
        kind = ServiceRule if scope == "service" else HostRule
        BUILTIN_RULES[rule_id] = kind(rule_id, sources, summary, check)
        return check

    return register


# The rules, in the order RuleSet.ids lists them.

_SGLANG_ARGS = "https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/server_args.py"
_VLLM_PARALLEL = "https://github.com/vllm-project/vllm/blob/main/vllm/config/parallel.py"
_VLLM_MODEL = "https://github.com/vllm-project/vllm/blob/main/vllm/config/model.py"


@builtin("tp-exceeds-gpus", sources={
    "sglang": "https://github.com/sgl-project/sglang/blob/main/docs/backend/server_arguments.md",
    "vllm": _VLLM_PARALLEL})
def _gpu_count(cmd: Command, info: ModelInfo, gpu_count: int | None) -> Failed | None:
    """The parallel size (tp x pp x dp) exceeds the GPUs the service may use."""
    world = cmd.world_size()
    if world is None or world < 1:
        return None
    visible = cmd.visible_devices
    if visible is not None:
        available, where = len(visible), f"CUDA_VISIBLE_DEVICES lists {len(visible)}"
    elif gpu_count is not None:
        available, where = gpu_count, f"the host has {gpu_count}"
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
def _dp_attention(cmd: Command, info: ModelInfo, gpu_count: int | None) -> Failed | None:
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


@builtin("vllm-tp-divides-attention-heads", sources={"vllm": _VLLM_MODEL})
def _heads(cmd: Command, info: ModelInfo, gpu_count: int | None) -> Failed | None:
    """vLLM needs the attention heads to divide evenly over the tensor-parallel ranks."""
    if cmd.server != "vllm" or info.config is None:
        return None
    heads = text_config(info.config).get("num_attention_heads")
    tp = cmd.int_value("--tensor-parallel-size", 1)
    if not isinstance(heads, int) or isinstance(heads, bool) or heads <= 0 or not tp or tp <= 1:
        return None
    if heads % tp == 0:
        return None
    good = [d for d in range(1, tp) if heads % d == 0]
    return Failed(f"--tensor-parallel-size {tp} does not divide the model's {heads} attention "
                  f"heads (vLLM: 'Total number of attention heads ({heads}) must be divisible "
                  f"by tensor parallel size ({tp})')",
                  f"use a tensor-parallel size that divides {heads} (e.g. {good[-1] if good else 1}), "
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
def _quantization(cmd: Command, info: ModelInfo, gpu_count: int | None) -> Failed | None:
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
