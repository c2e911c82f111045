"""The GPU gate's executor on one host: what host/apply runs between a start's stop and the
start itself, as the plan says (plan/actions.py: KILL_STRAYS where the service's gpu_policy is
"kill", then WAIT_GPUS): the old processes gone and the claimed GPUs' memory free, within a
bound. A stray (a compute process on the claimed GPUs that is neither the service's own nor
another managed service's) is reported, and killed only where the plan has a KILL_STRAYS for the
service; never a process on other GPUs, never another managed service. The gate's answer (None:
free, else why not) is a fact: when the GPUs stay busy, the apply stops there, and the next
round's plan records the start as blocked (Checks.gate: plan/state.py, plan/actions.py).
"""

from __future__ import annotations

from ..clock import REAL, Clock
from ..desired.spec import ServiceSpec
from ..host.gpu import DEVICE_PREFIX, GpuFacts, Holder, gpu_facts, kill_strays, wait_released
from ..host.transport import Transport
from ..plan.facts import HostFacts
from ..plan.model import Action, HostPlan, Kind
from ..preflight import gpu_claim, parse_command

WAIT = 120.0      # seconds a start waits for its GPUs before the gate gives up


def gpu_indexes(h: Holder) -> set[int]:
    """The GPUs a holder is known to use: nvidia-smi's compute contexts, /dev/nvidiaN fds."""
    tails = (d[len(DEVICE_PREFIX):] for d in h.devices if d.startswith(DEVICE_PREFIX))
    return set(h.gpus) | {int(tail) for tail in tails if tail.isdigit()}


def main_pids(facts: HostFacts, name: str) -> set[int]:
    """A service's own PIDs as `facts` read them: its main process (none where it runs none)."""
    f = facts.services.get(name)
    return {f.unit.exec_main_pid} - {0} if f is not None else set()


def strays_on(gpu: GpuFacts, claimed: set[int] | None, name: str, own_pids: set[int],
              managed: set[str]) -> list[Holder]:
    """Compute processes on the GPUs service `name` claims that are neither its own (by PID or
    cgroup) nor another managed service's (`managed`: the host's service names). Only processes
    nvidia-smi lists with GPU memory count: a daemon that merely holds /dev/nvidia* open
    (nvidia-persistenced, an exporter) is no stray."""
    units = {f"{n}.service" for n in managed} | {f"{name}.service"}
    return [h for h in gpu.holders if h.used_mib is not None and h.pid not in own_pids and h.unit not in units
            and (claimed is None or gpu_indexes(h) & claimed)]


def claimed_gpus(svc: ServiceSpec | None, gpu: GpuFacts) -> set[int] | None:
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


class GpuGate:
    """Runs a plan's KILL_STRAYS and WAIT_GPUS steps on one host (host/apply.GpuWait): each call
    answers None when done (the GPUs free for the start), else why not. What it saw and did goes
    to `notes`. `clock`: what the waits are measured on (a test's virtual one)."""

    def __init__(self, t: Transport, plan: HostPlan, facts: HostFacts, gpu: GpuFacts, *, timeout: float = WAIT,
                 clock: Clock = REAL):
        self.t, self.plan, self.facts, self.gpu, self.timeout, self.clock = t, plan, facts, gpu, timeout, clock
        self.kills = frozenset(a.service for a in plan.actions if a.kind is Kind.KILL_STRAYS and a.service)
        self.managed = set(plan.services) | facts.inventory
        self.notes: list[str] = []

    def _service(self, name: str) -> tuple[set[int], set[int] | None]:
        """A service's own PIDs (its main process before the stop) and the GPUs it claims (None: all)."""
        sp = self.plan.services.get(name)
        svc = sp.target.spec if sp is not None and sp.target is not None else None
        return main_pids(self.facts, name), claimed_gpus(svc, self.gpu)

    def _strays(self, name: str, now: GpuFacts) -> list[Holder]:
        """The strays on a service's GPUs in `now` (strays_on); other managed services' are none."""
        pids, gpus = self._service(name)
        return strays_on(now, gpus, name, pids, self.managed)

    async def __call__(self, a: Action) -> str | None:
        """Run one gate step of the plan."""
        assert a.service is not None
        if a.kind is Kind.KILL_STRAYS:
            # Strays were seen before the stop (pre-flight): killed now, not after a time-out.
            await self._kill(a.service, await gpu_facts(self.t))
            return None
        return await self._wait(a.service)

    async def _wait(self, name: str) -> str | None:
        pids, gpus = self._service(name)
        ok, after, waited = await wait_released(self.t, pids=pids, timeout=self.timeout, gpus=gpus, clock=self.clock)
        strays = self._strays(name, after)
        for s in strays:
            self.notes.append(f"{name}: stray GPU holder pid {s.pid} ({s.comm}, {s.used_mib} MiB)")
        if not ok and strays and name in self.kills:
            await self._kill(name, after)
            ok, after, more = await wait_released(self.t, pids=pids, timeout=self.timeout, gpus=gpus,
                                                  clock=self.clock)
            waited += more
        if ok:
            self.notes.append(f"{name}: GPUs free for the start (waited {waited:.1f}s)")
            return None
        policy = "kill" if name in self.kills else "report"
        return f"GPUs still busy {waited:.0f}s after stopping {name}: {after.summary()} (stray-process policy {policy})"

    async def _kill(self, name: str, now: GpuFacts) -> None:
        for o in await kill_strays(self.t, self._strays(name, now), "kill", clock=self.clock):
            self.notes.append(f"{name}: stray pid {o.holder.pid} ({o.holder.comm}) on its GPUs: {o.outcome}")
