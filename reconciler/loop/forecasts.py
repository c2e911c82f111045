"""PURE: what a dry run shows of a restart's cutover and its cost (issue 42): each restarted
service's steps (plan/drain.py `restart_steps`: the drain, the smoke test, the rejoin) and its
forecast unavailable seconds from this host's own last measured step times (the service's
record; plan/forecast.py), and per rollout the host-seconds and wall time of its waves.

Shown for the services that declare a drain, a smoke test or a min_available: the rest restart
as they always have (stop, start, health), and their plans say so.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..desired.spec import ServiceSpec
from ..plan.drain import RestartStep, StepKind, restart_steps
from ..plan.forecast import HostForecast, forecast_host, forecast_rollout, measured_steps
from ..plan.model import Kind
from ..plan.ready import ready_detail
from ..plan.rollout import RolloutResult
from ..values import replace
from .results import HostResult


def host_forecasts(r: HostResult) -> dict[str, tuple[list[str], HostForecast]]:
    """Service -> (its restart's steps as lines, its forecast) for each service the host's plan
    restarts with a cutover declared."""
    out: dict[str, tuple[list[str], HostForecast]] = {}
    if r.plan is None:
        return out
    running = {a.service for a in r.plan.actions if a.kind in (Kind.STOP, Kind.RESTART)}
    for name in dict.fromkeys(r.plan.restarts):
        sp = r.plan.services.get(name)
        if sp is None or sp.target is None:
            continue
        spec = sp.target.spec
        if spec.drain is None and spec.smoke is None and spec.rollout.min_available is None:
            continue        # no cutover declared: it restarts as it always has
        gate = any(a.kind is Kind.WAIT_GPUS and a.service == name for a in r.plan.actions)
        f = r.facts.services.get(name) if r.facts is not None else None
        measured = measured_steps(f.record.steps) if f is not None and f.record is not None else {}
        steps = _reads(r, spec, restart_steps(spec, running=name in running, gpu_gate=gate,
                                              rollback=sp.target.rollback))
        out[name] = ([s.describe() for s in steps],
                     forecast_host(r.host, spec, measured, running=name in running, gpu_gate=gate))
    return out


def _reads(r: HostResult, spec: ServiceSpec, steps: Sequence[RestartStep]) -> list[RestartStep]:
    """The steps, the ready step naming what ready reads on this host (its engine and the
    release its pre-flight read: loop/preflight.py `ready_probes`)."""
    from .preflight import ready_probes
    probes, _ = ready_probes(spec, r.facts, r.checked.versions if r.checked is not None else {})
    return [replace(s, detail=ready_detail(probes, spec.health)) if s.kind is StepKind.READY else s for s in steps]


def host_lines(r: HostResult) -> list[str]:
    """A host's cutover lines for a dry run: each service's steps, then its forecast."""
    lines: list[str] = []
    for name, (steps, forecast) in host_forecasts(r).items():
        lines.append(f"  {name} restarts:")
        lines += [f"    {s}" for s in steps]
        lines.append(f"    forecast: {forecast.describe()}")
    return lines


def rollout_line(ro: RolloutResult, hosts: list[HostResult]) -> str | None:
    """The rollout's forecast cost for a dry run (None: its service declares no cutover)."""
    svc = ro.plan.group.service
    each = {r.host: fc for r in hosts if (fc := host_forecasts(r).get(svc)) is not None}
    if not each:
        return None
    return "forecast: " + forecast_rollout([w.hosts for w in ro.plan.waves],
                                           {h: fc for h, (_, fc) in each.items()}).describe()
