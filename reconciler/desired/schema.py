"""The tables of the desired-state TOML files, exactly as written (before merging).

load.py parses each file (tomllib; tomlkit words a syntax error), validates it against one of
these tables (tables.validate) and only then merges and renders. Every table forbids unknown keys (a typo must
never silently do nothing), and every scalar is one of fields.py's types, checked by a
validator of our own (no type is ever coerced). The drain and smoke tables of a service are in
schema_drain.py. What each key means is desired-state/README.md's, for users.

The values of `env` may be secrets: their validators never put the value in a message.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from .fields import (
    AbsPath,
    Address,
    Boolean,
    Canary,
    Concurrency,
    DefinitionName,
    DropIn,
    Duration,
    EnvKey,
    EnvValue,
    HostKey,
    HttpStatus,
    HttpTemplate,
    LabelText,
    MaxUnavailable,
    ModelId,
    ModelPath,
    NonNegativeSeconds,
    NotifyFormat,
    Port,
    PositiveSeconds,
    RepoPath,
    ServiceName,
    SingleLine,
    UnitText,
    User,
    VarName,
    VarValue,
    Webhook,
)
from .schema_drain import DrainTable, MinAvailable, SmokeTable
from .tables import Table

# ---- tables ---------------------------------------------------------------------------------


class HealthTable(Table, frozen=True):
    """[health] in fleet.toml, a definition or a service; unset keys fall through to the layer below."""

    http: HttpTemplate | None = None
    startup_timeout: PositiveSeconds | None = None
    interval: PositiveSeconds | None = None
    stable_for: NonNegativeSeconds | None = None
    expect_status: HttpStatus | None = None
    body_contains: SingleLine | None = None
    ca: RepoPath | None = None


class RolloutTable(Table, frozen=True):
    """rollout = { canary, max_unavailable, min_available } in fleet.toml [rollout], a definition or a service;
    unset keys fall through to the layer below."""

    canary: Canary | None = None
    max_unavailable: MaxUnavailable | None = None
    min_available: MinAvailable | None = None


class NotifyTable(Table, frozen=True):
    """[notify] in fleet.toml: a webhook for rollout events."""

    webhook: Webhook
    format: NotifyFormat = "json"
    timeout: PositiveSeconds | None = None


class PullWaveTable(Table, frozen=True):
    """One wave of pull mode ([pull] waves in fleet.toml): the hosts whose labels all match (no
    labels: every host no earlier wave took), and how old a commit must be before they deploy it."""

    name: LabelText | None = None
    labels: dict[LabelText, LabelText] = msgspec.field(default_factory=dict)
    after: Duration = 0.0


class PullTable(Table, frozen=True):
    """[pull] in fleet.toml: the wave schedule of hosts that reconcile themselves (`reconcile pull`)."""

    waves: list[PullWaveTable] = msgspec.field(default_factory=list)


class ModelTable(Table, frozen=True):
    """model = { id, path, architecture, fetch, fetch_timeout, size_gb }; id and path are
    required once merged."""

    id: ModelId | None = None
    path: ModelPath | None = None
    architecture: SingleLine | None = None
    fetch: SingleLine | None = None
    fetch_timeout: PositiveSeconds | None = None
    size_gb: PositiveSeconds | None = None     # the checkpoint's size, for the free-space check


class SecretRef(Table, frozen=True):
    """One entry of a service's `secrets` table: exactly one of `file` (a file already on the host)
    and `age` (a file in this repo, encrypted to the controller's age key); `env`, how it is delivered."""

    file: AbsPath | None = None
    age: RepoPath | None = None
    env: Boolean = False


class ServiceDefinition(Table, frozen=True):
    """services/<def>.toml: a service table shared by several hosts (top-level keys)."""

    unit_file: RepoPath | None = None
    unit: UnitText | None = None
    env: dict[EnvKey, EnvValue] = msgspec.field(default_factory=dict)
    model: ModelTable | None = None
    vars: dict[VarName, VarValue] = msgspec.field(default_factory=dict)
    health: HealthTable | None = None
    rollout: RolloutTable | None = None
    gpu_policy: Literal["report", "kill"] | None = None
    engine_check: Literal["hidden", "visible", "off"] | None = None
    adopt: Boolean | None = None
    allow_dropins: list[DropIn] | None = None
    secrets: dict[EnvKey, SecretRef] = msgspec.field(default_factory=dict)
    drain: DrainTable | None = None
    smoke: SmokeTable | None = None


class ServiceTable(ServiceDefinition, frozen=True):
    """[services.<name>] in a host file: a definition plus `use` (merge over services/<use>.toml)."""

    use: DefinitionName | None = None


class HostSSH(Table, frozen=True):
    """[ssh] in a host file. known_hosts is deliberately fleet-wide only."""

    user: User | None = None
    port: Port | None = None
    host_key: HostKey | None = None


class HostFile(Table, frozen=True):
    """hosts/<name>.toml."""

    address: Address
    labels: dict[LabelText, LabelText] = msgspec.field(default_factory=dict)
    ssh: HostSSH = msgspec.field(default_factory=HostSSH)
    services: dict[ServiceName, ServiceTable] = msgspec.field(default_factory=dict)


class FleetSSH(Table, frozen=True):
    """[ssh] in fleet.toml: defaults for every host, and the fleet's known_hosts file."""

    user: User = "root"
    port: Port = 22
    known_hosts: RepoPath | None = None


class FleetFile(Table, frozen=True):
    """fleet.toml (optional)."""

    ssh: FleetSSH = msgspec.field(default_factory=FleetSSH)
    health: HealthTable = msgspec.field(default_factory=HealthTable)
    concurrency: Concurrency = 20
    rollout: RolloutTable = msgspec.field(default_factory=RolloutTable)
    notify: NotifyTable | None = None
    pull: PullTable = msgspec.field(default_factory=PullTable)
