"""What we read from a host: the observation, one host program and a pure parser of its answer.

Like pyinfra's facts: `Observe(services, secret_files)` is reconciler/sh/observe.sh with its
named parameters, and its `parse` (`parse_observation`) turns the answer into `HostFacts`. One SSH
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

from collections.abc import Mapping
from functools import cached_property
from typing import ClassVar

import msgspec

from ...errors import ObserveError
from ...frames import Frame, HostProgram, Param, Records, decode, malformed, number
from .. import layout
from ..gpuhealth import GpuFault
from ..layout import unit_path
from ..records import HostRecord, ServiceRecord
from ..unit import UP, UnitState
from .show import parse_show

SHOW_PROPS = ("Id,LoadState,ActiveState,SubState,Result,NRestarts,ExecMainCode,ExecMainStatus,"
              "ExecMainPID,InvocationID,NeedDaemonReload,FragmentPath,DropInPaths,UnitFileState,"
              "ActiveEnterTimestampMonotonic")


class ServiceFacts(msgspec.Struct, frozen=True, dict=True):   # dict: room for its cached properties
    """One service as found on the host. Files are None when absent.

    dropins: every drop-in file systemd would apply to the service (path -> content), ours
    included; the planner tells ours from anyone else's.
    """

    name: str
    unit_text: str | None = None
    env_text: str | None = None           # our env drop-in (it names the env file)
    record: ServiceRecord | None = None   # the reconciler's record: present = in the inventory
    props: dict[str, str] = msgspec.field(default_factory=dict)
    dropins: dict[str, str] = msgspec.field(default_factory=dict)
    envfile_text: str | None = None       # the env file (envfile_path)
    # A run's leave of rotation is recorded (layout.ROTATION_DIR/NAME.left) and no rejoin followed
    # it: the run was killed between the two (plan/rejoin.py decides what the next run does)
    left_rotation: bool = False

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
        return self.active_state in UP

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


class HostFacts(msgspec.Struct, frozen=True):
    """Everything observed on one host in one round trip."""

    services: dict[str, ServiceFacts]
    record: HostRecord | None = None      # /var/lib/reconciler/host.json
    gpu_fault: GpuFault | None = None     # /var/lib/reconciler/gpu-fault.json (gpuhealth.py)
    # Files that hold secrets: path -> keyed hash of the content, None when absent (never a value)
    secret_files: dict[str, str | None] = msgspec.field(default_factory=dict)
    # How many times the host lock had been taken, when nobody held it as this was read (else None)
    lock_count: str | None = None
    # Temp files (`.reconciler-tmp.*`) in the directories the reconciler writes: what a run that was
    # killed mid-write left (a run's own are gone when its script ends, by its clean-up)
    stale_temps: tuple[str, ...] = ()

    @property
    def inventory(self) -> set[str]:
        return {n for n, s in self.services.items() if s.managed}


class Observe(HostProgram[HostFacts], frozen=True):
    """reconciler/sh/observe.sh: everything about these services (and the inventory), and the
    keyed hash of each file in `secret_files` (None: none hashed, and nothing written: the key
    is made on first use)."""

    name: ClassVar[str] = "observe"
    in_session: ClassVar[bool] = True      # the warm daemon's standing session runs it in its bash
    same_params: ClassVar[bool] = True
    constants: ClassVar[Mapping[str, str]] = {
        "D": layout.STATE_DIR, "LOCK": layout.LOCK, "COUNT": layout.LOCK_COUNT, "OWNER": layout.LOCK_OWNER,
        "CONFIRM": layout.CONFIRM_DIR, "UNIT_DIR": layout.UNIT_DIR, "ENV_DIR": layout.ENV_DIR,
        "ENV_DROPIN": layout.ENV_DROPIN, "DROPIN_DIRS": " ".join(layout.DROPIN_DIRS), "SHOW_PROPS": SHOW_PROPS,
        "KEY": layout.SECRET_KEY, "TEMP": layout.TEMP,
        "ROTATION": layout.ROTATION_DIR}
    services: tuple[str, ...] = ()
    secret_files: tuple[str, ...] | None = None

    def params(self) -> Mapping[str, Param]:
        return {"service": sorted(self.services),
                "secret": sorted(set(self.secret_files)) if self.secret_files is not None else None}

    def parse(self, answer: Records) -> HostFacts:
        return parse_observation(answer.stdout, answer.token, answer.host)


_EARLY = "observation output ended early (is this a systemd host with a POSIX shell?)"
_FILE_KINDS = frozenset("HRUEVDO")  # host record, record, unit, env drop-in, env file, drop-in, leave


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
            self.gpu_fault = GpuFault.parse(text) if text is not None else None
        elif kind == "H":
            self.host_record = HostRecord.parse(text) if text is not None else None
        elif kind == "D":
            path = self.dropin_path.pop(name, None)
            if path:
                self.dropins.setdefault(name, {})[path] = text or ""
        else:
            self.files.setdefault(name, {})[kind] = text

    def facts(self, show: dict[str, dict[str, str]]) -> HostFacts:
        services = {name: ServiceFacts(name=name, unit_text=f.get("U"), env_text=f.get("E"), envfile_text=f.get("V"),
                                       record=ServiceRecord.parse(rec) if (rec := f.get("R")) is not None else None,
                                       props=show.get(f"{name}.service", {}), dropins=self.dropins.get(name, {}),
                                       left_rotation=f.get("O") is not None)
                    for name, f in self.files.items()}
        return HostFacts(services=services, record=self.host_record, gpu_fault=self.gpu_fault,
                         secret_files=self.secret_files,
                         lock_count=self.lock_count, stale_temps=tuple(sorted(self.temps)))


def parse_observation(stdout: str, token: str, host: str = "?") -> HostFacts:
    """Parse the answer of observe.sh (`Observe`) into HostFacts (pure). Any text: facts, or an
    ObserveError (an answer cut short, a record that is not one).

    A record that is not valid JSON is read as a corrupt record: the service stays in the
    inventory (so it is never mistaken for a foreign unit), and nothing in it is trusted.
    `systemctl show` comes last, as it is, between the `S -` line and the END line (the token,
    random per observation, cannot occur in it).
    """
    records, shown = Records(stdout, token, host).section("S -", _EARLY)
    reading = _Observation(host)
    for f in records.whole(_EARLY):
        reading.read(f)
    return reading.facts(parse_show(shown) if shown is not None else {})
