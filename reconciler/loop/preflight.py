"""Host-side pre-flight: what must hold on the host before a service (re)starts, read in one
round trip (loop/checks.py) and judged purely, so a bad deploy is refused while the old, working
version runs.

For the services a plan starts, and the units it writes:
  * systemd's own check of every unit about to be written: an unknown key, an invalid value or
    a missing binary blocks that service (UnitInvalid) before its file replaces a working one;
  * the rule pack (reconciler/rules) against the command line and environment systemd will
    really use (the rendered unit plus any drop-in the service allows) and the model's real
    config.json on the host; model completeness (shards) - a failing rule blocks the service
    (PreflightFailed);
  * the installed engine's own check of each command line (EngineRejected), where the run may
    run it (preview.py);
  * a missing or incomplete model with `model.fetch` is a fetch for the planner (Checks.fetch:
    a FETCH action, or a block when the disk cannot hold it); after it ran, the model is
    checked again;
  * the server's version (read from its interpreter's files, in the same round trip): for the
    rules bound to versions, and for every SGLang service, whose release decides what says it
    is ready once started (`ready_probes`: /ready from 0.5.20);
  * the GPUs: a stray on a service's claimed GPUs blocks it before anything stops (GpuBusy),
    unless its gpu_policy is "kill"; on a host with nvidia-smi every start then waits until the
    GPUs it claims are free (the gate: loop/gpu_gate.py, run by the executor between stop and start).

The repo-side half (`preflight.check_desired`) runs in `reconcile validate` and the pre-receive
hook.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping

from ..desired.spec import HostSpec, ModelSpec, ServiceSpec
from ..host.engine import Ask, EngineAnswer, answered, ask, probe, verdict_cache
from ..host.gpu import GpuFacts
from ..host.transport import Transport
from ..host.versions import bound, reads_for, unknown
from ..plan.actions import starting
from ..plan.facts import HostFacts
from ..plan.files import foreign_dropins, own_files, render_env_dropin
from ..plan.gpuhealth import xid_since
from ..plan.layout import unit_path
from ..plan.model import HostPlan, Kind, ModelFetch
from ..plan.ready import Probe, readiness_probes
from ..preflight import (
    EngineVerdict,
    Hardware,
    ModelCheck,
    RuleSet,
    check_host,
    engine_run_for,
    parse_command,
    weights_bytes,
)
from ..reasons import Reason
from ..values import replace
from .checks import Preflight, _read
from .gpu_gate import claimed_gpus, main_pids, strays_on
from .preview import REAL_RUN, EngineCheck

# Rules about which GPUs a service claims: only meaningful on a host that has GPUs to claim
# (a host without nvidia-smi, like the test fleet, reports "no GPUs" and skips them).
GPU_RULES = frozenset({"gpu-overlap", "tp-exceeds-gpus"})
MODEL_RULE_SOURCE = "https://huggingface.co/docs/safetensors (sharded checkpoints: model.safetensors.index.json)"


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
    """The units the plan writes (what systemd must accept before the rename), each with its env
    drop-in (None when it has no env)."""
    units: dict[str, tuple[str, str | None]] = {}
    for a in plan.actions:
        if a.kind is Kind.WRITE and a.service and a.content is not None and a.path == unit_path(a.service):
            target = plan.services[a.service].target
            units[a.service] = (a.content, render_env_dropin(a.service) if target is not None and target.spec.env
                                else None)
    return units


def _judge_engines(out: Preflight, verdicts: Mapping[str, EngineVerdict]) -> set[str]:
    """The installed engine's own check of each command line (host/engine.py): a refusal blocks
    the service (EngineRejected), any other answer is a note; the services it answered."""
    for _, v in sorted(verdicts.items()):
        if v.verdict == "rejected":
            out.block(v.service, Reason.ENGINE_REJECTED, v.block())
        else:
            out.warnings.append(v.note())
    return {v.service for v in verdicts.values() if v.verdict != "inconclusive"}


def _asks(out: Preflight, host: HostSpec, specs: Mapping[str, ServiceSpec], engine: EngineCheck) -> list[Ask]:
    """The engine check of each service that has one where the run may run it (preview.py); a
    note for each where it may not."""
    runs = [r for n, s in sorted(specs.items()) if (r := engine_run_for(n, s)) is not None]
    out.engine_checks = len(runs)
    if not engine.run:
        out.warnings.extend(f"{r.service}: engine check skipped ({engine.why}); the static rules decide" for r in runs)
        return []
    store = verdict_cache()
    return [ask(host.name, r, store) for r in runs]


def _riding(asks: list[Ask]) -> Ask | None:
    """The one probe that rides the pre-flight's round trip: where a host asks one engine (the
    common case), one round trip and one sh fewer. Several run side by side, each in a round
    trip of its own (a probe imports its engine: 8-15 s each)."""
    probes = [a for a in asks if a.probe is not None]
    return probes[0] if len(probes) == 1 else None


async def _engines(t: Transport, host: HostSpec, asks: list[Ask], riding: Ask | None,
                   answer: EngineAnswer | None) -> dict[str, EngineVerdict]:
    """Each asked service's verdict: the riding probe's from its answer, the others' from
    their own round trips (engine.probe), the cache saved once after."""
    if not asks:
        return {}
    store = verdict_cache()
    if riding is not None:
        assert answer is not None          # it rode the round trip: its answer came with the rest
        verdicts = [a.early for a in asks if a.early is not None] + [answered(host.name, riding, answer, store)]
    else:
        verdicts = await asyncio.gather(*(probe(t, host.name, a, store) for a in asks))
    store.save()
    return {v.service: v for v in verdicts}


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
    # A rollback target passed health here: a rule pack or an engine that changed since must
    # not keep the fleet from going back to it (systemd's check and the model check still apply).
    fresh = {n: s for n, s in specs.items() if not targets[n].rollback}
    since = xid_since(facts.gpu_fault, facts.record.applied_at if facts.record else 0) if targets else None
    reads = reads_for(specs, rules)     # every SGLang server's too: its release decides what ready reads
    # The engine check runs after the GPUs were read, never beside: a probe that may touch a GPU
    # (engine_check = "visible") would read as a stray holder of the service's GPUs. One probe
    # rides the same round trip, after the GPU read (checks._batch).
    asks = _asks(out, host, fresh, engine)
    riding = _riding(asks)
    ride = riding.probe if riding is not None else None
    versions, answer = await _read(t, out, units, _model_check(specs), since, reads, ride,
                                   ride.timeout() if ride else 0)
    if bound(rules):
        out.warnings.extend(unknown(reads, versions))
    verdicts = await _engines(t, host, asks, riding, answer)
    _judge_models(out, specs, fetched or {})
    engine_answered = _judge_engines(out, verdicts)
    if rules is not None and targets:
        _judge_rules(out, host, fresh, rules, versions, engine_answered)
    if out.gpu is not None and out.gpu.has_nvidia_smi:
        _judge_strays(out, out.gpu, specs, facts, host)
    return out


def ready_probes(svc: ServiceSpec, facts: HostFacts | None,
                 versions: Mapping[str, str | None]) -> tuple[tuple[Probe, ...], str | None]:
    """What says `svc` is ready once started (plan/ready.py), from the server its effective
    command line runs and the version the pre-flight read; with a note when that server is an
    SGLang whose version is not known, so its health.http judges it instead of /ready."""
    spec = effective_spec(svc, facts) if facts is not None else svc
    server = parse_command(spec).server
    version = versions.get(svc.name)
    probes = readiness_probes(server, version, svc.health)
    note = None
    if server == "sglang" and version is None and svc.health.http:
        note = (f"{svc.name}: the installed sglang version was not read: ready is judged by its "
                f"health.http ({svc.health.http}), not by /ready (SGLang 0.5.20 and later)")
    return probes, note


def _judge_strays(out: Preflight, gpu: GpuFacts, specs: Mapping[str, ServiceSpec], facts: HostFacts,
                  host: HostSpec) -> None:
    """Before anything stops: a stray on a service's claimed GPUs blocks its deploy (policy
    "report"), or is noted for the kill after the stop (policy "kill")."""
    managed = set(host.services) | facts.inventory
    for name, svc in sorted(specs.items()):
        strays = strays_on(gpu, claimed_gpus(svc, gpu), name, main_pids(facts, name), managed)
        if not strays:
            continue
        what = "; ".join(str(s) for s in strays)
        if svc.gpu_policy == "kill":
            out.warnings.append(f"{name}: stray GPU holder(s) on its GPUs, killed after the stop "
                                f"(gpu_policy = \"kill\"): {what}")
        else:
            out.block(name, Reason.GPU_BUSY, f"{name}: its GPUs are held by a process that is not a managed service: "
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


def _model_check(specs: Mapping[str, ServiceSpec]) -> ModelCheck | None:
    """The model directories the services load (None: none), with the free space of those a
    fetch may fill (df runs for nothing else)."""
    models = [s.model for s in specs.values() if s.model]
    paths = sorted({m.path for m in models})
    return ModelCheck(paths, sorted({m.path for m in models if m.fetch})) if paths else None


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
            out.block(name, Reason.MODEL_FETCH_FAILED, f"{name}: {fetched[m.path]}")
            continue
        if facts.complete:
            continue
        if m.fetch and m.path not in fetched:
            out.fetch[name] = ModelFetch(m, facts.total_size, facts.free_bytes)
            out.models.pop(m.path)       # judged after the fetch, not now
            continue
        out.block(name, Reason.PREFLIGHT_FAILED,
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
            out.block(f.service, Reason.PREFLIGHT_FAILED, str(f))
        else:
            out.warnings.append(str(f))
