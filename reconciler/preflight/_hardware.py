"""The host's GPUs as the built-in rules see them: memory, holders, compute capability (pure data).

`Hardware` is what the memory and compute-capability rules read. The host side builds it from
what the GPU gate already reads (host/gpu.py's GpuFacts: nvidia-smi's index, uuid, memory.used,
memory.total per GPU and the compute processes with their systemd unit): `Hardware.of(facts)`
takes any object of that shape, and each GPU's `compute_capability` (nvidia-smi's
`compute_cap`, e.g. "9.0") when it carries one. Memory is in MiB, as nvidia-smi reports it.

Who holds a GPU's memory matters: the service being replaced frees its own at the stop, so its
holders (by systemd unit) count as free; a holder whose unit is unknown (nvidia-smi saw it, its
cgroup was not readable, e.g. a process in another PID namespace) may or may not be the
service's, so a verdict that depends on it is only a warning.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ._command import Command, gpu_positions
from ._hostcheck import ModelFacts

Capability = tuple[int, int]


class GpuState(msgspec.Struct, frozen=True):
    """One GPU: its memory (MiB; None where nvidia-smi says [N/A]) and compute capability."""

    index: int
    total_mib: int | None
    used_mib: int | None
    uuid: str = ""
    compute_capability: Capability | None = None


class GpuHolder(msgspec.Struct, frozen=True):
    """A process with GPU memory: its systemd unit (None: unknown), its memory summed over its
    GPUs (None: nvidia-smi did not list it) and the indexes of those GPUs."""

    unit: str | None
    used_mib: int | None
    gpus: tuple[int, ...] = ()


class Hardware(msgspec.Struct, frozen=True):
    """The GPUs of one host and who holds their memory, at one moment."""

    gpus: tuple[GpuState, ...] = ()
    holders: tuple[GpuHolder, ...] = ()

    @classmethod
    def of(cls, facts: Any) -> Hardware:
        """From host/gpu.py's GpuFacts, or anything with its shape: `.gpus` (index, total_mib,
        used_mib, uuid, and optionally compute_capability as a (major, minor) tuple or
        nvidia-smi's "9.0") and `.holders` (unit, used_mib, gpus)."""
        gpus = tuple(GpuState(index=g.index, total_mib=g.total_mib, used_mib=g.used_mib,
                              uuid=getattr(g, "uuid", "") or "",
                              compute_capability=capability(getattr(g, "compute_capability", None)))
                     for g in facts.gpus)
        holders = tuple(GpuHolder(unit=h.unit, used_mib=h.used_mib, gpus=tuple(h.gpus))
                        for h in facts.holders)
        return cls(gpus=gpus, holders=holders)

    def held(self, index: int, unit: str | None) -> int:
        """MiB a unit's processes hold on one GPU (a holder on several GPUs: its memory split
        evenly, since nvidia-smi's per-process figure is summed over them); unit None: the
        holders whose unit is unknown."""
        total = 0.0
        for h in self.holders:
            if h.unit == unit and h.used_mib is not None and index in h.gpus:
                total += h.used_mib / len(h.gpus)
        return int(total)


def capability(value: object) -> Capability | None:
    """A compute capability from (major, minor) or nvidia-smi's compute_cap text ("8.9"); else None."""
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return (value[0], value[1])
    if isinstance(value, str):
        major, dot, minor = value.strip().partition(".")
        if dot and major.isdigit() and minor.isdigit():
            return (int(major), int(minor))
    return None


def service_gpus(cmd: Command, hw: Hardware) -> list[GpuState] | None:
    """The GPUs the server's ranks will run on (the first world-size of CUDA_VISIBLE_DEVICES or
    of the host's GPUs, or SGLang's --base-gpu-id placement); None when that cannot be told
    (a size that is not a number, an id nvidia-smi does not list, too few GPUs)."""
    world = cmd.world_size()
    if world is None or world < 1 or not hw.gpus:
        return None
    by_id = {str(g.index): g for g in hw.gpus} | {g.uuid: g for g in hw.gpus if g.uuid}
    order = cmd.visible_devices
    ids = order if order is not None else [str(g.index) for g in sorted(hw.gpus, key=lambda g: g.index)]
    positions = gpu_positions(cmd, world) or list(range(world))
    if positions[-1] >= len(ids):
        return None
    picked = [by_id.get(ids[p]) for p in positions]
    return [g for g in picked if g is not None] if all(g is not None for g in picked) else None


def weights_bytes(facts: ModelFacts | None) -> int | None:
    """The checkpoint's size: its index's metadata.total_size, else the sum of its weight files'
    sizes (None when any is unreadable or there are none)."""
    if facts is None:
        return None
    if facts.total_size:
        return facts.total_size
    known = [s for s in facts.files.values() if s is not None]
    return sum(known) if known and len(known) == len(facts.files) else None
