"""TOML files of one revision -> a validated, merged and rendered DesiredState.

The repository layout (desired-state/README.md documents it for users)::

    fleet.toml               optional: [ssh], [health] and [rollout] defaults, [notify], concurrency,
                             [pull] waves
    known_hosts              named by fleet.toml ssh.known_hosts
    hosts/<host>.toml        one per host: address, labels, [ssh], [services.<name>]
    services/<def>.toml      shared service definitions, merged under `use = "<def>"`
    units/<x>.service        unit files named by unit_file

Loading is all-or-nothing: every problem in every file is collected (file, dotted key, what is
expected) and raised together as one ConfigError, so a bad commit is rejected before anything is
applied anywhere. Nothing here does I/O other than snap.read and snap.list.

Merging, lowest layer first: fleet.toml [health]/[rollout] < services/<def>.toml < the host's
table. env, vars, model, health and rollout merge key by key; unit and unit_file replace each
other as a pair. The hosts that share a definition must end with one rollout policy.
Placeholders {host.name} {host.address} {service.name} {model.id} {model.path} {vars.<name>}
are substituted in the unit text, env values, vars, health.http and model.fetch; any other
brace (systemd's ${VAR}, %i, JSON) passes through untouched.
"""

from __future__ import annotations

import contextlib
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from .source import Snapshot
from pydantic import BaseModel, ValidationError

from ..errors import ConfigError, Problem, SourceError
from . import schema
from .problems import Hints, dotted, key_path, validation_problems
from .spec import (
    DesiredState,
    FleetSettings,
    HealthSpec,
    HostSpec,
    ModelSpec,
    NotifySpec,
    PullWave,
    RolloutPolicy,
    SecretSpec,
    ServiceSpec,
    SSHSpec,
)

FLEET_FILE = "fleet.toml"
HOSTS_DIR = "hosts"
SERVICES_DIR = "services"
HEADER = "# Managed by reconciler from git; edits on this host are reverted.\n# Source: {source}\n"

PLACEHOLDER = re.compile(r"\{(host|service|model|vars)\.([A-Za-z0-9_]+)\}")
_SERVICE_SECTION = re.compile(r"^[ \t]*\[Service\][ \t]*$", re.MULTILINE)
_PARSE_POSITION = re.compile(r" at line \d+ col \d+$")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")

T = TypeVar("T", bound=BaseModel)


class SnapshotLike(Protocol):
    """What load needs from a revision: source.Snapshot, MemorySnapshot, or a test double."""

    @property
    def revision(self) -> str: ...

    def read(self, path: str) -> bytes | None: ...

    def list(self, directory: str) -> list[str]: ...


class MemorySnapshot:
    """A revision held in memory: {repo path: content}. For tests, previews and tools."""

    def __init__(self, files: Mapping[str, bytes | str], revision: str = "0" * 40):
        self.files = {
            path.strip("/"): data.encode() if isinstance(data, str) else data for path, data in files.items()
        }
        self.revision = revision

    @property
    def short(self) -> str:
        return self.revision[:7]

    def read(self, path: str) -> bytes | None:
        """The bytes of a file, or None when there is no such file."""
        return self.files.get(path.strip("/"))

    def list(self, directory: str) -> list[str]:
        """Names of the files directly inside a directory (sorted; [] when absent)."""
        prefix = directory.strip("/") + "/" if directory.strip("/") else ""
        names = {p[len(prefix) :] for p in self.files if p.startswith(prefix)}
        return sorted(n for n in names if n and "/" not in n)


def load_desired(snap: SnapshotLike) -> DesiredState:
    """Load, validate, merge and render the desired state of one revision.

    Raises ConfigError listing every problem found, in every file, when anything is wrong.
    """
    return _Loader(snap).load()


# ---- problems -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Use:
    """One service on one host: the context a problem in a shared file is reported for."""

    service: str
    host: str


class _Problems:
    """Collects problems in order; the same problem in a shared file is reported once, listing
    the services and hosts it affects (a unit file used by 500 hosts gives one line, not 500)."""

    def __init__(self) -> None:
        self._found: dict[tuple[str, str, str], list[_Use]] = {}
        self.count = 0  # every add, duplicates included: "did this step find anything?"

    def add(self, file: str, key: str, message: str, use: _Use | None = None) -> None:
        self.count += 1
        uses = self._found.setdefault((file, key, message), [])
        if use is not None and use not in uses:
            uses.append(use)

    def __bool__(self) -> bool:
        return bool(self._found)

    def result(self) -> list[Problem]:
        return [Problem(f, k, m + _uses_text(uses)) for (f, k, m), uses in self._found.items()]


def _uses_text(uses: list[_Use]) -> str:
    if not uses:
        return ""
    by_service: dict[str, list[str]] = {}
    for u in uses:
        by_service.setdefault(u.service, []).append(u.host)
    parts = []
    for service, hosts in by_service.items():
        shown = ", ".join(hosts[:5]) + (f" and {len(hosts) - 5} more" if len(hosts) > 5 else "")
        parts.append(f"service {service} on host{'s' if len(hosts) > 1 else ''} {shown}")
    return " (in " + "; ".join(parts) + ")"


# Keys that belong elsewhere: say where, rather than list the keys allowed here.
_HINTS: Hints = {
    (schema.HostSSH, "known_hosts"): "unknown key: known_hosts is fleet-wide, set it under [ssh] in fleet.toml",
    (schema.ServiceDefinition, "use"):
        "unknown key: a definition cannot `use` another one (only a host's service table can)",
}


def _without(data: dict[str, Any], paths: set[tuple[str, ...]]) -> dict[str, Any]:
    """A copy of parsed TOML with the keys at `paths` removed (absent ones are ignored)."""

    def prune(table: dict[str, Any], prefix: tuple[str, ...]) -> dict[str, Any]:
        out = {}
        for key, value in table.items():
            path = (*prefix, key)
            if path in paths:
                continue
            out[key] = prune(value, path) if isinstance(value, dict) else value
        return out

    return prune(data, ())


def _under(path: tuple[str, ...], bad: set[tuple[str, ...]]) -> bool:
    """Whether any problem path lies at or below `path`."""
    return any(b[: len(path)] == path for b in bad)


# ---- merging --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _At:
    """Where a value was set: a repo file and the dotted key inside it."""

    file: str
    key: str


@dataclass
class _Merged:
    """One service after merging its layers; every value remembers where it was set."""

    unit: tuple[str, _At] | None = None        # inline unit text
    unit_file: tuple[str, _At] | None = None   # repo path of the unit file
    conflict: bool = False                     # a layer set both unit and unit_file
    env: dict[str, tuple[str, _At]] = field(default_factory=dict)
    vars: dict[str, tuple[str, _At]] = field(default_factory=dict)
    model: dict[str, tuple[str | float, _At]] = field(default_factory=dict)  # fetch_timeout, size_gb: float
    health: dict[str, tuple[Any, _At]] = field(default_factory=dict)
    rollout: dict[str, tuple[Any, _At]] = field(default_factory=dict)
    gpu_policy: str = "report"
    adopt: bool = False
    allow_dropins: tuple[str, ...] = ()
    secrets: dict[str, tuple[schema.SecretRef, _At]] = field(default_factory=dict)

    def add_rollout(self, table: schema.RolloutTable | None, file: str, prefix: tuple[str, ...]) -> None:
        if table is None:
            return
        for name, value in table.model_dump(exclude_none=True).items():
            self.rollout[name] = (value, _At(file, dotted(*prefix, "rollout", name)))

    def policy(self) -> RolloutPolicy:
        return RolloutPolicy(**{k: v for k, (v, _) in self.rollout.items()})

    def add_health(self, table: schema.HealthTable | None, file: str, prefix: tuple[str, ...]) -> None:
        if table is None:
            return
        for name, value in table.model_dump(exclude_none=True).items():
            self.health[name] = (value, _At(file, dotted(*prefix, "health", name)))

    def add_layer(self, table: schema.ServiceDefinition, file: str, prefix: tuple[str, ...]) -> None:
        if table.unit is not None and table.unit_file is not None:
            self.conflict = True
        if table.unit is not None or table.unit_file is not None:
            # The pair is replaced as a whole: a host's unit_file clears the definition's unit.
            self.unit = (table.unit, _At(file, dotted(*prefix, "unit"))) if table.unit is not None else None
            self.unit_file = (
                (table.unit_file, _At(file, dotted(*prefix, "unit_file"))) if table.unit_file is not None else None
            )
        for k, v in table.env.items():
            self.env[k] = (v, _At(file, dotted(*prefix, "env", k)))
        for k, v in table.vars.items():
            self.vars[k] = (v, _At(file, dotted(*prefix, "vars", k)))
        if table.model is not None:
            for k, v in table.model.model_dump(exclude_none=True).items():
                self.model[k] = (v, _At(file, dotted(*prefix, "model", k)))
        self.add_health(table.health, file, prefix)
        if table.gpu_policy is not None:
            self.gpu_policy = table.gpu_policy
        if table.adopt is not None:
            self.adopt = table.adopt
        if table.allow_dropins is not None:
            self.allow_dropins = tuple(table.allow_dropins)
        for k, ref in table.secrets.items():
            self.secrets[k] = (ref, _At(file, dotted(*prefix, "secrets", k)))
        self.add_rollout(table.rollout, file, prefix)


# ---- placeholders ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Context:
    """The values placeholders may name. vars is None while the vars themselves are rendered."""

    host: dict[str, str]
    service: dict[str, str]
    model: dict[str, str] | None
    vars: dict[str, str] | None


def _render(text: str, ctx: _Context) -> tuple[str, list[tuple[int, str]]]:
    """Substitute placeholders; return the text and [(line, why)] for each unknown one."""
    unknown: list[tuple[int, str]] = []

    def substitute(m: re.Match[str]) -> str:
        space, name = m.group(1), m.group(2)
        table = {"host": ctx.host, "service": ctx.service, "model": ctx.model, "vars": ctx.vars}[space]
        if table is not None and name in table:
            return table[name]
        line = text.count("\n", 0, m.start()) + 1
        unknown.append((line, _unknown_placeholder(m.group(0), space, table)))
        return m.group(0)

    return PLACEHOLDER.sub(substitute, text), unknown


def _unknown_placeholder(found: str, space: str, table: dict[str, str] | None) -> str:
    if space == "vars" and table is None:
        return f"placeholder {found} in a var: vars cannot refer to other vars"
    if space == "model" and table is None:
        return f"placeholder {found} but the service has no model (set model.id and model.path)"
    if space == "vars":
        have = ", ".join(sorted(table or {})) or "none"
        return f"unknown placeholder {found}: no such var (vars set: {have})"
    known = ", ".join(f"{{{space}.{k}}}" for k in (table or {}))
    return f"unknown placeholder {found} (known: {known})"


def _check_health_url(url: str) -> str | None:
    """Why a rendered health URL is unusable, or None."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "the port is not a number 1-65535"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "it needs http:// or https:// and a host"
    if port is None or port == 0:
        return "it needs an explicit port, like http://{host.address}:30000/health"
    return None


# ---- the loader -----------------------------------------------------------------------------


class _Loader:
    """One load: reads files through the snapshot and collects problems as it goes."""

    def __init__(self, snap: SnapshotLike):
        self.snap = snap
        self.problems = _Problems()
        self._units: dict[str, str | None] = {}  # unit files read so far; None: unusable
        # (service, definition) -> [(host file, the host's own rollout key or None, policy,
        # the policy without the host's layer)], to check that a rollout group has one policy.
        self._rollouts: dict[tuple[str, str], list[tuple[str, _At | None, RolloutPolicy, RolloutPolicy]]] = {}

    def load(self) -> DesiredState:
        fleet = self._load_fleet()
        known_hosts = self._load_known_hosts(fleet)
        definitions = self._load_definitions()
        hosts = self._load_hosts(fleet, known_hosts, definitions)
        self._check_rollout_groups()
        pull_waves = self._pull_waves(fleet.pull, hosts)
        if self.problems:
            raise ConfigError(self.problems.result())
        notify = None
        if fleet.notify is not None:
            notify = NotifySpec(webhook=fleet.notify.webhook, format=fleet.notify.format,
                                **({"timeout": fleet.notify.timeout} if fleet.notify.timeout is not None else {}))
        return DesiredState(
            revision=self.snap.revision,
            hosts=hosts,
            settings=FleetSettings(concurrency=fleet.concurrency, notify=notify, pull_waves=pull_waves),
        )

    def _pull_waves(self, table: schema.PullTable, hosts: Mapping[str, HostSpec]) -> tuple[PullWave, ...]:
        """fleet.toml [pull] waves, checked as a schedule: names unique, no wave sooner than the
        one before it, a wave without labels (every remaining host) only last, and every wave's
        labels carried by some host (a typo would quietly move the canaries to the last wave)."""
        waves: list[PullWave] = []
        for i, w in enumerate(table.waves):
            key = f"pull.waves[#{i + 1}]"
            wave = PullWave(name=w.name or f"wave-{i + 1}", labels=dict(w.labels), after=w.after)
            earlier = next((j for j, x in enumerate(waves) if x.name == wave.name), None)
            if earlier is not None:
                self.problems.add(FLEET_FILE, f"{key}.name", f"wave {wave.name!r} is named twice (also "
                                                           f"pull.waves[#{earlier + 1}]); names must be unique")
            if waves and wave.after < waves[-1].after:
                self.problems.add(FLEET_FILE, f"{key}.after",
                                  f"{wave.after:g}s is sooner than the wave before it ({waves[-1].after:g}s): a "
                                  f"later wave deploys a commit only when it is at least as old")
            if waves and not waves[-1].labels:
                self.problems.add(FLEET_FILE, key, f"comes after pull.waves[#{i}], which has no labels and so "
                                                   f"takes every remaining host: this wave would never get one")
            if wave.labels and hosts and not any(wave.matches(h.labels) for h in hosts.values()):
                have = sorted({f"{k}={v}" for h in hosts.values() for k, v in h.labels.items()})
                want = ", ".join(f"{k}={v}" for k, v in wave.labels.items())
                self.problems.add(FLEET_FILE, f"{key}.labels", f"no host carries {want} (labels in use: "
                                                               f"{', '.join(have) or 'none'})")
            waves.append(wave)
        return tuple(waves)

    def _check_rollout_groups(self) -> None:
        """The hosts that share a definition roll out as one group, so under one policy: a host
        whose own `rollout` makes its policy differ from the others' is an error (the fleet would
        otherwise have to pick one silently)."""
        for (service, definition), entries in self._rollouts.items():
            if len({policy for _, _, policy, _ in entries}) < 2:
                continue
            for _, at, policy, base in entries:
                if at is not None and policy != base:
                    self.problems.add(
                        at.file, at.key,
                        f"this host's policy ({policy.describe()}) differs from the other hosts using "
                        f"services/{definition}.toml ({base.describe()}): the hosts that share a definition "
                        f"roll out {service} as one group under one policy; set rollout in "
                        f"services/{definition}.toml")

    # -- files --

    def _parse(self, file: str, data: bytes) -> dict[str, Any] | None:
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            self.problems.add(file, "", f"not UTF-8 text (bad byte at offset {e.start})")
            return None
        # The standard library's parser first (a tenth of tomlkit's time, and no tomlkit import:
        # every new revision is parsed whole, a 1,000-host repo is 1,000 files); tomlkit only
        # when it fails, for its message: the line, column and key of the fault.
        with contextlib.suppress(tomllib.TOMLDecodeError):
            return tomllib.loads(text)
        import tomlkit
        import tomlkit.exceptions
        try:
            parsed = tomlkit.parse(text).unwrap()
        except tomlkit.exceptions.ParseError as e:
            why = _PARSE_POSITION.sub("", str(e))
            self.problems.add(file, "", f"TOML syntax error at line {e.line}, column {e.col}: {why}")
            return None
        except (tomlkit.exceptions.TOMLKitError, ValueError) as e:
            self.problems.add(file, "", f"TOML syntax error: {e}")
            return None
        return dict(parsed)

    def _validate(self, file: str, model: type[T], data: bytes) -> tuple[T | None, set[tuple[str, ...]]]:
        """Parse and validate one file; report its problems.

        Returns the model and the key paths that had problems. When only some keys are wrong,
        the model is validated again without them, so that the rest of the file (a host's other
        services, say) is still checked and its problems reported in the same run; callers skip
        whatever lies under a bad path. None when nothing usable is left (a required key).
        """
        parsed = self._parse(file, data)
        if parsed is None:
            return None, set()
        try:
            return model.model_validate(parsed), set()
        except ValidationError as e:
            for p in validation_problems(file, model, e, data=parsed, hints=_HINTS):
                self.problems.add(p.file, p.key, p.message)
            bad = {key_path(err["loc"]) for err in e.errors(include_url=False)}
        try:
            return model.model_validate(_without(parsed, bad)), bad
        except ValidationError:
            return None, bad

    def _toml_files(self, directory: str, what: str) -> list[tuple[str, str]]:
        """(stem, path) of the .toml files in a directory; other files there are problems,
        except README* and dotfiles, so that a mistyped extension never silently does nothing."""
        found = []
        for name in self.snap.list(directory):
            path = f"{directory}/{name}"
            if name.endswith(".toml"):
                found.append((name[: -len(".toml")], path))
            elif not (name.startswith(".") or name.upper().startswith("README")):
                self.problems.add(path, "", f"not a .toml file: {directory}/ holds only <{what}>.toml files")
        return found

    # -- fleet.toml and known_hosts --

    def _load_fleet(self) -> schema.FleetFile:
        data = self.snap.read(FLEET_FILE)
        if data is None:
            return schema.FleetFile()
        return self._validate(FLEET_FILE, schema.FleetFile, data)[0] or schema.FleetFile()

    def _load_known_hosts(self, fleet: schema.FleetFile) -> str | None:
        path = fleet.ssh.known_hosts
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
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            if fields[0].startswith("@"):  # @cert-authority / @revoked marker
                fields = fields[1:]
            why = (
                schema.host_key_problem(" ".join(fields[1:3]))
                if len(fields) >= 3
                else "expected '<host patterns> <key type> <base64 key>'"
            )
            if why:
                self.problems.add(path, "", f"line {number}: {why}")
        return text

    # -- services/<def>.toml --

    def _load_definitions(self) -> dict[str, schema.ServiceDefinition | None]:
        """Every definition, used or not; None for one that exists but is invalid."""
        definitions: dict[str, schema.ServiceDefinition | None] = {}
        for name, path in self._toml_files(SERVICES_DIR, "definition"):
            definitions[name] = None
            if not schema.SERVICE_NAME.match(name):
                self.problems.add(
                    path, "", f"invalid definition name {name!r}: use letters, digits, '_' and '-' (no dots)"
                )
                continue
            data = self.snap.read(path) or b""
            definition, bad = self._validate(path, schema.ServiceDefinition, data)
            if definition is None or bad:  # a host using it is skipped: no follow-on noise
                continue
            if definition.unit is not None and definition.unit_file is not None:
                self.problems.add(path, "unit", "set either unit or unit_file, not both")
                continue
            if definition.unit_file is not None:
                self._unit_file(definition.unit_file, _At(path, "unit_file"))
            if definition.unit is not None:
                self._check_unit_text(definition.unit, _At(path, "unit"))
            definitions[name] = definition
        return definitions

    # -- units --

    def _secrets(self, merged: _Merged, env: dict[str, str]) -> tuple[SecretSpec, ...]:
        """The service's secrets, checked: exactly one source each, an age file that exists and
        is an age file, no name that env sets too. Problems name file and key, never a value."""
        out: list[SecretSpec] = []
        for name, (ref, at) in sorted(merged.secrets.items()):
            if (ref.file is None) == (ref.age is None):
                self.problems.add(at.file, at.key, "set exactly one of file (a path on the host) and age "
                                                   "(an encrypted file in this repo)")
                continue
            if name in env:
                self.problems.add(at.file, at.key, f"{name} is also set in env: a secret belongs in one place")
                continue
            if ref.file is not None:
                out.append(SecretSpec(name, "file", ref.file, ref.env))
                continue
            assert ref.age is not None
            data = self.snap.read(ref.age)
            if data is None:
                self.problems.add(at.file, f"{at.key}.age", f"file {ref.age!r} not found in the repository")
                continue
            if not data.startswith((b"age-encryption.org/v1\n", b"-----BEGIN AGE ENCRYPTED FILE-----")):
                self.problems.add(at.file, f"{at.key}.age", f"{ref.age!r} is not an age-encrypted file "
                                  f"(make it with `reconcile secrets encrypt {name}`)")
                continue
            out.append(SecretSpec(name, "age", ref.age, ref.env, ciphertext=data))
        return tuple(out)

    def _ca_file(self, path: str, at: _At) -> str | None:
        """The PEM text of a health CA bundle, or None with a problem naming file and key."""
        data = self.snap.read(path)
        if data is None:
            self.problems.add(at.file, at.key, f"file {path!r} not found in the repository")
            return None
        try:
            text = data.decode("ascii")
        except UnicodeDecodeError:
            self.problems.add(at.file, at.key, f"{path!r} is not a PEM file (not ASCII)")
            return None
        from .tls import check_ca_pem  # only where a CA is set: it imports cryptography
        why = check_ca_pem(text)
        if why:
            self.problems.add(at.file, at.key, f"{path!r} is not a usable CA bundle: {why}")
            return None
        return text

    def _unit_file(self, path: str, at: _At) -> str | None:
        """The text of a unit file (read and checked once per path), or None with a problem."""
        data = self.snap.read(path)
        if data is None:
            self.problems.add(at.file, at.key, f"file {path!r} not found in the repository")
            return None
        if path not in self._units:
            text: str | None = None
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                self.problems.add(path, "", "not UTF-8 text")
            if text is not None and not self._check_unit_text(text, _At(path, "")):
                text = None
            self._units[path] = text
        return self._units[path]

    def _check_unit_text(self, text: str, at: _At) -> bool:
        if "\x00" in text:
            self.problems.add(at.file, at.key, "the unit text contains a NUL character")
            return False
        if not _SERVICE_SECTION.search(text):
            self.problems.add(at.file, at.key, "not a service unit: no [Service] section")
            return False
        return True

    # -- hosts/<name>.toml --

    def _load_hosts(
        self,
        fleet: schema.FleetFile,
        known_hosts: str | None,
        definitions: dict[str, schema.ServiceDefinition | None],
    ) -> dict[str, HostSpec]:
        files = self._toml_files(HOSTS_DIR, "host")
        if not files:
            self.problems.add(f"{HOSTS_DIR}/", "", "no hosts: add hosts/<name>.toml")
        hosts: dict[str, HostSpec] = {}
        endpoints: dict[tuple[str, int], str] = {}
        for name, path in files:
            if not schema.HOST_NAME.match(name):
                self.problems.add(
                    path,
                    "",
                    f"invalid host name {name!r}: the file name must be <name>.toml where name has "
                    "letters, digits, '_', '.' and '-', starts with a letter or digit, at most 63",
                )
                continue
            host, bad = self._validate(path, schema.HostFile, self.snap.read(path) or b"")
            if host is None:
                continue
            port = host.ssh.port if host.ssh.port is not None else fleet.ssh.port
            other = endpoints.setdefault((host.address, port), path)
            if other != path and not _under(("ssh",), bad):
                self.problems.add(
                    path, "address", f"{host.address}:{port} is also the address of {other}: one file per host"
                )
            services = {}
            for service_name, table in host.services.items():
                if _under(("services", service_name), bad):
                    continue
                spec = self._service(name, path, host, service_name, table, fleet, definitions)
                if spec is not None:
                    services[service_name] = spec
            hosts[name] = HostSpec(
                name=name,
                ssh=SSHSpec(
                    address=host.address,
                    port=port,
                    user=host.ssh.user if host.ssh.user is not None else fleet.ssh.user,
                    host_key=host.ssh.host_key,
                    known_hosts=known_hosts,
                    known_hosts_file=fleet.ssh.known_hosts if known_hosts is not None else None,
                ),
                services=services,
                labels=dict(host.labels),
                source=path,
            )
        return hosts

    def _service(
        self,
        host_name: str,
        host_file: str,
        host: schema.HostFile,
        name: str,
        table: schema.ServiceTable,
        fleet: schema.FleetFile,
        definitions: dict[str, schema.ServiceDefinition | None],
    ) -> ServiceSpec | None:
        """Merge one service's layers, render it, and check everything that needs the host."""
        prefix = ("services", name)
        use = _Use(name, host_name)
        problems_before = self.problems.count

        merged = _Merged()
        merged.add_health(fleet.health, FLEET_FILE, ())
        merged.add_rollout(fleet.rollout, FLEET_FILE, ())
        sources = [host_file]
        def_file = None
        if table.use is not None:
            if table.use not in definitions:
                available = ", ".join(definitions) or "none"
                self.problems.add(
                    host_file,
                    dotted(*prefix, "use"),
                    f"unknown definition {table.use!r}: no services/{table.use}.toml (available: {available})",
                )
                return None
            definition = definitions[table.use]
            if definition is None:
                return None  # its own problems are already reported
            def_file = f"{SERVICES_DIR}/{table.use}.toml"
            sources.append(def_file)
            merged.add_layer(definition, def_file, ())
        if table.unit is not None and table.unit_file is not None:
            self.problems.add(host_file, dotted(*prefix, "unit"), "set either unit or unit_file, not both")
            return None
        base_policy = merged.policy()
        merged.add_layer(table, host_file, prefix)
        host_rollout = _At(host_file, dotted(*prefix, "rollout")) if table.rollout is not None else None
        if host_rollout is not None and table.use is None:
            self.problems.add(
                host_rollout.file, host_rollout.key,
                "has no effect here: only a service that uses a shared definition (`use`) rolls out in "
                "waves over the hosts that share it; set rollout in services/<definition>.toml")

        # The unit.
        text: str | None = None
        unit_at: _At | None = None
        unit_source = ""
        if merged.unit_file is not None:
            text = self._unit_file(*merged.unit_file)
            unit_source, unit_at = merged.unit_file[0], _At(merged.unit_file[0], "")
        elif merged.unit is not None:
            text, unit_at = merged.unit
            unit_source = unit_at.file
            if unit_at.file == host_file:
                self._check_unit_text(text, unit_at)
        else:
            where = f" (here or in {def_file})" if def_file else ""
            self.problems.add(host_file, dotted(*prefix), f"no unit: set unit_file or unit{where}")

        # The model: id and path are required once any model key is set, in any layer.
        model: ModelSpec | None = None
        if merged.model:
            missing = [k for k in ("id", "path") if k not in merged.model]
            for k in missing:
                where = f" (not set here nor in {def_file})" if def_file else ""
                self.problems.add(
                    host_file, dotted(*prefix, "model", k), f"required key missing: a model needs id and path{where}"
                )
            if not missing:
                model = ModelSpec(
                    id=str(merged.model["id"][0]),
                    path=str(merged.model["path"][0]),
                    architecture=str(merged.model["architecture"][0]) if "architecture" in merged.model else None,
                    fetch_timeout=(float(merged.model["fetch_timeout"][0]) if "fetch_timeout" in merged.model
                                   else 3600.0),
                    size_gb=float(merged.model["size_gb"][0]) if "size_gb" in merged.model else None,
                )

        # Placeholders: vars first (they may name host/service/model), then everything else.
        ctx = _Context(
            host={"name": host_name, "address": host.address},
            service={"name": name},
            model={"id": model.id, "path": model.path} if model else None,
            vars=None,
        )
        rendered_vars = {k: self._render_value(v, at, ctx, host_file, use) for k, (v, at) in merged.vars.items()}
        ctx = _Context(ctx.host, ctx.service, ctx.model, rendered_vars)
        env = {k: self._render_value(v, at, ctx, host_file, use) for k, (v, at) in merged.env.items()}
        if model is not None and "fetch" in merged.model:
            template, at = merged.model["fetch"]
            model = replace(model, fetch=self._render_value(str(template), at, ctx, host_file, use))

        health_values = {k: v for k, (v, _) in merged.health.items()}
        if "ca" in merged.health:
            ca_path, at = merged.health["ca"]
            health_values.pop("ca")
            health_values["ca_pem"] = self._ca_file(ca_path, at)
        if "http" in merged.health:
            template, at = merged.health["http"]
            url = self._render_value(template, at, ctx, host_file, use)
            why = None if PLACEHOLDER.search(url) else _check_health_url(url)
            if why:
                self.problems.add(
                    at.file, at.key, f"expected an http(s) URL with a host and port, got {url!r}: {why}",
                    use if at.file != host_file else None,
                )
            health_values["http"] = url

        unit_text = None
        if text is not None and unit_at is not None:
            rendered, unknown = _render(text, ctx)
            for line, why in unknown:
                where = f"line {line}: " if unit_at.key == "" else f"line {line} of the unit: "
                self.problems.add(unit_at.file, unit_at.key, where + why, use if unit_at.file != host_file else None)
            unit_text = HEADER.format(source=unit_source) + rendered.rstrip("\n") + "\n"

        if unit_text is None or self.problems.count != problems_before:
            return None
        policy = merged.policy()
        if table.use is not None:
            self._rollouts.setdefault((name, table.use), []).append((host_file, host_rollout, policy, base_policy))
        return ServiceSpec(
            name=name,
            unit_text=unit_text,
            env=env,
            health=HealthSpec(**health_values),
            model=model,
            source=" + ".join(sources),
            definition=table.use,
            rollout=policy,
            gpu_policy=merged.gpu_policy,
            adopt=merged.adopt,
            allow_dropins=merged.allow_dropins,
            secrets=self._secrets(merged, env),
        )

    def _render_value(self, value: str, at: _At, ctx: _Context, host_file: str, use: _Use) -> str:
        """Render placeholders in a one-line value (env, vars, health.http). The problem names
        the key and the placeholder, never the value: env values may be secrets."""
        rendered, unknown = _render(value, ctx)
        for _, why in unknown:
            self.problems.add(at.file, at.key, why, use if at.file != host_file else None)
        if _CONTROL.search(rendered):  # impossible by validation; kept as the last line of defence
            self.problems.add(at.file, at.key, "renders to a value with a control character")
        return rendered


def render_at(snap: Snapshot) -> Callable[[str], DesiredState | None]:
    """A function giving the desired state at another revision of the same repo (for rollback),
    cached per revision; None where that revision is missing or invalid."""
    from .source import snapshot

    cache: dict[str, DesiredState | None] = {}

    def at(rev: str) -> DesiredState | None:
        if rev not in cache:
            try:
                cache[rev] = load_desired(snapshot(snap.repo, rev, snap.subdir))
            except (ConfigError, SourceError):
                cache[rev] = None
        return cache[rev]
    return at
