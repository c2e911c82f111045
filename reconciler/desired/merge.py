"""A service's layers merged into one table, every value remembering the file and key that set it.

Lowest layer first: fleet.toml [health]/[rollout] < services/<def>.toml < the host's table.
env, vars, model, health, rollout, secrets, drain and smoke merge key by key (drain's and
smoke's sub-tables and lists whole); unit and unit_file replace each other as a pair. A value
keeps where it was set (At) because a problem found later, after rendering or when a file it
names is read, must name the file and key the user wrote it in, which for a shared definition
is not the host's file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from . import schema
from .problems import dotted
from .spec import RolloutPolicy
from .tables import Table

V = TypeVar("V")


class At(msgspec.Struct, frozen=True):
    """Where a value was set: a repo file and the dotted key inside it."""

    file: str
    key: str


class Merged(msgspec.Struct):
    """One service after merging its layers; every value remembers where it was set."""

    unit: tuple[str, At] | None = None        # inline unit text
    unit_file: tuple[str, At] | None = None   # repo path of the unit file
    env: dict[str, tuple[str, At]] = msgspec.field(default_factory=dict)
    vars: dict[str, tuple[str, At]] = msgspec.field(default_factory=dict)
    model: dict[str, tuple[str | float, At]] = msgspec.field(default_factory=dict)  # fetch_timeout, size_gb: float
    health: dict[str, tuple[Any, At]] = msgspec.field(default_factory=dict)
    rollout: dict[str, tuple[Any, At]] = msgspec.field(default_factory=dict)
    gpu_policy: str = "report"
    engine_check: str = "hidden"
    adopt: bool = False
    allow_dropins: tuple[str, ...] = ()
    secrets: dict[str, tuple[schema.SecretRef, At]] = msgspec.field(default_factory=dict)
    drain: dict[str, tuple[Any, At]] = msgspec.field(default_factory=dict)   # key -> value (sub-tables whole)
    smoke: dict[str, tuple[Any, At]] = msgspec.field(default_factory=dict)
    tables: dict[str, At] = msgspec.field(default_factory=dict)   # sub-table -> where the top layer wrote it

    def policy(self) -> RolloutPolicy:
        return RolloutPolicy(**{k: v for k, (v, _) in self.rollout.items()})

    def add_table(self, name: str, table: Table | None, file: str, prefix: tuple[str, ...]) -> None:
        """A sub-table's keys (model, health, rollout, drain, smoke) over the layer below."""
        if table is not None:
            self.tables[name] = At(file, dotted(*prefix, name))
            _add(getattr(self, name), _set(table), file, (*prefix, name))

    def add_layer(self, table: schema.ServiceDefinition, file: str, prefix: tuple[str, ...]) -> None:
        """Merge a definition or a host's service table over what is here."""
        if table.unit is not None or table.unit_file is not None:
            # The pair is replaced as a whole: a host's unit_file clears the definition's unit.
            self.unit = (table.unit, At(file, dotted(*prefix, "unit"))) if table.unit is not None else None
            self.unit_file = (
                (table.unit_file, At(file, dotted(*prefix, "unit_file"))) if table.unit_file is not None else None
            )
        for name in ("env", "vars", "secrets"):
            _add(getattr(self, name), getattr(table, name), file, (*prefix, name))
        for name in ("gpu_policy", "engine_check", "adopt"):
            if getattr(table, name) is not None:
                setattr(self, name, getattr(table, name))
        if table.allow_dropins is not None:
            self.allow_dropins = tuple(table.allow_dropins)
        for name in ("model", "health", "rollout", "drain", "smoke"):
            self.add_table(name, getattr(table, name), file, prefix)


def _add(into: dict[str, tuple[V, At]], values: Mapping[str, V], file: str, prefix: tuple[str, ...]) -> None:
    """A layer's keys over the layer below, each value as written (a sub-table or a list
    replaces the one below whole: a call or the smoke checks are never merged part by part)."""
    for name, value in values.items():
        into[name] = (value, At(file, dotted(*prefix, name)))


def _set(table: Table) -> dict[str, Any]:
    """The keys a table sets (not None), in the order of its fields, each value as it is."""
    return {k: v for k, v in msgspec.structs.asdict(table).items() if v is not None}
