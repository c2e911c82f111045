"""TOML files of one revision -> a validated, merged and rendered DesiredState.

The repository layout (its names: repo.py) is documented for users in desired-state/README.md.

Loading is all-or-nothing: every problem in every file is collected (file, dotted key, what is
expected) and raised together as one ConfigError, so a bad commit is rejected before anything is
applied anywhere. Nothing here does I/O other than snap.read and snap.list.

This module is the entry and loads the files themselves (fleet.toml, known_hosts, the
definitions, the hosts); the parts beside it: docs/architecture.md's module map.
"""

from __future__ import annotations

from ..errors import ConfigError
from . import schema
from .collect import Problems
from .fields import HOST_NAME, SERVICE_NAME, host_key_problem
from .merge import At
from .problems import dotted
from .repo import FLEET_FILE, HOSTS_DIR, SERVICES_DIR, MemorySnapshot, SnapshotLike
from .rollout import RolloutGroups, pull_waves
from .service import ServiceLoader
from .spec import DesiredState, FleetSettings, HostSpec, NotifySpec, PullWave, ServiceSpec, SSHSpec
from .toml_files import TomlFiles, under
from .units import HEADER, UnitFiles

# What other modules and tests import from here, wherever it is defined.
__all__ = ["HEADER", "MemorySnapshot", "dotted", "load_desired"]


def load_desired(snap: SnapshotLike) -> DesiredState:
    """Load, validate, merge and render the desired state of one revision.

    Raises ConfigError listing every problem found, in every file, when anything is wrong.
    """
    return _Loader(snap).load()


class _Loader:
    """One load: reads files through the snapshot and collects problems as it goes."""

    def __init__(self, snap: SnapshotLike):
        self.snap = snap
        self.problems = Problems()
        self.files = TomlFiles(snap, self.problems)
        self.units = UnitFiles(snap, self.problems)
        self.groups = RolloutGroups()
        self.endpoints: dict[tuple[str, int], str] = {}  # (address, port) -> the first host file with it

    def load(self) -> DesiredState:
        self.fleet = self._load_fleet()
        self.known_hosts = self._load_known_hosts()
        definitions = {name: self._load_definition(name, path)
                       for name, path in self.files.listed(SERVICES_DIR, "definition")}
        self.services = ServiceLoader(self.snap, self.problems, self.units, self.fleet, definitions, self.groups)
        hosts = self._load_hosts()
        self.groups.check(self.problems)
        waves = pull_waves(self.fleet.pull, hosts, self.problems)
        if self.problems:
            raise ConfigError(self.problems.result())
        return DesiredState(revision=self.snap.revision, hosts=hosts, settings=_settings(self.fleet, waves))

    # -- fleet.toml and known_hosts --

    def _load_fleet(self) -> schema.FleetFile:
        data = self.snap.read(FLEET_FILE)
        if data is None:
            return schema.FleetFile()
        return self.files.validate(FLEET_FILE, schema.FleetFile, data)[0] or schema.FleetFile()

    def _load_known_hosts(self) -> str | None:
        path = self.fleet.ssh.known_hosts
        if path is None:
            return None
        data = self.snap.read(path)
        if data is None:
            self.problems.add(FLEET_FILE, "ssh.known_hosts", f"file {path!r} not found in the repository")
            return None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            self.problems.add(path, "", "not UTF-8 text")
            return None
        for number, line in enumerate(text.splitlines(), 1):
            if why := _known_hosts_line_problem(line):
                self.problems.add(path, "", f"line {number}: {why}")
        return text

    # -- services/<def>.toml: every definition, used or not --

    def _load_definition(self, name: str, path: str) -> schema.ServiceDefinition | None:
        """A definition; None for one that is invalid."""
        if not SERVICE_NAME.fullmatch(name):
            self.problems.add(path, "", f"invalid definition name {name!r}: use letters, digits, '_' and '-' (no dots)")
            return None
        data = self.snap.read(path) or b""
        definition, bad = self.files.validate(path, schema.ServiceDefinition, data)
        if definition is None or bad:  # a host using it is skipped: no follow-on noise
            return None
        if definition.unit is not None and definition.unit_file is not None:
            self.problems.add(path, "unit", "set either unit or unit_file, not both")
            return None
        if definition.unit_file is not None:
            self.units.read(definition.unit_file, At(path, "unit_file"))
        if definition.unit is not None:
            self.units.check_text(definition.unit, At(path, "unit"))
        return definition

    # -- hosts/<name>.toml --

    def _load_hosts(self) -> dict[str, HostSpec]:
        files = self.files.listed(HOSTS_DIR, "host")
        if not files:
            self.problems.add(f"{HOSTS_DIR}/", "", "no hosts: add hosts/<name>.toml")
        loaded = {name: self._load_host(name, path) for name, path in files}
        return {name: host for name, host in loaded.items() if host is not None}

    def _load_host(self, name: str, path: str) -> HostSpec | None:
        if not HOST_NAME.fullmatch(name):
            self.problems.add(path, "", f"invalid host name {name!r}: the file name must be <name>.toml where "
                                        "name has letters, digits, '_', '.' and '-', starts with a letter or digit, "
                                        "at most 63")
            return None
        host, bad = self.files.validate(path, schema.HostFile, self.snap.read(path) or b"")
        if host is None:
            return None
        fleet = self.fleet
        port = host.ssh.port if host.ssh.port is not None else fleet.ssh.port
        other = self.endpoints.setdefault((host.address, port), path)
        if other != path and not under(("ssh",), bad):
            self.problems.add(path, "address",
                              f"{host.address}:{port} is also the address of {other}: one file per host")
        specs: dict[str, ServiceSpec] = {}
        for service_name, table in host.services.items():
            if table.use is not None:      # its group counts it, even when it has problems of its own
                self.groups.declare(service_name, table.use, path)
            if under(("services", service_name), bad):
                continue
            spec = self.services.load(name, path, host, service_name, table)
            if spec is not None:
                specs[service_name] = spec
        return HostSpec(
            name=name,
            ssh=SSHSpec(
                address=host.address,
                port=port,
                user=host.ssh.user if host.ssh.user is not None else fleet.ssh.user,
                host_key=host.ssh.host_key,
                known_hosts=self.known_hosts,
                known_hosts_file=fleet.ssh.known_hosts if self.known_hosts is not None else None,
            ),
            services=specs,
            labels=dict(host.labels),
            source=path,
        )


def _known_hosts_line_problem(line: str) -> str | None:
    """What is wrong with one line of known_hosts, or None (comments and blank lines are fine)."""
    fields = line.split()
    if not fields or fields[0].startswith("#"):
        return None
    if fields[0].startswith("@"):  # @cert-authority / @revoked marker
        fields = fields[1:]
    if len(fields) < 3:
        return "expected '<host patterns> <key type> <base64 key>'"
    return host_key_problem(" ".join(fields[1:3]))


def _settings(fleet: schema.FleetFile, waves: tuple[PullWave, ...]) -> FleetSettings:
    notify = None
    if fleet.notify is not None:
        notify = NotifySpec(webhook=fleet.notify.webhook, format=fleet.notify.format,
                            **({"timeout": fleet.notify.timeout} if fleet.notify.timeout is not None else {}))
    return FleetSettings(concurrency=fleet.concurrency, notify=notify, pull_waves=waves)
