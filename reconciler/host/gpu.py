"""The GPU gate before a model server (re)starts: who holds the GPUs, and is their memory free.

Like facts.py, a command plus a pure parser: `gpu_command()` lists the processes that hold
/dev/nvidia* open (read from /proc, so no fuser is needed) with their systemd unit, and, where
nvidia-smi exists, each GPU's memory and the compute processes with their memory;
`parse_gpu()` turns that into `GpuFacts`. A host without nvidia-smi (such as the test fleet)
gives GpuFacts that say "no GPUs" cleanly.

On top: `gpu_facts(t)`, `wait_released(t, pids=...)` (after a stop, bounded: the old
processes are gone and the memory is back), `stray_holders(facts, ...)` (holders that are not
the service's) and `kill_strays(t, holders, policy)` ("report" never kills; "kill" sends
SIGTERM, then SIGKILL after a grace period).

This module needs nothing outside the standard library: it talks to any object with the shape
of transport.Transport's `run` (the `Runner` protocol below), so bench/gpu_gate_device.py can
run it on a GPU machine that has no pydantic or asyncssh.
"""

from __future__ import annotations

import re
import secrets
import shlex
from dataclasses import dataclass, field
from typing import Literal, Protocol

from .. import shell
from ..clock import REAL, Clock
from ..errors import ObserveError
from ..frames import Frame, decode, frames, malformed
from ..plan.gpuhealth import SMI_SECTIONS, GpuHealth, dcgm_health, gpu_buses, smi_health
from ..plan.xid import XID_LINES as XID_LINES  # gpu.sh's constant of that name
from ..plan.xid import xid_health
from ..shell import ShCommand


class Result(Protocol):
    """What a command returns: transport.Completed has this shape."""

    @property
    def exit_status(self) -> int | None: ...

    @property
    def stdout(self) -> str: ...


class Runner(Protocol):
    """The part of transport.Transport the gate uses (SSHTransport and LocalTransport fit)."""

    @property
    def host(self) -> str: ...

    async def run(self, cmd: str, *, input: str | None = None, check: bool = False,
                  timeout: float | None = 60.0, what: str = "command") -> Result: ...


Policy = Literal["report", "kill"]
POLICIES: tuple[str, ...] = ("report", "kill")

# What gpu.sh asks nvidia-smi (its constants of the same names: tests/test_host_programs.py)
GPU_FIELDS = "index,uuid,memory.used,memory.total,compute_cap"
OLD_GPU_FIELDS = "index,uuid,memory.used,memory.total"   # drivers without compute_cap
APP_FIELDS = "pid,process_name,used_memory,gpu_uuid"
SMI_FORMAT = "csv,noheader,nounits"
QUERY_GPU = f"nvidia-smi --query-gpu={GPU_FIELDS} --format={SMI_FORMAT}"
QUERY_APPS = f"nvidia-smi --query-compute-apps={APP_FIELDS} --format={SMI_FORMAT}"
HEALTH_SECTIONS = "|" + "|".join(SMI_SECTIONS) + "|"
# The `journalctl -k -o json` entries gpu.sh keeps: a MESSAGE that opens with an Xid report, matched
# by journalctl (-g, on the field alone), else by grep on each line (a quote inside a JSON value is
# escaped, so a message quoting a report never passes; older systemd wrote `" : "`).
XID_MATCH, XID_FIELDS = r"^NVRM: Xid \(", "MESSAGE,_TRANSPORT,SYSLOG_FACILITY"
XID_GREP = '"MESSAGE" ?: ?"NVRM: Xid \\('


@dataclass(frozen=True)
class Gpu:
    """One GPU as nvidia-smi reports it. Memory in MiB; None where nvidia-smi says [N/A]."""

    index: int
    used_mib: int | None
    total_mib: int | None
    uuid: str = ""
    compute_capability: str | None = None     # nvidia-smi's compute_cap, e.g. "9.0"; None: unknown


@dataclass(frozen=True)
class Holder:
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


@dataclass(frozen=True)
class GpuFacts:
    """What the gate saw on one host at one moment."""

    has_nvidia_smi: bool
    gpus: list[Gpu] = field(default_factory=list)
    holders: list[Holder] = field(default_factory=list)
    error: str | None = None         # nvidia-smi exists but failed (driver not loaded, ...)
    health: GpuHealth | None = None  # the GPUs' health, when it was asked for (gpu_command's health_since)

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

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


DEVICE_PREFIX = "/dev/nvidia"


def gpu_command(token: str | None = None, *, device_prefix: str = DEVICE_PREFIX,
                health_since: int | None = None) -> tuple[ShCommand, str]:
    """The POSIX sh command that reads the GPU state of a host (reconciler/sh/gpu.sh). Returns
    (command, token).

    Lists every process with /dev/nvidia* open (pid, comm, cgroup, device nodes) by scanning
    /proc/*/fd, and where nvidia-smi exists: index, uuid, memory.used, memory.total of each
    GPU, and pid, process_name, used_memory, gpu_uuid of each compute process. Run it as root
    to see every process's fds (others' /proc/PID/fd are unreadable). device_prefix is the
    path prefix of the device nodes (tests point it at a file of their own, since /dev/nvidia*
    cannot be created on a machine without the driver). health_since: read the GPUs' health
    too (nvidia-smi -q, the kernel log's Xid lines since that host epoch, 0 for this boot, and
    DCGM's health): GpuFacts.health; None (the waits' polls) reads no health.
    """
    if any(c.isspace() for c in device_prefix) or "\\" in device_prefix:
        raise ValueError("device_prefix must not contain whitespace or backslashes")
    token = token or secrets.token_hex(8)
    args = [token, device_prefix] + ([str(max(0, int(health_since)))] if health_since is not None else [])
    return ShCommand(shell.program("gpu"), "reconciler-gpu", args), token


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


_NUMBER, _WHOLE = re.compile(r"[0-9]{1,15}(?:\.[0-9]{1,9})?"), re.compile(r"[0-9]{1,12}")


def _int(v: str) -> int | None:
    """A number nvidia-smi printed, rounded down; None for "[N/A]" or anything but a plain decimal
    of at most 15 digits (host output is data: never inf, never 400 digits)."""
    return int(float(v.strip())) if _NUMBER.fullmatch(v.strip()) else None


def _whole(v: str) -> int | None:
    """A pid, a GPU index or an epoch: ASCII digits, at most 12 of them; else None."""
    return int(v) if _WHOLE.fullmatch(v) else None


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
        if len(parts) < 3 or (pid := _whole(parts[0])) is None:
            raise malformed(self.host, "GPU holder", f)
        try:
            comm, cgroup = _text(parts[1]).strip(), _text(parts[2])
        except ValueError:
            raise ObserveError(self.host, "malformed GPU holder line (bad base64)") from None
        self.procs[pid] = (comm, unit_of_cgroup(cgroup), tuple(sorted(set(parts[3:]))))

    def cgroup(self, f: Frame) -> None:
        word, _, cg = f.payload.partition(" ")
        if (pid := _whole(word)) is None:
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
        if len(fields) < 3 or (pid := _whole(fields[0])) is None:
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
            index = _whole(fields[0])
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
                         now=_whole(self.rc.get("NOW", "")) or 0, notes=tuple(notes))

    def facts(self) -> GpuFacts:
        gpus = self.gpus()
        error = "; ".join(self.errors[:3]) if self.has_smi and self.errors else None
        return GpuFacts(has_nvidia_smi=self.has_smi, gpus=gpus, holders=self.holders(gpus), error=error,
                        health=self.health())


def parse_gpu(stdout: str, token: str, host: str = "?") -> GpuFacts:
    """Parse the output of `gpu_command` into GpuFacts (pure).

    Holders are the union of the /proc scan and nvidia-smi's compute apps, sorted by PID; a
    PID seen by both gets its devices from /proc and its memory from nvidia-smi.
    """
    reading = _GpuReading(host)
    for f in frames(stdout, token, host, early=_EARLY):
        reading.read(f)
    return reading.facts()


async def gpu_facts(t: Runner, *, timeout: float = 30.0, device_prefix: str = DEVICE_PREFIX,
                    health_since: int | None = None) -> GpuFacts:
    """Read and parse the GPU state of the host behind a transport (one command); with
    health_since, its GPUs' health too (gpu_command)."""
    cmd, token = gpu_command(device_prefix=device_prefix, health_since=health_since)
    res = await t.run(cmd, timeout=timeout, what="GPU check")
    return parse_gpu(res.stdout, token, t.host)


def released(facts: GpuFacts, *, pids: set[int] | None, max_used_mib: int,
             gpus: set[int] | None = None) -> bool:
    """Pure: none of pids holds the GPUs, and memory.used is below the threshold on every GPU
    (or on the given GPU indexes)."""
    if pids and any(h.pid in pids for h in facts.holders):
        return False
    return not facts.used_over(max_used_mib, gpus)


async def wait_released(t: Runner, *, pids: set[int] | None = None, timeout: float,
                        poll: float = 0.25, max_used_mib: int = 1024,
                        gpus: set[int] | None = None, device_prefix: str = DEVICE_PREFIX,
                        clock: Clock = REAL) -> tuple[bool, GpuFacts, float]:
    """After a stop: wait (at most timeout seconds) until the GPUs are free again.

    Free: none of pids is still a holder, and memory.used is below max_used_mib on every GPU
    (or only on the GPU indexes in gpus, when other services keep theirs). Returns (released,
    the last facts, seconds waited). A host without GPUs is released once the pids are gone.
    `clock`: what the polls and the timeout are measured on (a test's virtual one).
    """
    start = clock.now()
    while True:
        facts = await gpu_facts(t, timeout=max(5.0, min(30.0, timeout)), device_prefix=device_prefix)
        waited = clock.now() - start
        if released(facts, pids=pids, max_used_mib=max_used_mib, gpus=gpus):
            return True, facts, waited
        if waited >= timeout:
            return False, facts, waited
        await clock.sleep(min(poll, max(0.0, timeout - waited)))


def stray_holders(facts: GpuFacts, service_pids: set[int],
                  service_units: set[str] | frozenset[str] = frozenset()) -> list[Holder]:
    """Holders that are not the service's own processes (pure).

    A holder is the service's when its PID is in service_pids or its cgroup belongs to one of
    service_units (e.g. "sglang-qwen.service"): a server's GPU workers are child processes
    with PIDs of their own, and only their cgroup ties them to the service.
    """
    return [h for h in facts.holders
            if h.pid not in service_pids and not (h.unit and h.unit in service_units)]


@dataclass(frozen=True)
class KillOutcome:
    """What kill_strays did to one holder: reported (policy report), terminated (exited after
    SIGTERM), killed (needed SIGKILL), gone (had exited already, or its PID now belongs to
    another program), survived (still there after SIGKILL) or failed (the signal could not be
    sent, e.g. not permitted)."""

    holder: Holder
    outcome: Literal["reported", "terminated", "killed", "gone", "survived", "failed"]


def _alive_script(pids: list[int]) -> str:
    # A zombie has released its devices: count it as gone.
    checks = " ".join(str(p) for p in pids)
    return (f"for p in {checks}; do s=$(sed 's/.*) //' /proc/$p/stat 2>/dev/null | cut -d' ' -f1); "
            f"[ -n \"$s\" ] && [ \"$s\" != Z ] && echo $p; done; true")


async def _alive(t: Runner, pids: list[int]) -> set[int]:
    if not pids:
        return set()
    res = await t.run(_alive_script(pids), timeout=15, what="GPU holder check")
    return {p for x in res.stdout.split() if (p := _whole(x)) is not None}


def _marked(stdout: str, mark: str) -> set[int]:
    return {n for m, _, p in (line.partition(" ") for line in stdout.splitlines())
            if m == mark and (n := _whole(p.strip())) is not None}


async def kill_strays(t: Runner, holders: list[Holder], policy: str = "report", *,
                      grace: float = 10.0, poll: float = 0.25, clock: Clock = REAL) -> list[KillOutcome]:
    """Deal with stray GPU holders according to the service's policy.

    "report" (the default) never signals anything. "kill" sends SIGTERM, waits up to grace
    seconds, then SIGKILLs what is left. Before signalling, each PID's comm is checked again,
    so a PID that was reused by another program in the meantime is left alone. `clock`: what
    grace and the polls are measured on (a test's virtual one).
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown stray-process policy {policy!r} (expected one of {', '.join(POLICIES)})")
    if policy == "report" or not holders:
        return [KillOutcome(h, "reported") for h in holders]
    # Signal only a PID whose comm is still the one observed (PIDs get reused).
    term = "; ".join(
        f"if [ \"$(cat /proc/{h.pid}/comm 2>/dev/null)\" = {shlex.quote(h.comm)} ]; then "
        f"if kill -TERM {h.pid} 2>/dev/null; then echo S {h.pid}; else echo F {h.pid}; fi; fi"
        for h in holders)
    res = await t.run(term + "; true", timeout=15, what="SIGTERM stray GPU holders")
    signalled = _marked(res.stdout, "S")
    failed = _marked(res.stdout, "F")
    deadline = clock.now() + grace
    alive = await _alive(t, sorted(signalled))
    while alive and clock.now() < deadline:
        await clock.sleep(poll)
        alive = await _alive(t, sorted(alive))
    killed: set[int] = set()
    if alive:
        res = await t.run("; ".join(f"kill -KILL {p} 2>/dev/null && echo {p}" for p in sorted(alive)) + "; true",
                          timeout=15, what="SIGKILL stray GPU holders")
        killed = {p for x in res.stdout.split() if (p := _whole(x)) is not None}
        end = clock.now() + 5.0
        alive = await _alive(t, sorted(alive))
        while alive and clock.now() < end:
            await clock.sleep(poll)
            alive = await _alive(t, sorted(alive))
    out: list[KillOutcome] = []
    for h in holders:
        if h.pid in failed:
            out.append(KillOutcome(h, "failed"))
        elif h.pid not in signalled:
            out.append(KillOutcome(h, "gone"))
        elif h.pid in alive:
            out.append(KillOutcome(h, "survived"))
        elif h.pid in killed:
            out.append(KillOutcome(h, "killed"))
        else:
            out.append(KillOutcome(h, "terminated"))
    return out
