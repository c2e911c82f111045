"""PURE: what a change will cost before it is deployed, and what it cost after (issue 42); what
the dry run prints of it is in docs/drain.md ("The cost, before and after").

A host is unavailable from the moment it leaves rotation (with a drain) or its server stops
(without one) until it rejoins (or, without a drain, until it is ready and judged): every step
of plan/drain.py's `restart_steps` lies in that window, so the forecast is the sum of the
steps' estimates. Each estimate is the host's own last measurement of that step for that
service (ServiceRecord.steps), else: the drain without an in-flight read, its timeout (FIXED);
`ready`, the health check's startup_timeout, an upper bound (BOUND); any other step, 0
(UNMEASURED). After the deploy, `unavailable_seconds` measures the same window from the steps'
times.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from ..desired.spec import ServiceSpec
from .drain import RestartStep, StepKind, restart_steps

MEASURED, FIXED, BOUND, UNMEASURED = "measured", "fixed", "bound", "not measured"


class Part(msgspec.Struct, frozen=True):
    """One step's estimate and what it rests on (measured, fixed, bound, not measured)."""

    step: StepKind
    seconds: float
    basis: str


class HostForecast(msgspec.Struct, frozen=True):
    """A host's forecast unavailable seconds for one service's restart, step by step."""

    host: str
    service: str
    parts: tuple[Part, ...]

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.parts)

    @property
    def measured(self) -> bool:
        """Every step rests on a measurement (or a fixed wait): the forecast is not a guess."""
        return all(p.basis in (MEASURED, FIXED) for p in self.parts)

    def describe(self) -> str:
        """'gpu-1 sglang-qwen: 95s unavailable (drain 12s measured, ready 80s measured, ...)'."""
        shown = ", ".join(f"{p.step.value} {p.seconds:.0f}s {p.basis}" for p in self.parts
                          if p.seconds or p.basis != UNMEASURED)
        head = f"{self.seconds:.0f}s" if self.measured else f"about {self.seconds:.0f}s"
        return f"{self.host} {self.service}: {head} unavailable" + (f" ({shown})" if shown else "")


def forecast_host(host: str, spec: ServiceSpec, measured: Mapping[StepKind, float], *, running: bool = True,
                  gpu_gate: bool = False) -> HostForecast:
    """The forecast of one host's restart of `spec`, from its own last measured step times."""
    return HostForecast(host, spec.name, tuple(_estimate(s, spec, measured)
                                               for s in restart_steps(spec, running=running, gpu_gate=gpu_gate)))


def _estimate(step: RestartStep, spec: ServiceSpec, measured: Mapping[StepKind, float]) -> Part:
    if step.kind in measured:
        return Part(step.kind, max(0.0, measured[step.kind]), MEASURED)
    if step.kind is StepKind.DRAIN and spec.drain is not None and spec.drain.inflight is None:
        return Part(step.kind, spec.drain.timeout, FIXED)
    if step.kind is StepKind.READY:
        return Part(step.kind, spec.health.startup_timeout, BOUND)
    return Part(step.kind, 0.0, UNMEASURED)


class RolloutForecast(msgspec.Struct, frozen=True):
    """A group's forecast: host-seconds of lost capacity, and the wall time of its waves."""

    host_seconds: float
    wall_seconds: float
    hosts: tuple[HostForecast, ...]

    def describe(self) -> str:
        sure = all(h.measured for h in self.hosts)
        about = "" if sure else "about "
        return (f"{about}{self.host_seconds:.0f} host-seconds unavailable over {len(self.hosts)} "
                f"host{'s' * (len(self.hosts) != 1)}, {about}{self.wall_seconds:.0f}s in all")


def forecast_rollout(waves: Sequence[Sequence[str]], hosts: Mapping[str, HostForecast]) -> RolloutForecast:
    """The rollout's cost: the waves run one after another, each as long as its slowest host."""
    wall = sum(max((hosts[h].seconds for h in wave if h in hosts), default=0.0) for wave in waves)
    chosen = tuple(hosts[h] for wave in waves for h in wave if h in hosts)
    return RolloutForecast(sum(h.seconds for h in chosen), wall, chosen)


def unavailable_seconds(steps: Mapping[str, float]) -> float:
    """What a restart cost from its recorded step times (step -> seconds): their sum, the window
    from the leave (or the stop) to the rejoin (or the verdict)."""
    return sum(max(0.0, v) for v in steps.values())


def measured_steps(steps: Mapping[str, float]) -> dict[StepKind, float]:
    """A record's step times (plan/records.ServiceRecord.steps) as the forecast reads them; a
    step this version does not know is left out."""
    known = {k.value: k for k in StepKind}
    return {known[k]: v for k, v in steps.items() if k in known}

