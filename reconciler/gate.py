"""Pre-flight gates: the rule pack, model presence and the GPU state, applied before any
service is (re)started, so a bad deploy is refused while the old, working service still runs.

Two places:
  * `check_desired(state, rules)`: no host needed; what the repo declares (model id, declared
    architecture). Used by `reconcile validate` and so by the pre-receive hook.
  * `preflight_host(t, host, services, rules)`: one extra round trip, only when a plan starts or
    restarts services: the models' config.json and shard list from the host, and the GPUs.
    A failing rule or an incomplete model blocks that service's deploy; nothing is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import Problem
from .gpu import GpuFacts, gpu_command, parse_gpu
from .preflight import Finding, ModelFacts, RuleSet, check_host, model_check_command, parse_model_check
from .spec import DesiredState, HostSpec
from .transport import Transport

MODEL_RULE_SOURCE = "https://huggingface.co/docs/safetensors (sharded checkpoints: model.safetensors.index.json)"


def check_desired(state: DesiredState, rules: RuleSet) -> tuple[list[Problem], list[str]]:
    """Run every rule on what the repo declares. Returns (blocking problems, warnings)."""
    problems: list[Problem] = []
    warnings: list[str] = []
    for name, host in sorted(state.hosts.items()):
        for f in check_host(host, rules=rules, model_configs={}, gpu_count=None):
            where = f"services.{f.service}"
            text = f"{f.rule_id}: {f.message.rstrip('.')}. Fix: {f.fix.rstrip('.')} (source: {f.source})"
            if f.blocking:
                problems.append(Problem(host.source or f"hosts/{name}.toml", where, text))
            else:
                warnings.append(f"{host.source}: {where}: warning: {text}")
    return problems, warnings


@dataclass
class Preflight:
    """What the host-side pre-flight found: blocking findings per service, models, GPUs."""

    blocked: dict[str, list[str]] = field(default_factory=dict)     # service -> reasons (one line each)
    warnings: list[str] = field(default_factory=list)
    models: dict[str, ModelFacts] = field(default_factory=dict)
    gpu: GpuFacts | None = None


async def preflight_host(t: Transport, host: HostSpec, services: set[str], rules: RuleSet) -> Preflight:
    """Check the services about to (re)start against their real models and the host's GPUs."""
    out = Preflight()
    if not services:
        return out
    paths = sorted({s.model.path for n, s in host.services.items() if n in services and s.model})
    gcmd, gtok = gpu_command()
    cmds = [gcmd]
    mtok = ""
    if paths:
        mcmd, mtok = model_check_command(paths)
        cmds.insert(0, mcmd)
    res = await t.run("; ".join(cmds), check=True, timeout=60, what="pre-flight")
    out.gpu = parse_gpu(res.stdout, gtok, host.name)
    out.models = parse_model_check(res.stdout, mtok, host.name) if paths else {}
    configs = {p: m.config for p, m in out.models.items() if m.config is not None}
    for f in check_host(host, rules=rules, model_configs=configs, gpu_count=out.gpu.observed_gpu_count):
        if f.service not in services:
            continue
        if f.blocking:
            out.blocked.setdefault(f.service, []).append(str(f))
        else:
            out.warnings.append(str(f))
    for name in sorted(services):
        svc = host.services.get(name)
        m = out.models.get(svc.model.path) if svc and svc.model else None
        if m is not None and m.problems():
            out.blocked.setdefault(name, []).append(
                f"{name}: model-incomplete: {svc.model.path}: {', '.join(m.problems())}. "
                f"Fix: finish the download (or set model.fetch) before deploying (source: {MODEL_RULE_SOURCE})")
    return out
