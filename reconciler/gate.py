"""Pre-flight gates: the rule pack, model presence and the GPU state, applied before any
service is (re)started, so a bad deploy is refused while the old, working service still runs.

The host-side half (the repo-side half, `preflight.check_desired`, runs in `reconcile validate`
and the pre-receive hook):
  * `preflight_host(t, host, services, rules)`: one extra round trip, only when a plan starts or
    restarts services: the models' config.json and shard list from the host, and the GPUs.
    A failing rule or an incomplete model blocks that service's deploy; nothing is written.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .apply import apply_plan
from .errors import CommandError
from .facts import HostFacts
from .gpu import GpuFacts, gpu_command, kill_strays, parse_gpu, stray_holders, wait_released
from .plan import HostPlan, Kind, split_for_gate
from .preflight import (ModelFacts, RuleSet, check_host, gpu_claim, model_check_command, parse_command,
                        parse_model_check)
from .spec import HostSpec, ModelSpec, ServiceSpec
from .transport import Transport

# Rules about which GPUs a service claims: only meaningful on a host that has GPUs to claim
# (a host without nvidia-smi, like the test fleet, reports "no GPUs" and skips them).
GPU_RULES = frozenset({"gpu-overlap", "tp-exceeds-gpus"})
MODEL_RULE_SOURCE = "https://huggingface.co/docs/safetensors (sharded checkpoints: model.safetensors.index.json)"


@dataclass
class Preflight:
    """What the host-side pre-flight found: blocking findings per service, models, GPUs."""

    blocked: dict[str, list[str]] = field(default_factory=dict)     # service -> reasons (one line each)
    warnings: list[str] = field(default_factory=list)
    models: dict[str, ModelFacts] = field(default_factory=dict)
    gpu: GpuFacts | None = None


Progress = Callable[[str, str, float, float], None]   # service, phase, elapsed, timeout


async def fetch_model(t: Transport, service: str, model: ModelSpec, facts: ModelFacts,
                      on_phase: Progress | None = None) -> str | None:
    """Run model.fetch on the host (before anything is stopped). Returns why it failed, or None.

    Checks free disk space first when the size is known (model.size_gb, or the index's
    total_size), then runs the command in the model directory with model.fetch_timeout.
    """
    need = model.size_gb * 1e9 if model.size_gb else facts.total_size
    if need and facts.free_bytes is not None and facts.free_bytes < need:
        return (f"model-fetch: not enough disk for {model.id} at {model.path}: needs {need / 1e9:.1f} GB, "
                f"{facts.free_bytes / 1e9:.1f} GB free")
    cmd = f"mkdir -p {shlex.quote(model.path)} && cd {shlex.quote(model.path)} && {model.fetch}"
    started = time.monotonic()

    async def tick() -> None:
        while True:
            if on_phase:
                on_phase(service, f"fetching {model.id}", time.monotonic() - started, model.fetch_timeout)
            await asyncio.sleep(1.0)
    ticker = asyncio.create_task(tick())
    try:
        res = await t.run(cmd, timeout=model.fetch_timeout, what=f"fetch {model.id}")
    except CommandError as e:
        return f"model-fetch: {model.fetch!r} did not finish within {model.fetch_timeout:.0f}s: {e.stderr}"
    finally:
        ticker.cancel()
    if not res.ok:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        return f"model-fetch: {model.fetch!r} failed (exit {res.exit_status}): {' / '.join(tail)}"
    return None


async def preflight_host(t: Transport, host: HostSpec, services: set[str], rules: RuleSet,
                         on_phase: Progress | None = None, allow_fetch: bool = True) -> Preflight:
    """Check the services about to (re)start against their real models and the host's GPUs.

    A missing or incomplete model with `model.fetch` is downloaded first, while the old
    version keeps serving; with allow_fetch=False (a dry run) it is only announced.
    """
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
    fetched: dict[str, str | None] = {}
    for name in sorted(services):
        m = host.services[name].model if name in host.services else None
        if m is None or not m.fetch or m.path in fetched or not out.models.get(m.path, None) \
                or out.models[m.path].complete:
            continue
        if not allow_fetch:
            out.warnings.append(f"would fetch {m.id} into {m.path} first ({m.fetch})")
            out.models.pop(m.path)          # judged after the fetch, not now
            continue
        fetched[m.path] = await fetch_model(t, name, m, out.models[m.path], on_phase)
        out.warnings.append(fetched[m.path] or f"fetched {m.id} into {m.path}")
    if fetched:
        mcmd, mtok = model_check_command(sorted(fetched))
        again = await t.run(mcmd, check=True, timeout=60, what="model check")
        out.models.update(parse_model_check(again.stdout, mtok, host.name))
    for name in sorted(services):
        m = host.services[name].model if name in host.services else None
        if m is not None and fetched.get(m.path):
            out.blocked.setdefault(name, []).append(f"{name}: {fetched[m.path]}")
    configs = {p: m.config for p, m in out.models.items() if m.config is not None}
    no_gpus = not out.gpu.has_nvidia_smi
    if no_gpus:
        out.warnings.append(f"{out.gpu.summary()}: GPU rules ({', '.join(sorted(GPU_RULES))}) skipped")
    for f in check_host(host, rules=rules, model_configs=configs, gpu_count=out.gpu.observed_gpu_count):
        if f.service not in services or (no_gpus and f.rule_id in GPU_RULES):
            continue
        if f.blocking:
            out.blocked.setdefault(f.service, []).append(str(f))
        else:
            out.warnings.append(str(f))
    for name in sorted(services):
        svc = host.services.get(name)
        m = out.models.get(svc.model.path) if svc and svc.model else None
        if m is not None and m.problems() and not fetched.get(m.path):
            out.blocked.setdefault(name, []).append(
                f"{name}: model-incomplete: {svc.model.path}: {', '.join(m.problems())}. "
                f"Fix: finish the download (or set model.fetch) before deploying (source: {MODEL_RULE_SOURCE})")
    return out


@dataclass
class GateResult:
    """What the GPU gate did: when the apply began (host clock), services it kept from
    starting (service -> why), and notes (strays found, how long the release took)."""

    applied_at: float | None = None
    blocked: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _claimed_gpus(svc: ServiceSpec | None, gpu: GpuFacts) -> set[int] | None:
    """GPU indexes a service claims (CUDA_VISIBLE_DEVICES ids or uuids), or None for all."""
    if svc is None:
        return None
    claim = gpu_claim(parse_command(svc))
    if claim is None:
        return None
    out: set[int] = set()
    for c in claim:
        if c.isdigit():
            out.add(int(c))
        else:
            out |= {g.index for g in gpu.gpus if g.uuid == c}
    return out or None


async def gated_apply(t: Transport, plan: HostPlan, facts: HostFacts, host: HostSpec, gpu: GpuFacts | None,
                      *, timeout: float = 120.0) -> GateResult:
    """Apply a plan; on a host with GPUs, restarts become stop -> GPUs released -> start.

    After the stop it waits (bounded) until the old processes are gone and memory is free on
    the GPUs the service claims. A stray holder that is not the service's is reported, and
    killed only when the service's gpu_policy says "kill". If the GPUs stay busy, the service is
    not started.
    """
    restarting = {a.service for a in plan.actions if a.kind is Kind.RESTART and a.service}
    if gpu is None or not gpu.has_nvidia_smi or not restarting:
        return GateResult(await apply_plan(t, plan))
    first, second = split_for_gate(plan, restarting)
    res = GateResult(await apply_plan(t, first))
    for name in sorted(restarting):
        f = facts.services.get(name)
        pid = int((f.props.get("ExecMainPID", "0") if f else "0") or 0)
        pids = {pid} if pid else set()
        svc = host.services.get(name)
        policy = svc.gpu_policy if svc else "report"
        gpus = _claimed_gpus(svc, gpu)
        ok, after, waited = await wait_released(t, pids=pids, timeout=timeout, gpus=gpus)
        strays = stray_holders(after, pids, {f"{name}.service"})
        for s in strays:
            res.notes.append(f"{name}: stray GPU holder pid {s.pid} ({s.comm}, {s.used_mib} MiB)")
        if not ok and strays and policy == "kill":
            outcomes = await kill_strays(t, strays, "kill")
            res.notes += [f"{name}: stray pid {o.holder.pid}: {o.outcome}" for o in outcomes]
            ok, after, more = await wait_released(t, pids=pids, timeout=timeout, gpus=gpus)
            waited += more
        if ok:
            res.notes.append(f"{name}: GPUs released {waited:.1f}s after the stop")
        else:
            res.blocked[name] = (f"GPUs still busy {waited:.0f}s after stopping {name}: {after.summary()}"
                                 f" (stray-process policy {policy})")
    keep = tuple(a for a in second.actions if not (a.kind is Kind.START and a.service in res.blocked))
    from dataclasses import replace
    await apply_plan(t, replace(second, actions=keep))
    return res
