"""What the host-side pre-flight reads, in one round trip, and the findings it reads into.

Every fact the pre-flight needs is a host program (frames.HostProgram), and all of them go to
the host as one sh (`_batch`, host/programs.run_all): systemd's own check of every unit about
to be written (plan/facts/verify.py: `systemd-analyze verify` on a copy in a private
directory), the models' files (preflight/_hostcheck.py), the GPUs and their health
(plan/facts/gpu.py) and the servers' versions (plan/facts/versions.py); `_read` puts each
answer into a `Preflight`. What the findings mean (the rules, the models, the engine check, the
strays) is judged in loop/preflight.py; the GPU gate's executor is loop/gpu_gate.py.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..frames import HostProgram
from ..host import programs
from ..host.gpu import GpuFacts
from ..host.transport import Transport
from ..host.versions import VersionRead, Versions
from ..plan.facts.gpu import GpuRead
from ..plan.facts.verify import Units, Verified, Verify
from ..plan.model import Block, Checks, ModelFetch
from ..preflight import ModelCheck, ModelFacts
from ..reasons import Reason

UNIT_SOURCE = "https://www.freedesktop.org/software/systemd/man/systemd-analyze.html (verify)"


class Preflight(msgspec.Struct):
    """What the host-side pre-flight found: blocks per service, fetches to run, notes, GPUs."""

    blocked: dict[str, list[Block]] = msgspec.field(default_factory=dict)
    fetch: dict[str, ModelFetch] = msgspec.field(default_factory=dict)
    warnings: list[str] = msgspec.field(default_factory=list)
    models: dict[str, ModelFacts] = msgspec.field(default_factory=dict)
    gpu: GpuFacts | None = None
    engine_checks: int = 0          # services with an engine check, run or skipped
    versions: dict[str, str | None] = msgspec.field(default_factory=dict)   # service -> its server's version, as read

    def checks(self) -> Checks:
        return Checks(blocked={n: tuple(b) for n, b in self.blocked.items()}, fetch=dict(self.fetch),
                      gpu_gate=self.gpu is not None and self.gpu.has_nvidia_smi,
                      gpu_health=self.gpu.health if self.gpu is not None else None)

    def block(self, service: str, reason: Reason, message: str) -> None:
        self.blocked.setdefault(service, []).append(Block(reason, message))


# ---- the one round trip -------------------------------------------------------------------------


def _batch(units: Units, model: ModelCheck | None, gpu: int | None, reads: list[VersionRead],
           engine: HostProgram[Any] | None = None) -> dict[str, HostProgram[Any]]:
    """Every fact the pre-flight reads, by name: one round trip and one sh for all of them
    (programs.run_all). `engine`: an engine check that rides along, last: after the GPU read (a
    probe that may touch a GPU must never read as a stray holder of the service's GPUs), and
    reading its probe program, the end of the round trip's stdin, only where it runs it."""
    facts: dict[str, HostProgram[Any] | None] = {
        "verify": Verify(units) if units else None, "model": model,
        # the GPUs, and their health with the kernel log since `gpu` (gpuhealth)
        "gpu": GpuRead(health_since=gpu) if gpu is not None else None,
        "versions": Versions(reads) if reads else None, "engine": engine}
    return {name: program for name, program in facts.items() if program is not None}


def _read_units(out: Preflight, verified: Verified) -> None:
    """systemd's verdict on each unit: a unit it rejects blocks its service (UnitInvalid)."""
    if not verified.available:
        out.warnings.append("systemd-analyze not found: units not verified before writing")
    for name, lines in verified.problems.items():
        out.block(name, Reason.UNIT_INVALID, f"{name}: systemd rejects the unit: " + "; ".join(lines)
                  + f" (source: {UNIT_SOURCE})")


async def _read(t: Transport, out: Preflight, units: Units, model: ModelCheck | None, gpu: int | None,
                reads: list[VersionRead], engine: HostProgram[Any] | None = None,
                engine_seconds: float = 0) -> tuple[dict[str, str | None], Any]:
    """Read every fact in one round trip and put each into `out`; the read server versions (the
    caller warns about those it could not read where that matters: loop/preflight.py), and the
    answer of `engine` (None where there is none; it may take `engine_seconds` more)."""
    facts = _batch(units, model, gpu, reads, engine)
    answers = dict(zip(facts, await programs.run_all(t, list(facts.values()), timeout=120 + engine_seconds,
                                                     what="pre-flight"), strict=True))
    versions: dict[str, str | None] = answers.get("versions", {})
    out.versions = dict(versions)
    if "verify" in answers:
        _read_units(out, answers["verify"])
    out.gpu = answers.get("gpu", out.gpu)
    out.models = answers.get("model", {})
    return versions, answers.get("engine")
