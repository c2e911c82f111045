"""PURE: a sick GPU is the host's fault, not the commit's.

What the GPU read (host/gpu.py, sh/gpu.sh) says about the GPUs' health, read without a CUDA
context, and what the planner makes of it. What it reads (`nvidia-smi -q`'s health sections,
the kernel log's Xid reports, read in xid.py for a GPU nvidia-smi lists here: `gpu_buses`, and
DCGM's health watches) is in docs/health.md#sick-gpus-the-hosts-fault-not-the-commits.

A reading has faults (a start must not happen on this host: it blocks, and a failed start that
coincides with one is the GPU's), signs (a hardware memory event in the kernel log's window
that NVIDIA says needs no reset, Xid 63/92/94: a failed start that coincides with one is the
GPU's too, but nothing is blocked for it) and notes (states that neither block nor explain a
failure, since they may be weeks old and NVIDIA says new work may start: a row remap pending
the next reset, a DCGM warning; shown, nothing more). `in_force` decides the host's GpuFault
from the recorded one and a fresh reading; `blames_gpu` whether a failed start was the GPU's.
The fault is kept on the host in /var/lib/reconciler/gpu-fault.json (`GpuFault`), cleared by
the next healthy reading, by removing that file, or passed over once by `reconcile --retry`;
while no reading can be made (nvidia-smi -q failing without saying why) it stays, for at most
MARK_EXPIRES after it was recorded (`in_force`, `mark_note`).
Every reader is total: any text gives a value, with numbers and lengths bounded.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from ..reasons import Reason
from .lenient import json_or_none
from .xid import bus_key
from .xid import xid_health as xid_health  # the kernel log's reader, for gpuhealth's callers

GPU_FAULT = Reason.GPU_FAULT
# The sections of `nvidia-smi -q` (under each GPU) that say its health: what gpu.sh keeps.
SMI_SECTIONS = ("ECC Errors", "Retired Pages", "Remapped Rows", "GPU Reset Status", "GPU Recovery Action")
FAULT_FILE = "/var/lib/reconciler/gpu-fault.json"
# "Row-remapping pending flag ... new workloads can be launched": a pending remap is a note only
REMAP_SOURCE = "https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/error-recovery-and-response-flags.html"

# Start failures a GPU fault can explain (health.py's reasons for a start that did not come up).
BLAMABLE = frozenset({Reason.CRASH_LOOP, Reason.START_FAILED, Reason.START_TIMEOUT, Reason.EXITED, Reason.UNSTABLE})

_LONGEST = 8192            # the longest quote a record of ours holds (an Xid message and the catalog's words)
MARK_EXPIRES = 24 * 3600   # a mark outlives no reading for longer than this (seconds, host clock)
# A GPU's PCI bus id as nvidia-smi writes it (`GPU 00000000:18:00.0`, `... for GPU0000:3B:00.0: GPU is lost`)
_BUS = re.compile(r"GPU ?(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})\.[0-7](?![0-9A-Za-z])")
# nvidia-smi's answers for a GPU it cannot use (NVML_ERROR_GPU_IS_LOST, NVML_ERROR_RESET_REQUIRED)
_LOST = re.compile(r"GPU is lost|GPU requires reset|fallen off the bus", re.I)


class GpuHealth(msgspec.Struct, frozen=True):
    """One reading of the GPUs' health: `read` when nvidia-smi -q answered (or said a GPU is
    lost); faults block starts, signs only explain a failed one, notes do neither; `now` is the
    host's clock."""

    read: bool
    faults: tuple[str, ...] = ()
    signs: tuple[str, ...] = ()
    now: int = 0
    notes: tuple[str, ...] = ()

    @property
    def healthy(self) -> bool:
        return self.read and not self.faults

    def summary(self) -> str:
        if not self.read:
            return "GPU health not read" + (f" ({'; '.join(self.notes)})" if self.notes else "")
        if self.faults:
            return "; ".join(self.faults)
        found = self.signs + self.notes
        return "GPUs healthy" + (f" ({'; '.join(found)})" if found else "")


class GpuFault(msgspec.Struct, frozen=True):
    """A host whose GPUs are sick (gpu-fault.json): the line that says so, and when (host clock).
    `service`/`revision`: the start that failed with it (None: seen before a start)."""

    quote: str
    at: int = 0
    lines: tuple[str, ...] = ()
    service: str | None = None
    revision: str | None = None

    def why(self) -> str:
        what = f"{self.service} {self.revision[:7]} failed to start" if self.service and self.revision else \
            "seen before a start"
        return f"GPU fault ({what}): {self.quote}"

    def to_json(self) -> dict[str, Any]:
        return {"quote": self.quote, "at": self.at, "lines": list(self.lines), "service": self.service,
                "revision": self.revision}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, data: object) -> GpuFault | None:
        """The record, or None where it is not one (a quote longer than any we write is not ours)."""
        if not isinstance(data, Mapping) or not isinstance(q := data.get("quote"), str) or not 0 < len(q) <= _LONGEST:
            return None
        at, lines = data.get("at"), data.get("lines")
        svc, rev = data.get("service"), data.get("revision")
        return cls(quote=q, at=at if isinstance(at, int) and not isinstance(at, bool) and 0 <= at < 2 ** 40 else 0,
                   lines=tuple(x for x in lines[:5] if isinstance(x, str) and len(x) <= _LONGEST)
                   if isinstance(lines, list) else (),
                   service=svc if isinstance(svc, str) and len(svc) <= 255 else None,
                   revision=rev if isinstance(rev, str) and len(rev) <= 64 else None)

    @classmethod
    def parse(cls, text: str) -> GpuFault:
        """Read leniently (total); a file that is not a fault record still says the host was
        marked: it stays marked (with that said) until cleared."""
        return cls.from_json(json_or_none(text)) or cls(quote="unreadable gpu-fault.json")


# ---- the readers ----------------------------------------------------------------------------------


def _tree(lines: Iterable[str]) -> list[tuple[str, list[tuple[tuple[str, ...], str | None]]]]:
    """`nvidia-smi -q` text -> [(GPU header, [(path of section names, value or None)])]: each
    `Key : value` line under the sections that hold it, by indentation."""
    gpus: list[tuple[str, list[tuple[tuple[str, ...], str | None]]]] = []
    stack: list[tuple[int, str]] = []
    for raw in lines:
        line = raw.rstrip()
        if not line.strip():
            continue
        if line.startswith("GPU ") and ":" in line and " : " not in line:
            gpus.append((line[4:].strip(), []))
            stack = []
            continue
        if not gpus:
            continue
        indent = len(line) - len(line.lstrip())
        key, sep, value = line.strip().partition(" : ")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = (*(k for _, k in stack), key.strip())
        gpus[-1][1].append((path, value.strip() if sep else None))
        if not sep:
            stack.append((indent, key.strip()))
    return gpus


def _count(v: str | None) -> int:
    try:
        return int(v or "")
    except ValueError:
        return 0          # N/A, [Not Supported], "Requested functionality has been deprecated"


# The Yes/No fields of `nvidia-smi -q` that say a GPU is sick: (section, field) -> what a "Yes"
# says. Those of "ECC Errors" count only directly under it (its Volatile counters: _finding).
_FLAGS: Mapping[tuple[str, str], str] = {
    ("ECC Errors", "Unrepairable Memory"): "fault",        # driver 580 on an H200, say
    ("ECC Errors", "Channel Repair Pending"): "note",      # a repair that waits for the next reset, as a remap
    ("ECC Errors", "TPC Repair Pending"): "note",
    ("Retired Pages", "Pending Page Blacklist"): "fault",
    ("Retired Pages", "Pending"): "fault",
    ("Remapped Rows", "Remapping Failure Occurred"): "fault",
    ("Remapped Rows", "Pending"): "note",                 # new work may start (REMAP_SOURCE)
    ("GPU Reset Status", "Reset Required"): "fault",
    ("GPU Reset Status", "Drain and Reset Recommended"): "fault",
}


def _finding(path: tuple[str, ...], value: str) -> str | None:
    """What one `nvidia-smi -q` field says of its GPU: "fault", "note" or None."""
    head, last = path[0], path[-1]
    if head == "GPU Recovery Action":
        # The driver's action (the section's own value): a fault unless it says none is needed,
        # or that the driver does not report it.
        quiet = value in ("None", "N/A", "") or value.startswith("Requested functionality")
        return None if len(path) != 1 or quiet else "fault"
    if head == "ECC Errors" and len(path) >= 2 and path[1] == "Volatile":
        # A counter since the driver loaded: a fault when it counts an uncorrectable error
        # (Ampere and newer: SRAM/DRAM Uncorrectable ...; older GPUs: Double Bit / Total).
        older = len(path) == 4 and path[2] == "Double Bit" and last == "Total"
        return "fault" if ("Uncorrectable" in last or older) and _count(value) > 0 else None
    said = _FLAGS.get((head, last))
    if said is None or (head == "ECC Errors" and len(path) != 2):
        return None
    return said if value.strip().lower() == "yes" else None


def smi_health(text: str) -> tuple[list[str], list[str]]:
    """Faults and notes in `nvidia-smi -q` output (pure): one line per finding, naming the GPU by
    its PCI bus id and quoting nvidia-smi's field as it prints it."""
    faults = [f"nvidia-smi: {line.strip()}" for line in text.splitlines() if _LOST.search(line)]
    notes: list[str] = []
    for bus, fields in _tree(text.splitlines()):
        for path, value in fields:
            found = _finding(path, value) if value is not None else None
            said = f"GPU {bus}: {' / '.join(path)}: {value}"
            if found == "fault":
                faults.append(said)
            elif found == "note":
                notes.append(f"{said} (it waits for a GPU reset)")
    return faults, notes


def gpu_buses(lines: Iterable[str]) -> frozenset[str]:
    """The bus ids of the host's GPUs in the kept `nvidia-smi -q` lines (pure, bus_key): each GPU's
    header (`GPU 00000000:18:00.0`), and a GPU nvidia-smi says is lost (it lists it no more)."""
    found: set[str] = set()
    for line in lines:
        if line.startswith("GPU ") or (not line.startswith(" ") and _LOST.search(line)):
            m = _BUS.search(line)
            if m is not None:
                found.add(bus_key(m.group("bus")))
    return frozenset(found)


_CELL = re.compile(r"^\|\s*(?P<left>[^|]*?)\s*\|\s*(?P<right>[^|]*?)\s*\|$")


def dcgm_health(text: str) -> tuple[list[str], list[str]]:
    """`dcgmi health -c` (pure): (faults, notes). Its Overall Health row says Healthy, Warning or
    Failure; the incidents' lines that follow it are quoted. A Failure is a fault, a Warning a
    note, and so is a check that did not run (no watches set, no host engine)."""
    overall: str | None = None
    said: list[str] = []
    for line in text.splitlines():
        m = _CELL.match(line.strip())
        if m is None:
            if line.strip().startswith("Error"):
                return [], [f"dcgmi health: {line.strip()}"]
            continue
        left, right = m.group("left"), m.group("right")
        if left == "Overall Health":
            overall = right
        elif overall is not None and right and right not in ("Healthy", "Warning", "Failure"):
            said.append(right)
    if overall is None or overall == "Healthy":
        return [], []
    line = f"dcgmi health: Overall Health {overall}" + (f": {' '.join(said)}" if said else "")
    return ([line], []) if overall == "Failure" else ([], [line])


# ---- the decisions --------------------------------------------------------------------------------


def expired(recorded: GpuFault, reading: GpuHealth) -> bool:
    """A mark that no reading could confirm or clear for MARK_EXPIRES since it was recorded (host
    clock): nvidia-smi -q has failed since, without saying a GPU is lost (pure)."""
    return not reading.read and reading.now > 0 and reading.now - recorded.at >= MARK_EXPIRES


def in_force(recorded: GpuFault | None, reading: GpuHealth | None, *, retry: bool = False) -> GpuFault | None:
    """The host's GPU fault that blocks every start now (pure).

    No reading (nothing starts, so nothing was read): none; the recorded one stays on the host.
    A reading that could not be made (nvidia-smi failing): the recorded one stays in force, since
    only a healthy reading clears it, but for at most MARK_EXPIRES after it was recorded: a host
    is not held forever on a fault nothing confirms (`expired`). A reading with faults: a fault
    dated now (the recorded one's start kept when it is the same). A healthy reading: none
    (cleared). `retry` (reconcile --retry): the operator passes over it once.
    """
    if retry or reading is None:
        return None
    if not reading.read:
        return None if recorded is None or expired(recorded, reading) else recorded
    if not reading.faults:
        return None
    if recorded is not None and recorded.quote in reading.faults:
        return recorded
    return GpuFault(quote=reading.faults[0], at=reading.now, lines=reading.faults[:5])


def recorded_after(recorded: GpuFault | None, reading: GpuHealth | None) -> GpuFault | None:
    """What gpu-fault.json holds after a reading before a start (pure): the fault it found, none
    after a healthy one or once the mark expired, the recorded one when there was no reading.
    --retry passes over a fault; it never clears one."""
    return in_force(recorded, reading) if reading is not None else recorded


def mark_note(recorded: GpuFault | None, kept: GpuFault | None, reading: GpuHealth | None) -> str | None:
    """What the report says when a reading changed gpu-fault.json (pure); None when it did not."""
    if kept == recorded:
        return None
    if kept is not None:
        return f"GPU fault recorded: {kept.quote}"
    was = recorded.quote if recorded is not None else ""
    if recorded is not None and reading is not None and expired(recorded, reading):
        why = reading.notes[0] if reading.notes else "GPU health not read"
        return (f"GPU fault mark expired: no reading has confirmed or cleared it for {MARK_EXPIRES // 3600} h "
                f"({why}); starts are allowed again (was: {was})")
    return f"GPU fault cleared: the GPUs read healthy (was: {was})"


def blames_gpu(reason: str, healthy: bool, reading: GpuHealth | None) -> bool:
    """A failed start is the GPU's when a fault or a sign coincides with it (pure); a note (a remap
    pending for weeks, a DCGM warning) never blames the GPU for a failure that is the commit's."""
    return not healthy and reason in BLAMABLE and reading is not None and bool(reading.faults or reading.signs)


def start_fault(reading: GpuHealth, service: str, revision: str) -> GpuFault:
    """The host's fault after a start that failed with the GPUs sick: the first fault (or sign)."""
    found = reading.faults + reading.signs
    return GpuFault(quote=found[0], at=reading.now, lines=found[:5], service=service, revision=revision)


def xid_since(recorded: GpuFault | None, applied_at: int) -> int:
    """Since when a reading before a start reads the kernel log (host epoch; 0: this boot): since
    the recorded fault (its own lines are not read again, so a healthy GPU clears it), else since
    the last apply on the host (a GPU that faulted while the running version ran)."""
    return recorded.at + 1 if recorded is not None and recorded.at else applied_at
