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

import base64
import contextlib
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from .. import shell
from ..clock import REAL, Clock
from ..desired.spec import HostSpec, ModelSpec, ServiceSpec
from ..frames import Frame, frames
from ..host.apply import GpuWait
from ..host.engine import check_engines
from ..host.gpu import DEVICE_PREFIX, GpuFacts, Holder, gpu_command, gpu_facts, kill_strays, parse_gpu, wait_released
from ..host.transport import Transport
from ..host.versions import Probe, probe_command, probes_for, read_versions
from ..plan.actions import starting, writing_units
from ..plan.facts import ENV_DROPIN, HostFacts
from ..plan.files import foreign_dropins, own_files, render_env_dropin
from ..plan.gpuhealth import xid_since
from ..plan.model import Block, Checks, HostPlan
from ..preflight import (
    EngineVerdict,
    Hardware,
    ModelFacts,
    RuleSet,
    check_host,
    engine_run_for,
    gpu_claim,
    model_check_command,
    parse_command,
    parse_model_check,
    weights_bytes,
)
from ..reasons import Reason
from ..shell import ShCommand, one_sh
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

    def block(self, service: str, reason: Reason, message: str) -> None:
        self.blocked.setdefault(service, []).append(Block(reason, message))


# ---- systemd's own check of a unit ----------------------------------------------------------------

def _lines(text: str) -> tuple[int, str]:
    """A text as the verify script's `put` reads it: how many pieces it has between newlines, and
    those pieces each on a line of its own (so a missing final newline stays missing)."""
    pieces = text.split("\n")
    return len(pieces), "".join(p + "\n" for p in pieces)


def verify_command(units: Mapping[str, tuple[str, str | None]], token: str | None = None) -> tuple[ShCommand, str, str]:
    """The command that has systemd check each unit (service -> (unit text, env drop-in or None))
    under a throw-away name, so no live drop-in of the real unit is mixed in: reconciler/sh/verify.sh.

    The unit and drop-in texts come on stdin as plain lines, counted (never on a command line,
    never decoded by another process); they are written byte for byte by the shell itself.
    Returns (command, stdin, token)."""
    token = token or secrets.token_hex(8)
    names = {name: f"reconciler-verify-{secrets.token_hex(4)}-{name}" for name in units}
    head = [secrets.token_hex(8)] + [names[n] for n, (_, env) in sorted(units.items()) if env]
    parts = [" ".join(head) + "\n"]
    for name, (unit, env) in sorted(units.items()):
        nunit, unit_lines = _lines(unit)
        nenv, env_lines = _lines(env) if env else ("-", "")
        parts.append(f"{name} {names[name]} {nunit} {nenv}\n{unit_lines}{env_lines}")
    return ShCommand(shell.program("verify"), "reconciler-verify", [token]), "".join(parts), token


_LINE_REF = re.compile(r"^(?P<file>/\S+?):(?P<line>[0-9]{1,9}): (?P<msg>.*)$")


def _problem(msg: str, unit: str, env: str | None) -> str | None:
    """One line of systemd-analyze's about the unit we would write (None: about another unit on
    the host), with the offending line quoted where it names one."""
    if "reconciler-verify-" not in msg:
        return None
    m = _LINE_REF.match(msg.strip())
    if not m:
        return re.sub(r"reconciler-verify-[0-9a-f]+-", "", msg.strip())
    dropin = m.group("file").endswith(".conf")
    lines = ((env if dropin else unit) or "").splitlines()
    n = int(m.group("line"))
    quoted = f" (`{lines[n - 1].strip()}`)" if 0 < n <= len(lines) else ""
    where = f"{ENV_DROPIN} line {n}" if dropin else f"line {n}"
    return f"{where}: {m.group('msg')}{quoted}"


class _Verdicts:
    """parse_verify's reading of the records: O a line of systemd-analyze's output, B all of it
    in base64, V its exit status for a service (`V - -`: there is no systemd-analyze)."""

    def __init__(self, units: Mapping[str, tuple[str, str | None]]) -> None:
        self.units = units
        self.out: dict[str, list[str]] = {}
        self.available = True
        self.said: dict[str, list[str]] = {}        # service -> systemd-analyze's output lines so far

    def read(self, f: Frame) -> None:
        fields = f.fields(2)
        if len(fields) != 2:
            return
        name, rest = fields
        if f.kind == "O":
            self.said.setdefault(name, []).append(rest)
        elif f.kind == "B":
            with contextlib.suppress(ValueError):     # not base64 (binascii.Error is one): said nothing
                self.said.setdefault(name, []).append(base64.b64decode(rest, validate=True).decode(errors="replace"))
        elif f.kind == "V":
            self.verdict(name, rest)

    def verdict(self, name: str, rc: str) -> None:
        if name == "-":
            self.available = False
            return
        unit, env = self.units.get(name, ("", None))
        said = "\n".join(self.said.pop(name, []))
        problems = [p for msg in said.splitlines() if (p := _problem(msg, unit, env)) is not None]
        if rc != "0" and not problems:
            problems.append(f"systemd-analyze verify exited {rc}")
        if problems:
            self.out[name] = problems


def parse_verify(stdout: str, token: str,
                 units: Mapping[str, tuple[str, str | None]]) -> tuple[dict[str, list[str]], bool]:
    """Pure: service -> what systemd objects to in its unit (each with the offending line quoted);
    and whether systemd-analyze was there at all."""
    verdicts = _Verdicts(units)
    for f in frames(stdout, token):
        verdicts.read(f)
    return verdicts.out, verdicts.available


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


def _batch(units: Mapping[str, tuple[str, str | None]], paths: list[str], gpu: int | None,
           probes: list[Probe]) -> tuple[ShCommand, str | None, dict[str, str]]:
    """Every fact the pre-flight reads, as one sh (one round trip, one process: one_sh): the
    command, its stdin (the units to verify), and the token each fact's parser reads by."""
    facts: dict[str, tuple[ShCommand, str]] = {}
    stdin = None
    if units:
        cmd, stdin, token = verify_command(units)
        facts["verify"] = (cmd, token)
    if paths:
        facts["model"] = model_check_command(paths)
    if gpu is not None:      # the GPUs, and their health with the kernel log since `gpu` (gpuhealth)
        facts["gpu"] = gpu_command(health_since=gpu)
    if probes:
        facts["versions"] = probe_command(probes)
    tokens = {fact: token for fact, (_, token) in facts.items()}
    return one_sh([cmd for cmd, _ in facts.values()], "reconciler-preflight"), stdin, tokens


def _read_versions(out: Preflight, probes: list[Probe], stdout: str, token: str) -> dict[str, str | None]:
    """The server version of each probed service (None: unknown), as the host's files say."""
    versions, warnings = read_versions(probes, stdout, token)
    out.warnings.extend(warnings)
    return versions


def _read_units(out: Preflight, units: Mapping[str, tuple[str, str | None]], stdout: str, token: str) -> None:
    """systemd's verdict on each unit: a unit it rejects blocks its service (UnitInvalid)."""
    problems, available = parse_verify(stdout, token, units)
    if not available:
        out.warnings.append("systemd-analyze not found: units not verified before writing")
    for name, lines in problems.items():
        out.block(name, Reason.UNIT_INVALID, f"{name}: systemd rejects the unit: " + "; ".join(lines)
                  + f" (source: {UNIT_SOURCE})")


async def _read(t: Transport, out: Preflight, host: HostSpec, units: Mapping[str, tuple[str, str | None]],
                paths: list[str], gpu: int | None, probes: list[Probe]) -> dict[str, str | None]:
    """Read every fact in one round trip and parse each into `out`; the probed server versions."""
    cmd, stdin, tokens = _batch(units, paths, gpu, probes)
    res = await t.run(cmd, input=stdin, check=True, timeout=120, what="pre-flight")
    versions = _read_versions(out, probes, res.stdout, tokens["versions"]) if probes else {}
    if units:
        _read_units(out, units, res.stdout, tokens["verify"])
    if gpu is not None:
        out.gpu = parse_gpu(res.stdout, tokens["gpu"], host.name)
    out.models = parse_model_check(res.stdout, tokens["model"], host.name) if paths else {}
    return versions


def _judge_engines(out: Preflight, verdicts: Mapping[str, EngineVerdict]) -> set[str]:
    """The installed engine's own check of each command line (host/engine.py): a refusal blocks
    the service (EngineRejected), any other answer is a note; the services it answered."""
    for _, v in sorted(verdicts.items()):
        if v.verdict == "rejected":
            out.block(v.service, Reason.ENGINE_REJECTED, v.block())
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
    versions = await _read(t, out, host, units, paths, since, probes_for(specs, rules))
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
        pid = f.unit.exec_main_pid if f is not None else 0
        strays = strays_on(gpu, _claimed_gpus(svc, gpu), own_unit=f"{name}.service", own_pids={pid} - {0},
                           managed=managed - {f"{name}.service"})
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
            out.fetch[name] = f"fetch {m.id} into {m.path} first ({m.fetch})"
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
        pid = f.unit.exec_main_pid if f is not None else 0
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
