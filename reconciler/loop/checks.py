"""Host-side pre-flight: what must hold on the host before a service (re)starts, read in one
round trip and judged purely, so a bad deploy is refused while the old, working version runs.

For the services a plan starts, and the units it writes:
  * systemd's own check of every unit about to be written (`systemd-analyze verify` on a copy
    in a private directory): an unknown key, an invalid value or a missing binary blocks that
    service (UnitInvalid) before its file replaces a working one;
  * the rule pack (reconciler/rules) against the command line and environment systemd will
    really use (the rendered unit plus any drop-in the service allows) and the model's real
    config.json on the host; model completeness (shards) - a failing rule blocks the service
    (PreflightFailed);
  * a missing or incomplete model with `model.fetch` becomes a FETCH action in the plan
    (announced by a dry run); after it ran, the model is checked again;
  * the GPUs: on a host with nvidia-smi every start waits until the GPUs it claims are free
    (`gpu_waiter`, run by the executor between stop and start).

The repo-side half (`preflight.check_desired`) runs in `reconcile validate` and the pre-receive
hook.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..clock import REAL, Clock
from ..desired.spec import HostSpec, ModelSpec, ServiceSpec
from ..frames import HostProgram
from ..host import programs
from ..host.apply import GpuWait
from ..host.engine import check_engines
from ..host.gpu import DEVICE_PREFIX, GpuFacts, Holder, gpu_facts, kill_strays, wait_released
from ..host.transport import Transport
from ..host.versions import VersionRead, Versions, reads_for, unknown
from ..plan.actions import starting, writing_units
from ..plan.facts import HostFacts
from ..plan.facts.gpu import GpuRead
from ..plan.facts.verify import Units, Verified, Verify
from ..plan.files import foreign_dropins, own_files, render_env_dropin
from ..plan.gpuhealth import xid_since
from ..plan.model import Block, Checks, HostPlan
from ..preflight import (
    EngineVerdict,
    Hardware,
    ModelCheck,
    ModelFacts,
    RuleSet,
    check_host,
    engine_run_for,
    gpu_claim,
    parse_command,
    weights_bytes,
)
from .preview import REAL_RUN, EngineCheck

# Rules about which GPUs a service claims: only meaningful on a host that has GPUs to claim
# (a host without nvidia-smi, like the test fleet, reports "no GPUs" and skips them).
GPU_RULES = frozenset({"gpu-overlap", "tp-exceeds-gpus"})
MODEL_RULE_SOURCE = "https://huggingface.co/docs/safetensors (sharded checkpoints: model.safetensors.index.json)"
UNIT_SOURCE = "https://www.freedesktop.org/software/systemd/man/systemd-analyze.html (verify)"


@dataclass
class Preflight:
    """What the host-side pre-flight found: blocks per service, fetches to run, notes, GPUs."""

    blocked: dict[str, list[Block]] = field(default_factory=dict)
    fetch: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    models: dict[str, ModelFacts] = field(default_factory=dict)
    gpu: GpuFacts | None = None
    engine_checks: int = 0          # services with an engine check, run or skipped

    def checks(self) -> Checks:
        return Checks(blocked={n: tuple(b) for n, b in self.blocked.items()}, fetch=dict(self.fetch),
                      gpu_gate=self.gpu is not None and self.gpu.has_nvidia_smi,
                      gpu_health=self.gpu.health if self.gpu is not None else None)

    def block(self, service: str, reason: str, message: str) -> None:
        self.blocked.setdefault(service, []).append(Block(reason, message))


# ---- pre-flight ---------------------------------------------------------------------------------


def effective_spec(svc: ServiceSpec, facts: HostFacts) -> ServiceSpec:
    """The service as systemd will run it once applied: the rendered unit plus the drop-ins it
    allows (every other foreign drop-in is removed by the apply), then our env."""
    f = facts.services.get(svc.name)
    if f is None:
        return svc
    foreign = foreign_dropins(svc, f)
    kept = [c for p, c in sorted(f.dropins.items(), key=lambda kv: kv[0].rsplit("/", 1)[-1])
            if p not in own_files(svc.name) and p not in foreign]
    if not kept:
        return svc
    return replace(svc, unit_text=svc.unit_text + "\n" + "\n".join(kept))


def _units(plan: HostPlan) -> dict[str, tuple[str, str | None]]:
    """The units the plan writes, each with its env drop-in (None when it has no env)."""
    units: dict[str, tuple[str, str | None]] = {}
    for n, u in writing_units(plan).items():
        target = plan.services[n].target
        units[n] = (u, render_env_dropin(n) if target is not None and target.spec.env else None)
    return units


def _batch(units: Units, paths: list[str], gpu: int | None, reads: list[VersionRead]) -> dict[str, HostProgram[Any]]:
    """Every fact the pre-flight reads, by name: one round trip and one sh for all of them
    (programs.run_all)."""
    facts: dict[str, HostProgram[Any]] = {}
    if units:
        facts["verify"] = Verify(units)
    if paths:
        facts["model"] = ModelCheck(paths)
    if gpu is not None:      # the GPUs, and their health with the kernel log since `gpu` (gpuhealth)
        facts["gpu"] = GpuRead(health_since=gpu)
    if reads:
        facts["versions"] = Versions(reads)
    return facts


def _read_units(out: Preflight, verified: Verified) -> None:
    """systemd's verdict on each unit: a unit it rejects blocks its service (UnitInvalid)."""
    if not verified.available:
        out.warnings.append("systemd-analyze not found: units not verified before writing")
    for name, lines in verified.problems.items():
        out.block(name, "UnitInvalid", f"{name}: systemd rejects the unit: " + "; ".join(lines)
                  + f" (source: {UNIT_SOURCE})")


async def _read(t: Transport, out: Preflight, units: Units, paths: list[str], gpu: int | None,
                reads: list[VersionRead]) -> dict[str, str | None]:
    """Read every fact in one round trip and put each into `out`; the read server versions."""
    facts = _batch(units, paths, gpu, reads)
    answers = dict(zip(facts, await programs.run_all(t, list(facts.values()), timeout=120, what="pre-flight"),
                       strict=True))
    versions: dict[str, str | None] = answers.get("versions", {})
    out.warnings.extend(unknown(reads, versions))
    if "verify" in answers:
        _read_units(out, answers["verify"])
    if "gpu" in answers:
        out.gpu = answers["gpu"]
    out.models = answers.get("model", {})
    return versions


def _judge_engines(out: Preflight, verdicts: Mapping[str, EngineVerdict]) -> set[str]:
    """The installed engine's own check of each command line (host/engine.py): a refusal blocks
    the service (EngineRejected), any other answer is a note; the services it answered."""
    for _, v in sorted(verdicts.items()):
        if v.verdict == "rejected":
            out.block(v.service, "EngineRejected", v.block())
        else:
            out.warnings.append(v.note())
    return {v.service for v in verdicts.values() if v.verdict != "inconclusive"}


async def _engines(t: Transport, out: Preflight, host: HostSpec, specs: Mapping[str, ServiceSpec],
                   engine: EngineCheck) -> dict[str, EngineVerdict]:
    """The engine check of each service that has one where the run may run it (preview.py); a
    note for each where it may not."""
    runs = [r for n, s in sorted(specs.items()) if (r := engine_run_for(n, s)) is not None]
    out.engine_checks = len(runs)
    if not engine.run:
        out.warnings.extend(f"{r.service}: engine check skipped ({engine.why}); the static rules decide" for r in runs)
        return {}
    return await check_engines(t, host.name, runs) if runs else {}


async def preflight_host(t: Transport, host: HostSpec, plan: HostPlan, facts: HostFacts, rules: RuleSet | None,
                         *, fetched: Mapping[str, str | None] | None = None,
                         engine: EngineCheck = REAL_RUN) -> Preflight:
    """Check what the plan starts against the host: units, rules, models, GPUs (one round trip),
    then each command line by the installed engine itself (unless the service says
    `engine_check = "off"`, or `engine` says this run may not run it).

    `fetched`: model paths already fetched in this run -> why the fetch failed (None: it ran);
    their models are judged as they are now, never fetched again.
    """
    out = Preflight()
    targets = starting(plan)
    units = _units(plan)
    if not targets and not units:
        return out
    specs = {n: model_from_command(effective_spec(tg.spec, facts)) for n, tg in targets.items()}
    paths = sorted({s.model.path for s in specs.values() if s.model})
    # A rollback target passed health here: a rule pack or an engine that changed since must
    # not keep the fleet from going back to it (systemd's check and the model check still apply).
    fresh = {n: s for n, s in specs.items() if not targets[n].rollback}
    since = xid_since(facts.gpu_fault, facts.record.applied_at if facts.record else 0) if targets else None
    versions = await _read(t, out, units, paths, since, reads_for(specs, rules))
    # The engine check runs after the GPUs were read, never beside: a probe that may touch a GPU
    # (engine_check = "visible") would read as a stray holder of the service's GPUs.
    verdicts = await _engines(t, out, host, fresh, engine)
    _judge_models(out, specs, fetched or {})
    answered = _judge_engines(out, verdicts)
    if rules is not None and targets:
        _judge_rules(out, host, fresh, rules, versions, answered)
    if out.gpu is not None and out.gpu.has_nvidia_smi:
        _judge_strays(out, out.gpu, specs, facts, host)
    return out


def gpu_indexes(h: Holder) -> set[int]:
    """The GPUs a holder is known to use: nvidia-smi's compute contexts, /dev/nvidiaN fds."""
    idx = set(h.gpus)
    for d in h.devices:
        tail = d[len(DEVICE_PREFIX):]
        if d.startswith(DEVICE_PREFIX) and tail.isdigit():
            idx.add(int(tail))
    return idx


def strays_on(gpu: GpuFacts, claimed: set[int] | None, *, own_unit: str, own_pids: set[int],
              managed: set[str]) -> list[Holder]:
    """Compute processes on the GPUs a service claims that are neither its own (by PID or
    cgroup) nor another managed service's. Only processes nvidia-smi lists with GPU memory
    count: a daemon that merely holds /dev/nvidia* open (nvidia-persistenced, an exporter) is
    no stray."""
    out = []
    for h in gpu.holders:
        if h.pid in own_pids or h.unit == own_unit or (h.unit is not None and h.unit in managed):
            continue
        if h.used_mib is None:
            continue
        idx = gpu_indexes(h)
        if claimed is None or idx & claimed:
            out.append(h)
    return out


def _judge_strays(out: Preflight, gpu: GpuFacts, specs: Mapping[str, ServiceSpec], facts: HostFacts,
                  host: HostSpec) -> None:
    """Before anything stops: a stray on a service's claimed GPUs blocks its deploy (policy
    "report"), or is noted for the kill after the stop (policy "kill")."""
    managed = {f"{n}.service" for n in host.services} | {f"{n}.service" for n in facts.inventory}
    for name, svc in sorted(specs.items()):
        f = facts.services.get(name)
        pid = int((f.props.get("ExecMainPID", "0") if f else "0") or 0)
        strays = strays_on(gpu, _claimed_gpus(svc, gpu), own_unit=f"{name}.service", own_pids={pid} - {0},
                           managed=managed - {f"{name}.service"})
        if not strays:
            continue
        what = "; ".join(str(s) for s in strays)
        if svc.gpu_policy == "kill":
            out.warnings.append(f"{name}: stray GPU holder(s) on its GPUs, killed after the stop "
                                f"(gpu_policy = \"kill\"): {what}")
        else:
            out.block(name, "GpuBusy", f"{name}: its GPUs are held by a process that is not a managed service: "
                                       f"{what}. Nothing was stopped. Fix: stop it, or set gpu_policy = \"kill\"")


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def model_from_command(svc: ServiceSpec) -> ServiceSpec:
    """A service without a [model] table, with the model its server's own arguments name
    (`--model-path`, vLLM's positional or `--model`): an absolute path, or a hub id looked up
    in the Hugging Face cache the unit points at. So every model rule and the completeness
    check run on what the server will load, declared or not."""
    if svc.model is not None:
        return svc
    cmd = parse_command(svc)
    m = cmd.model
    if not m:
        return svc
    if m.startswith("/"):
        return replace(svc, model=ModelSpec(id=cmd.value("--served-model-name") or m, path=m))
    if _HUB_ID.match(m):
        hub = cmd.env.get("HF_HUB_CACHE") or cmd.env.get("HF_HOME", "/root/.cache/huggingface") + "/hub"
        return replace(svc, model=ModelSpec(id=m, path=f"{hub}/models--{m.replace('/', '--')}/snapshots/*"))
    return svc


def _judge_models(out: Preflight, specs: Mapping[str, ServiceSpec], fetched: Mapping[str, str | None]) -> None:
    for name, svc in sorted(specs.items()):
        m = svc.model
        facts = out.models.get(m.path) if m else None
        if m is None or facts is None:
            continue
        if "*" in m.path and not facts.exists:
            out.warnings.append(f"{name}: {m.id} is not in the Hugging Face cache ({m.path}): the server "
                                f"downloads it at start, so it is checked only once it is there")
            continue
        if fetched.get(m.path):
            out.block(name, "ModelFetchFailed", f"{name}: {fetched[m.path]}")
            continue
        if facts.complete:
            continue
        if m.fetch and m.path not in fetched:
            out.fetch[name] = f"fetch {m.id} into {m.path} first ({m.fetch})"
            out.models.pop(m.path)       # judged after the fetch, not now
            continue
        out.block(name, "PreflightFailed",
                  f"{name}: model-incomplete: {m.path}: {', '.join(facts.problems())}. "
                  f"Fix: finish the download (or set model.fetch) before deploying (source: {MODEL_RULE_SOURCE})")


def _judge_rules(out: Preflight, host: HostSpec, specs: Mapping[str, ServiceSpec], rules: RuleSet,
                 versions: Mapping[str, str | None], answered: set[str]) -> None:
    """The rule pack; for a service whose engine answered, the shipped flag rules are the
    engine's to judge (they trail it), while built-in checks and the repo's own rules apply."""
    configs = {p: m.config for p, m in out.models.items() if m.config is not None}
    gpu = out.gpu or GpuFacts(has_nvidia_smi=False)
    no_gpus = not gpu.has_nvidia_smi
    if no_gpus:
        out.warnings.append(f"{gpu.summary()}: GPU rules ({', '.join(sorted(GPU_RULES))}) skipped")
    judged = replace(host, services={**host.services, **specs})
    # The memory and compute-capability rules see the GPUs as the GPU gate read them, and each
    # checkpoint's size as the model check read it.
    hardware = Hardware.of(gpu) if gpu.has_nvidia_smi else None
    weights = {p: w for p, m in out.models.items() if (w := weights_bytes(m))}
    for f in check_host(judged, rules=rules, model_configs=configs, gpu_count=gpu.observed_gpu_count,
                        versions=versions, hardware=hardware, weights=weights):
        if f.service not in specs or (no_gpus and f.rule_id in GPU_RULES):
            continue
        if f.service in answered and rules.origin.get(f.rule_id, "").startswith("reconciler/"):
            continue
        if f.blocking:
            out.block(f.service, "PreflightFailed", str(f))
        else:
            out.warnings.append(str(f))


# ---- the GPU gate -------------------------------------------------------------------------------


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


def gpu_waiter(t: Transport, plan: HostPlan, facts: HostFacts, gpu: GpuFacts, notes: list[str],
               *, timeout: float = 120.0, clock: Clock = REAL) -> GpuWait:
    """The executor's wait before a start on a GPU host: the old processes gone and the claimed
    GPUs' memory free (bounded). A stray on the claimed GPUs is reported, and killed only when
    the service's gpu_policy says "kill" (never a process on other GPUs, never another managed
    service). None when free, else why not. `clock`: what the waits are measured on."""
    managed = set(plan.services) | facts.inventory

    async def wait(name: str) -> str | None:
        f = facts.services.get(name)
        pid = int((f.props.get("ExecMainPID", "0") if f else "0") or 0)
        pids = {pid} if pid else set()
        sp = plan.services.get(name)
        svc = sp.target.spec if sp is not None and sp.target is not None else None
        policy = svc.gpu_policy if svc else "report"
        gpus = _claimed_gpus(svc, gpu)
        own = {f"{n}.service" for n in managed - {name}}
        if policy == "kill":
            # Strays were seen before the stop (pre-flight): kill them now, not after a timeout.
            await _kill(name, await gpu_facts(t), gpus, pids, own)
        ok, after, waited = await wait_released(t, pids=pids, timeout=timeout, gpus=gpus, clock=clock)
        strays = strays_on(after, gpus, own_unit=f"{name}.service", own_pids=pids, managed=own)
        for s in strays:
            notes.append(f"{name}: stray GPU holder pid {s.pid} ({s.comm}, {s.used_mib} MiB)")
        if not ok and strays and policy == "kill":
            await _kill(name, after, gpus, pids, own)
            ok, after, more = await wait_released(t, pids=pids, timeout=timeout, gpus=gpus, clock=clock)
            waited += more
        if ok:
            notes.append(f"{name}: GPUs free for the start (waited {waited:.1f}s)")
            return None
        return f"GPUs still busy {waited:.0f}s after stopping {name}: {after.summary()} (stray-process policy {policy})"

    async def _kill(name: str, facts_now: GpuFacts, gpus: set[int] | None, pids: set[int], own: set[str]) -> None:
        strays = strays_on(facts_now, gpus, own_unit=f"{name}.service", own_pids=pids, managed=own)
        for o in await kill_strays(t, strays, "kill", clock=clock):
            notes.append(f"{name}: stray pid {o.holder.pid} ({o.holder.comm}) on its GPUs: {o.outcome}")

    return wait
