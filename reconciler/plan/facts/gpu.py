"""PURE: who holds the GPUs, is their memory free, and are they healthy (reconciler/sh/gpu.sh).

`GpuRead()` lists the processes that hold /dev/nvidia* open (read from /proc, so no fuser is
needed) with their systemd unit, and, where nvidia-smi exists, each GPU's memory and the compute
processes with their memory; with `health_since`, the GPUs' health too, without a CUDA context
(nvidia-smi -q's health sections, the kernel log's Xid reports, DCGM: plan/gpuhealth.py and
plan/xid.py read them). Its answer is `GpuFacts`. A host without nvidia-smi (such as the test
fleet) gives GpuFacts that say "no GPUs" cleanly. The waits and kills that use it are the
executor's (host/gpu.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import ClassVar

import msgspec

from ...errors import ObserveError
from ...frames import Frame, HostProgram, Param, Records, decode, malformed, number
from ..gpuhealth import SMI_SECTIONS, GpuHealth, dcgm_health, gpu_buses, smi_health
from ..xid import XID_LINES, xid_health

# What gpu.sh asks nvidia-smi, and how it reads the kernel log (its constants)
GPU_FIELDS = "index,uuid,memory.used,memory.total,compute_cap"
OLD_GPU_FIELDS = "index,uuid,memory.used,memory.total"   # drivers without compute_cap
APP_FIELDS = "pid,process_name,used_memory,gpu_uuid"
SMI_FORMAT = "csv,noheader,nounits"
HEALTH_SECTIONS = "|" + "|".join(SMI_SECTIONS) + "|"
# The `journalctl -k -o json` entries gpu.sh keeps: a MESSAGE that opens with an Xid report, matched
# by journalctl (-g, on the field alone), else by grep on each line (a quote inside a JSON value is
# escaped, so a message quoting a report never passes; older systemd wrote `" : "`).
XID_MATCH, XID_FIELDS = r"^NVRM: Xid \(", "MESSAGE,_TRANSPORT,SYSLOG_FACILITY"
XID_GREP = '"MESSAGE" ?: ?"NVRM: Xid \\('
DEVICE_PREFIX = "/dev/nvidia"


class Gpu(msgspec.Struct, frozen=True):
    """One GPU as nvidia-smi reports it. Memory in MiB; None where nvidia-smi says [N/A]."""

    index: int
    used_mib: int | None
    total_mib: int | None
    uuid: str = ""
    compute_capability: str | None = None     # nvidia-smi's compute_cap, e.g. "9.0"; None: unknown


class Holder(msgspec.Struct, frozen=True):
    """A process holding the GPUs: it has /dev/nvidia* open, or nvidia-smi lists it.

    devices are the /dev/nvidia* nodes it holds open (empty when only nvidia-smi saw it, e.g.
    a process in another PID namespace); used_mib is its GPU memory summed over GPUs (None when
    nvidia-smi does not list it); unit is the systemd unit of its cgroup, if any.
    """

    pid: int
    comm: str
    devices: tuple[str, ...] = ()
    used_mib: int | None = None
    unit: str | None = None
    gpus: tuple[int, ...] = ()       # GPU indexes of its compute contexts, per nvidia-smi

    def __str__(self) -> str:
        mem = f"{self.used_mib} MiB" if self.used_mib is not None else "memory n/a"
        devs = " ".join(self.devices) or "no /dev/nvidia* fds seen"
        unit = f", unit {self.unit}" if self.unit else ""
        on = f" on GPU {','.join(str(g) for g in self.gpus)}" if self.gpus else ""
        return f"pid {self.pid} ({self.comm}{unit}): {mem}{on}, {devs}"


class GpuFacts(msgspec.Struct, frozen=True):
    """What the gate saw on one host at one moment."""

    has_nvidia_smi: bool
    gpus: list[Gpu] = msgspec.field(default_factory=list)
    holders: list[Holder] = msgspec.field(default_factory=list)
    error: str | None = None         # nvidia-smi exists but failed (driver not loaded, ...)
    health: GpuHealth | None = None  # the GPUs' health, when it was asked for (GpuRead's health_since)

    @property
    def observed_gpu_count(self) -> int | None:
        """The GPU count to give preflight.check_host: None when it could not be observed (no
        nvidia-smi, as on the test fleet, or nvidia-smi failing), so that GPU-count checks are
        skipped rather than failing every service against 0 GPUs."""
        return len(self.gpus) if self.has_nvidia_smi and not self.error else None

    def holder(self, pid: int) -> Holder | None:
        """The holder with this PID, if it holds the GPUs."""
        return next((h for h in self.holders if h.pid == pid), None)

    def used_over(self, max_used_mib: int, gpus: set[int] | None = None) -> list[Gpu]:
        """GPUs (all, or those indexes) whose memory.used is at or above the threshold."""
        return [g for g in self.gpus if (gpus is None or g.index in gpus)
                and g.used_mib is not None and g.used_mib >= max_used_mib]

    def summary(self) -> str:
        """One line for reports: the GPUs with their memory, and who holds them."""
        if not self.has_nvidia_smi:
            head = "no GPUs (nvidia-smi not found)"
        elif self.error:
            head = f"nvidia-smi failed: {self.error}"
        elif not self.gpus:
            head = "no GPUs (nvidia-smi lists none)"
        else:
            mem = ", ".join(f"{g.index}: {_mib(g.used_mib)}/{_mib(g.total_mib)} MiB" for g in self.gpus)
            head = f"{len(self.gpus)} GPU{'s' if len(self.gpus) != 1 else ''} ({mem})"
        if not self.holders:
            return f"{head}; no process holds /dev/nvidia*"
        return f"{head}; held by " + "; ".join(str(h) for h in self.holders)


def _mib(v: int | None) -> str:
    return "?" if v is None else str(v)


class GpuRead(HostProgram[GpuFacts], frozen=True):
    """reconciler/sh/gpu.sh: the GPUs and their holders; with health_since (host epoch seconds,
    0 for this boot), their health too (nvidia-smi -q, the kernel log's Xid reports since then,
    DCGM): GpuFacts.health. device_prefix: the device nodes' path prefix (a test points it at a
    file of its own, since /dev/nvidia* cannot be made without the driver). Run as root, to see
    every process's fds (others' /proc/PID/fd are unreadable)."""

    name: ClassVar[str] = "gpu"
    in_session: ClassVar[bool] = True      # a lock session's bash runs the pre-flight with no sh of its own
    constants: ClassVar[Mapping[str, str]] = {
        "GPU_FIELDS": GPU_FIELDS, "OLD_GPU_FIELDS": OLD_GPU_FIELDS, "APP_FIELDS": APP_FIELDS, "SMI_FORMAT": SMI_FORMAT,
        "HEALTH_SECTIONS": HEALTH_SECTIONS, "XID_LINES": str(XID_LINES), "XID_MATCH": XID_MATCH,
        "XID_FIELDS": XID_FIELDS, "XID_GREP": XID_GREP}
    health_since: int | None = None
    device_prefix: str = DEVICE_PREFIX

    def __post_init__(self) -> None:
        if any(c.isspace() for c in self.device_prefix) or "\\" in self.device_prefix:
            raise ValueError("device_prefix must not contain whitespace or backslashes")

    def params(self) -> Mapping[str, Param]:
        return {"prefix": self.device_prefix,
                "since": str(max(0, int(self.health_since))) if self.health_since is not None else None}

    def parse(self, answer: Records) -> GpuFacts:
        return parse_gpu(answer.stdout, answer.token, answer.host)


_UNIT = re.compile(r"/([^/\s]+\.(?:service|scope))(?=/|$)")


def unit_of_cgroup(text: str) -> str | None:
    """The systemd unit a process belongs to, from /proc/PID/cgroup (v1 or v2); else None."""
    found: str | None = None
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        units = _UNIT.findall(path)
        if units:
            found = units[-1]        # the innermost unit (a service, not its slice)
            if line.startswith("0::"):
                break                # the unified hierarchy is authoritative
    return found


_NUMBER = re.compile(r"[0-9]{1,15}(?:\.[0-9]{1,9})?")
_WHOLE = 12             # the most digits of a pid, a GPU index or an epoch (frames.number)


def _int(v: str) -> int | None:
    """A number nvidia-smi printed, rounded down; None for "[N/A]" or anything but a plain decimal
    of at most 15 digits (host output is data: never inf, never 400 digits)."""
    return int(float(v.strip())) if _NUMBER.fullmatch(v.strip()) else None


def _text(payload: str) -> str:
    """A comm or cgroup as gpu.sh sends it: - (unreadable), @text, or base64."""
    return "" if payload == "-" else decode(payload)


_EARLY = "GPU check output ended early (is there a POSIX shell?)"


class _GpuReading:
    """parse_gpu's reading of the records: a handler per kind.

    H a process holding a device node (pid, comm, cgroup, nodes); C a compute process's
    cgroup; SMI whether nvidia-smi exists; G and A nvidia-smi's lines (GPUs, compute apps)
    and GRC and ARC its exit statuses. The health: NOW the host's clock, Q the kept lines of
    `nvidia-smi -q` and QRC its status, K a kernel log Xid line and KRC whether the log was
    read (- without journalctl), D a line of `dcgmi health -c` and DRC its status. Other kinds
    (BEGIN) say nothing.
    """

    def __init__(self, host: str) -> None:
        self.host = host
        self.has_smi = False
        self.procs: dict[int, tuple[str, str | None, tuple[str, ...]]] = {}
        self.apps: dict[int, tuple[str, list[int], list[str]]] = {}
        self.app_units: dict[int, str | None] = {}
        self.errors: list[str] = []
        self.gpu_lines: list[str] = []
        self.said: dict[str, list[str]] = {"Q": [], "K": [], "D": []}
        self.rc: dict[str, str] = {}

    def read(self, f: Frame) -> None:
        handler = {"H": self.holder, "C": self.cgroup, "SMI": self.smi, "G": self.gpu, "A": self.app,
                   "GRC": self.status, "ARC": self.status}.get(f.kind)
        if handler is not None:
            handler(f)
        elif f.kind in self.said:
            self.said[f.kind].append(f.payload)
        elif f.kind in ("NOW", "QRC", "KRC", "DRC"):
            self.rc[f.kind] = f.payload.strip()

    def holder(self, f: Frame) -> None:
        parts = f.payload.split()
        if len(parts) < 3 or (pid := number(parts[0], _WHOLE)) is None:
            raise malformed(self.host, "GPU holder", f)
        try:
            comm, cgroup = _text(parts[1]).strip(), _text(parts[2])
        except ValueError:
            raise ObserveError(self.host, "malformed GPU holder line (bad base64)") from None
        self.procs[pid] = (comm, unit_of_cgroup(cgroup), tuple(sorted(set(parts[3:]))))

    def cgroup(self, f: Frame) -> None:
        word, _, cg = f.payload.partition(" ")
        if (pid := number(word, _WHOLE)) is None:
            return
        try:
            self.app_units[pid] = unit_of_cgroup(_text(cg.strip() or "-"))
        except ValueError:
            raise ObserveError(self.host, "malformed GPU cgroup line (bad base64)") from None

    def smi(self, f: Frame) -> None:
        self.has_smi = f.payload.strip() == "1"

    def gpu(self, f: Frame) -> None:
        self.gpu_lines.append(f.payload)

    def app(self, f: Frame) -> None:
        """One line per (process, GPU): a process on several GPUs gets its memory summed."""
        payload = f.payload
        if not payload.strip() or payload.lower().startswith("no running"):
            return
        fields = [x.strip() for x in payload.split(",")]
        if len(fields) < 3 or (pid := number(fields[0], _WHOLE)) is None:
            self.errors.append(payload.strip())
            return
        # process_name may itself hold commas: pid first, memory and uuid last.
        if len(fields) >= 4:
            name, mem, uuid = ",".join(fields[1:-2]), _int(fields[-2]), fields[-1]
        else:
            name, mem, uuid = ",".join(fields[1:-1]), _int(fields[-1]), ""
        entry = self.apps.setdefault(pid, (name, [], []))
        if mem is not None:
            entry[1].append(mem)
        if uuid:
            entry[2].append(uuid)

    def status(self, f: Frame) -> None:
        if f.payload.strip() != "0":
            query = "--query-gpu" if f.kind == "GRC" else "--query-compute-apps"
            self.errors.append(f"{query} exited {f.payload.strip()}")

    def gpus(self) -> list[Gpu]:
        """nvidia-smi's GPU lines (index,uuid,used,total[,compute_cap] or index,used,total); any
        other line is its error message, first among the errors."""
        gpus: list[Gpu] = []
        for payload in self.gpu_lines:
            fields = [x.strip() for x in payload.split(",")]
            index = number(fields[0], _WHOLE)
            if len(fields) in (4, 5) and index is not None:
                cap = fields[-1] if len(fields) == 5 and re.fullmatch(r"[0-9]{1,3}\.[0-9]{1,3}", fields[-1]) else None
                gpus.append(Gpu(index=index, uuid=fields[1], used_mib=_int(fields[2]),
                                total_mib=_int(fields[3]), compute_capability=cap))
            elif len(fields) == 3 and index is not None:
                gpus.append(Gpu(index=index, used_mib=_int(fields[1]), total_mib=_int(fields[2])))
            elif payload.strip():
                self.errors.insert(0, payload.strip())
        return sorted(gpus, key=lambda g: g.index)

    def holders(self, gpus: list[Gpu]) -> list[Holder]:
        """The /proc scan and nvidia-smi's compute apps, by PID: devices from /proc, memory and
        GPUs from nvidia-smi."""
        by_uuid = {g.uuid: g.index for g in gpus if g.uuid}
        out: list[Holder] = []
        for pid in sorted(set(self.procs) | set(self.apps)):
            comm, unit, devices = self.procs.get(pid, ("", self.app_units.get(pid), ()))
            name, mems, uuids = self.apps.get(pid, ("", [], []))
            out.append(Holder(pid=pid, comm=comm or name.rsplit("/", 1)[-1], devices=devices,
                              used_mib=sum(mems) if mems else None, unit=unit,
                              gpus=tuple(sorted({by_uuid[u] for u in uuids if u in by_uuid}))))
        return out

    def health(self) -> GpuHealth | None:
        """The GPUs' health, when gpu.sh read it (a QRC record): faults and signs from nvidia-smi,
        the kernel log and DCGM; not read when nvidia-smi -q failed without saying a GPU is lost."""
        if "QRC" not in self.rc:
            return None
        faults, notes = smi_health("\n".join(self.said["Q"]))
        xf, signs = xid_health(self.said["K"], gpu_buses(self.said["Q"]))
        df, dn = dcgm_health("\n".join(self.said["D"])) if "DRC" in self.rc else ([], [])
        notes += dn + (["kernel log not read (no journalctl)"] if self.rc.get("KRC") == "-" else [])
        read = self.rc["QRC"] == "0" or bool(faults)
        if not read:
            tail = [x.strip() for x in self.said["Q"] if x.strip()][-1:]
            notes.insert(0, f"nvidia-smi -q exited {self.rc['QRC']}" + (f": {tail[0]}" if tail else ""))
        return GpuHealth(read=read, faults=tuple(faults + xf + df), signs=tuple(signs),
                         now=number(self.rc.get("NOW", ""), _WHOLE) or 0, notes=tuple(notes))

    def facts(self) -> GpuFacts:
        gpus = self.gpus()
        error = "; ".join(self.errors[:3]) if self.has_smi and self.errors else None
        return GpuFacts(has_nvidia_smi=self.has_smi, gpus=gpus, holders=self.holders(gpus), error=error,
                        health=self.health())


def parse_gpu(stdout: str, token: str, host: str = "?") -> GpuFacts:
    """Parse the answer of gpu.sh (GpuRead) into GpuFacts (pure).

    Holders are the union of the /proc scan and nvidia-smi's compute apps, sorted by PID; a
    PID seen by both gets its devices from /proc and its memory from nvidia-smi.
    """
    reading = _GpuReading(host)
    for f in Records(stdout, token, host).whole(_EARLY):
        reading.read(f)
    return reading.facts()


