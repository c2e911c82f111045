"""What we read from a host: one batched shell command, and a pure parser of its output.

Like pyinfra's facts: `observe_command(names)` builds the command (the program
reconciler/sh/observe.sh), `parse_observation(out)` turns its output into `HostFacts`. One SSH
round trip reads, for every desired or inventoried service: the unit file, every drop-in
systemd would apply to it (ours and anyone else's, in /etc, /run and the `system.control`
directories), `systemctl show` properties and the reconciler's own record on the host
(/var/lib/reconciler, typed in records.py), and, for the files that hold secrets (a referenced
file, or the reconciler's own credstore), whether each is there and a keyed hash of its
content: never the content. The key is the host's own (/var/lib/reconciler/secret.key, 0600,
made on first use), so the hash of a low-entropy secret cannot be reversed by whoever reads a
record, and it is the same whichever controller asks.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from functools import cached_property

from .. import shell
from ..errors import ObserveError
from ..frames import Frame, decode, frames, malformed, number, raw_section
from ..shell import ShCommand
from .gpuhealth import GpuFault
from .records import HostRecord, ServiceRecord
from .unit import UnitState

UNIT_DIR = "/etc/systemd/system"
STATE_DIR = "/var/lib/reconciler"
ENV_DROPIN = "50-reconciler-env.conf"
SECRETS_DROPIN = "60-reconciler-secrets.conf"
CREDSTORE = f"{STATE_DIR}/credstore"
SHOW_PROPS = ("Id,LoadState,ActiveState,SubState,Result,NRestarts,ExecMainCode,ExecMainStatus,"
              "ExecMainPID,InvocationID,NeedDaemonReload,FragmentPath,DropInPaths,UnitFileState,"
              "ActiveEnterTimestampMonotonic")
# Where a drop-in for <name>.service can live, highest priority first (systemd.unit(5)): the
# `systemctl set-property` directories, runtime (`systemctl edit --runtime`), and the admin's.
DROPIN_DIRS = ("/etc/systemd/system.control", "/run/systemd/system.control", "/run/systemd/transient",
               "/etc/systemd/system", "/run/systemd/system")
ADOPTED_DIR = f"{STATE_DIR}/adopted"


def unit_path(service: str) -> str:
    return f"{UNIT_DIR}/{service}.service"


def env_path(service: str) -> str:
    return f"{UNIT_DIR}/{service}.service.d/{ENV_DROPIN}"


# A service's environment, as the EnvironmentFile= its env drop-in names: systemd reads it at
# every start, so a change of env alone is a write and a restart, with no daemon-reload.
ENV_DIR = "/etc/reconciler/env"


def envfile_path(service: str) -> str:
    return f"{ENV_DIR}/{service}.env"


def secrets_path(service: str) -> str:
    """The drop-in that hands a service its secrets (paths only, never a value)."""
    return f"{UNIT_DIR}/{service}.service.d/{SECRETS_DROPIN}"


def cred_path(service: str, name: str) -> str:
    """Where the reconciler keeps a secret it delivers (root-only file in a root-only directory)."""
    return f"{CREDSTORE}/{service}/{name}"


def cred_env_path(service: str) -> str:
    """The root-only EnvironmentFile= of a service's secrets delivered as environment variables."""
    return f"{CREDSTORE}/{service}.env"


def record_path(service: str) -> str:
    return f"{STATE_DIR}/services/{service}.json"


HOST_RECORD = f"{STATE_DIR}/host.json"
# The host lock (lock.py): its file, who holds it now, and how many times it was taken. Every
# holder counts itself in LOCK_COUNT before it changes anything, and says who it is in
# LOCK_OWNER until it lets go; a look that saw no holder, and a count no other holder has moved
# since, still holds once the lock is taken (fleet.py's survey: no second observation).
LOCK = f"{STATE_DIR}/.lock"
CONFIRM_SUBDIR = "confirm"     # where an armed dead-man's switch keeps its script (confirm.py)
LOCK_OWNER = f"{STATE_DIR}/.lock.owner"
LOCK_COUNT = f"{STATE_DIR}/.lock.count"



def count_holder(count: str) -> str:
    """sh that a new holder of the host lock runs first: $g the count as it found it (0 when
    there is none yet), and the file moved on by one. Builtins only, no process. Where the count
    cannot be written (a full disk), the file goes: a look that saw a count never finds it again."""
    return (f"g=0; [ ! -f {count} ] || {{ read -r g < {count} || :; }}; "
            f"case $g in ''|*[!0-9]*) n=1 ;; *) n=$((g + 1)) ;; esac; "
            f"{{ echo $n > {count}; }} 2>/dev/null || rm -f {count}")


def adopted_copy(service: str, path: str) -> str:
    """Where the original of an adopted unit's file is kept."""
    return f"{ADOPTED_DIR}/{service}{path}"


@dataclass(frozen=True)
class ServiceFacts:
    """One service as found on the host. Files are None when absent.

    dropins: every drop-in file systemd would apply to the service (path -> content), ours
    included; the planner tells ours from anyone else's.
    """

    name: str
    unit_text: str | None = None
    env_text: str | None = None           # our env drop-in (it names the env file)
    record: ServiceRecord | None = None   # the reconciler's record: present = in the inventory
    props: dict[str, str] = field(default_factory=dict)
    dropins: dict[str, str] = field(default_factory=dict)
    envfile_text: str | None = None       # the env file (envfile_path)

    @cached_property
    def unit(self) -> UnitState:
        """systemd's state of the unit, typed (plan/unit.py), parsed once."""
        return UnitState.parse(self.props)

    @property
    def managed(self) -> bool:
        """True when the reconciler installed this service (it is in the host's inventory)."""
        return self.record is not None

    @property
    def active_state(self) -> str:
        return self.props.get("ActiveState", "")

    @property
    def running(self) -> bool:
        """Started (or being started/restarted by systemd): stopping it is a restart, not a start."""
        return self.active_state in ("active", "activating", "reloading", "refreshing")

    @property
    def enabled(self) -> bool:
        return self.props.get("UnitFileState") in ("enabled", "enabled-runtime")

    def foreign_path(self) -> str | None:
        """Where a unit of this name lives that the reconciler did not install, or None.

        A unit file at our path without a record, a loaded unit from elsewhere (a package's
        /lib/systemd/system/NAME.service, which our file would shadow), or a masked unit.
        """
        if self.managed:
            return None
        if self.unit_text is not None:
            return unit_path(self.name)
        load = self.props.get("LoadState", "")
        fragment = self.props.get("FragmentPath", "")
        if load == "masked":
            return fragment or unit_path(self.name)
        if load in ("loaded", "bad-setting", "error") and fragment and fragment != unit_path(self.name):
            return fragment
        return None


@dataclass(frozen=True)
class HostFacts:
    """Everything observed on one host in one round trip."""

    services: dict[str, ServiceFacts]
    record: HostRecord | None = None      # /var/lib/reconciler/host.json
    gpu_fault: GpuFault | None = None     # /var/lib/reconciler/gpu-fault.json (gpuhealth.py)
    # Files that hold secrets: path -> keyed hash of the content, None when absent (never a value)
    secret_files: dict[str, str | None] = field(default_factory=dict)
    # How many times the host lock had been taken, when nobody held it as this was read (else None)
    lock_count: str | None = None
    # Temp files (`.reconciler-tmp.*`) in the directories the reconciler writes: what a run that was
    # killed mid-write left (a run's own are gone when its script ends, by its clean-up)
    stale_temps: tuple[str, ...] = ()

    @property
    def inventory(self) -> set[str]:
        return {n for n, s in self.services.items() if s.managed}


def observe_command(desired: list[str], token: str | None = None,
                    secret_files: list[str] | None = None) -> tuple[ShCommand, str]:
    """The command that reads everything about these services (and the inventory), and the
    keyed hash of each file in `secret_files`: reconciler/sh/observe.sh, whose constants are
    this module's (tests/test_host_programs.py).

    Returns (command, token); the token frames the output so no file content can forge it.
    """
    token = token or secrets.token_hex(8)
    args = [token, *sorted(desired)]
    if secret_files:
        args += ["--", *sorted(set(secret_files))]
    return ShCommand(shell.program("observe"), "reconciler-observe", args), token


def parse_show(text: str) -> dict[str, dict[str, str]]:
    """`systemctl show` output for one or more units -> {unit Id: {Key: value}}.

    Blocks are separated by blank lines; values are looked up by key; missing keys are fine.
    """
    out: dict[str, dict[str, str]] = {}
    for block in text.split("\n\n"):
        props: dict[str, str] = {}
        for line in block.split("\n"):   # not splitlines(): a value may hold \u2028 or \x1c
            key, sep, value = line.partition("=")
            if sep:
                props[key] = value
        if props.get("Id"):
            out[props["Id"]] = props
    return out


_EARLY = "observation output ended early (is this a systemd host with a POSIX shell?)"
_FILE_KINDS = frozenset("HRUEVD")   # host record, record, unit, env drop-in, env file, drop-in


class _Observation:
    """parse_observation's reading of the records: a handler per kind.

    G the lock's count; T a stale temp file; K a secret file's keyed hash; and files, line by
    line: `KIND NAME L|P TEXT` (a line, a last line without newline), then `KIND NAME F` (the
    file ends) or `KIND NAME -` (no such file); a drop-in's path comes first (`D NAME N|B PATH`).
    """

    def __init__(self, host: str) -> None:
        self.host = host
        self.files: dict[str, dict[str, str | None]] = {}
        self.dropins: dict[str, dict[str, str]] = {}
        self.host_record: HostRecord | None = None
        self.gpu_fault: GpuFault | None = None
        self.secret_files: dict[str, str | None] = {}
        self.lock_count: str | None = None
        self.temps: list[str] = []
        self.lines: dict[tuple[str, str], list[str]] = {}
        self.dropin_path: dict[str, str | None] = {}

    def decode(self, field_: str) -> str | None:
        if field_ == "-":
            return None
        try:
            return decode(field_, plain=False)
        except ValueError:
            raise ObserveError(self.host, "malformed observation output (bad base64)") from None

    def read(self, f: Frame) -> None:
        fields = f.fields(3)
        if f.kind == "G" and len(fields) == 1:
            self.lock_count = fields[0] if number(fields[0]) is not None else None
        elif f.kind == "T" and len(fields) == 1:
            temp = self.decode(fields[0])
            if temp:
                self.temps.append(temp)
        elif f.kind == "K" and len(fields) == 2:
            path = self.decode(fields[0])
            if path:
                self.secret_files[path] = None if fields[1] == "-" else fields[1]
        elif f.kind in _FILE_KINDS and len(fields) >= 2:
            self.file(f, fields[0], fields[1], fields[2] if len(fields) == 3 else "")
        else:
            raise malformed(self.host, "observation", f)

    def file(self, f: Frame, name: str, op: str, rest: str) -> None:
        if op in ("L", "P"):
            self.lines.setdefault((f.kind, name), []).append(rest + "\n" if op == "L" else rest)
        elif f.kind == "D" and op in ("N", "B"):
            self.dropin_path[name] = rest if op == "N" else self.decode(rest)
        elif op in ("F", "-"):
            self.whole(f.kind, name, "".join(self.lines.pop((f.kind, name), [])) if op == "F" else None)
        else:
            raise malformed(self.host, "observation", f)

    def whole(self, kind: str, name: str, text: str | None) -> None:
        """A file read to its end (text), or found absent (None)."""
        if kind == "H" and name == "gpu":
            self.gpu_fault = _gpu_fault(text) if text is not None else None
        elif kind == "H":
            self.host_record = HostRecord.parse(text) if text is not None else None
        elif kind == "D":
            path = self.dropin_path.pop(name, None)
            if path:
                self.dropins.setdefault(name, {})[path] = text or ""
        else:
            self.files.setdefault(name, {})[kind] = text

    def facts(self, show: dict[str, dict[str, str]]) -> HostFacts:
        services = {}
        for name, f in self.files.items():
            rec_text = f.get("R")
            services[name] = ServiceFacts(
                name=name,
                unit_text=f.get("U"),
                env_text=f.get("E"),
                envfile_text=f.get("V"),
                record=ServiceRecord.parse(rec_text) if rec_text is not None else None,
                props=show.get(f"{name}.service", {}),
                dropins=self.dropins.get(name, {}),
            )
        return HostFacts(services=services, record=self.host_record, gpu_fault=self.gpu_fault,
                         secret_files=self.secret_files,
                         lock_count=self.lock_count, stale_temps=tuple(sorted(self.temps)))


def _gpu_fault(text: str) -> GpuFault:
    """gpu-fault.json as GpuFault.parse reads it, but any text: one it cannot read at all (JSON
    nested deeper than the parser goes, a number of 4,300 digits) still marks the host."""
    try:
        return GpuFault.parse(text) or GpuFault(quote="unreadable gpu-fault.json")
    except (ValueError, RecursionError):
        return GpuFault(quote="unreadable gpu-fault.json")


def parse_observation(stdout: str, token: str, host: str = "?") -> HostFacts:
    """Parse the output of `observe_command` into HostFacts (pure). Any text: facts, or an
    ObserveError (an answer cut short, a record that is not one).

    A record that is not valid JSON is read as a corrupt record: the service stays in the
    inventory (so it is never mistaken for a foreign unit), and nothing in it is trusted.
    `systemctl show` comes last, as it is, between the `S -` line and the END line (the token,
    random per observation, cannot occur in it).
    """
    records, shown = raw_section(stdout, token, "S -", host, _EARLY)
    reading = _Observation(host)
    for f in frames(records, token, host, early=_EARLY):
        reading.read(f)
    return reading.facts(parse_show(shown) if shown is not None else {})
