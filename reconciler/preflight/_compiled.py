"""The rule pack as the checks read it: plain frozen dataclasses, no pydantic.

_schema (pydantic) validates a rule file once, with file and key in every message; what it
accepted is compiled into these (`_schema.compile_rule_file`), which the checks evaluate: the
checks never see pydantic's models, and this module imports nothing of the schema.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Severity = Literal["error", "warning"]
PLACEHOLDER = re.compile(r"\{([^{}]*)\}")


@dataclass(frozen=True)
class Condition:
    """When a rule applies; every key given must hold (an empty condition always holds)."""

    flag_any: tuple[str, ...] = ()
    flag_none: tuple[str, ...] = ()
    flags: Mapping[str, tuple[str, ...] | bool] = field(default_factory=dict)
    flags_not: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    env_any: tuple[str, ...] = ()
    env: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    env_not: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    model: tuple[str, ...] = ()
    architecture: tuple[str, ...] = ()
    model_type: tuple[str, ...] = ()
    model_id: tuple[str, ...] = ()


@dataclass(frozen=True)
class Require:
    """What must hold when a rule applies: flags (value, or true/false = given/not) and env."""

    flags: Mapping[str, tuple[str, ...] | bool] = field(default_factory=dict)
    env: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Rule:
    """One declarative rule (see _schema.Rule for what each key means)."""

    id: str
    server: Literal["sglang", "vllm", "any"]
    message: str
    fix: str
    source: str
    severity: Severity = "error"
    when: Condition = field(default_factory=Condition)
    unless: Condition | None = None
    require: Require | None = None
    versions: str | None = None
    unknown_version: Literal["apply", "skip"] = "apply"

    def covers(self, version: str | None) -> bool:
        """Whether the rule is true for this server version (None: unknown)."""
        if self.versions is None:
            return True
        if version is None:
            return self.unknown_version == "apply"
        plain = plain_covers(self.versions, version)
        if plain is not None:
            return plain
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version
        try:
            return SpecifierSet(self.versions).contains(Version(version), prereleases=True)
        except InvalidVersion:
            return self.unknown_version == "apply"


def _release(text: str) -> tuple[int, ...] | None:
    """A plain release number (0.5.12: digits and dots only) as integers; None for anything else."""
    parts = text.strip().split(".")
    if not all(p.isascii() and p.isdigit() for p in parts):
        return None
    return tuple(int(p) for p in parts)


_ORDER = {"<=": operator.le, ">=": operator.ge, "==": operator.eq, "!=": operator.ne, "<": operator.lt,
          ">": operator.gt}


def plain_covers(versions: str, version: str) -> bool | None:
    """`version in SpecifierSet(versions)` where both are plain: a release such as 0.5.12 against
    comparisons (<, <=, >, >=, ==, !=) with plain releases, as the rule pack writes them. There
    PEP 440 is a comparison of release numbers padded with zeros (its rules for pre-, post-,
    dev and local releases never apply); None for anything else, which packaging decides.
    Importing packaging's specifiers (they compile a large regex) costs a deploy about 15 ms."""
    v = _release(version)
    if v is None:
        return None
    for clause in versions.split(","):
        clause = clause.strip()
        op = next((o for o in _ORDER if clause.startswith(o)), None)   # two-letter ones first
        r = _release(clause[len(op):]) if op is not None else None
        if op is None or r is None:
            return None
        n = max(len(v), len(r))
        if not _ORDER[op](v + (0,) * (n - len(v)), r + (0,) * (n - len(r))):
            return False
    return True


@dataclass(frozen=True)
class ModelEntry:
    """Model knowledge: models matching any of ids / architectures / model_types have traits."""

    traits: tuple[str, ...]
    ids: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class CompiledFile:
    """One validated rule file, compiled."""

    rule: tuple[Rule, ...]
    model: tuple[ModelEntry, ...]
    disable: tuple[str, ...]
