"""Server version ranges as rules write them (`versions = ">=0.5.10,<0.5.14"`): whether a rule
is true for the server version on the host. Pure; packaging only for what is not plain."""

from __future__ import annotations

import functools
import operator
from typing import Literal

Unknown = Literal["apply", "skip"]


def covers(versions: str | None, unknown_version: Unknown, version: str | None) -> bool:
    """Whether a rule with this range is true for this server version (None: unknown, where
    `unknown_version` says; an unparsable version counts as unknown)."""
    if versions is None:
        return True
    if version is None:
        return unknown_version == "apply"
    plain = plain_covers(versions, version)
    if plain is not None:
        return plain
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version
    try:
        return SpecifierSet(versions).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return unknown_version == "apply"


def _release(text: str) -> tuple[int, ...] | None:
    """A plain release number (0.5.12: digits and dots only) as integers; None for anything else."""
    parts = text.strip().split(".")
    if not all(p.isascii() and p.isdigit() for p in parts):
        return None
    return tuple(int(p) for p in parts)


_ORDER = {"<=": operator.le, ">=": operator.ge, "==": operator.eq, "!=": operator.ne, "<": operator.lt,
          ">": operator.gt}


@functools.lru_cache(maxsize=256)
def _plain_clauses(versions: str) -> tuple[tuple[str, tuple[int, ...]], ...] | None:
    """A range's clauses as (comparison, release), where every clause is a plain comparison with
    a plain release, as the rule pack writes them; None for anything else. Read once per range:
    a pre-flight tests every rule bound to versions on every host."""
    out = []
    for clause in versions.split(","):
        clause = clause.strip()
        op = next((o for o in _ORDER if clause.startswith(o)), None)   # two-letter ones first
        r = _release(clause[len(op):]) if op is not None else None
        if op is None or r is None:
            return None
        out.append((op, r))
    return tuple(out)


def plain_range(versions: str) -> bool:
    """Whether a range is plain (valid, and read without packaging: plain_covers)."""
    return _plain_clauses(versions) is not None


def plain_covers(versions: str, version: str) -> bool | None:
    """`version in SpecifierSet(versions)` where both are plain: a release such as 0.5.12 against
    comparisons (<, <=, >, >=, ==, !=) with plain releases, as the rule pack writes them. There
    PEP 440 is a comparison of release numbers padded with zeros (its rules for pre-, post-,
    dev and local releases never apply); None for anything else, which packaging decides.
    Importing packaging's specifiers (they compile a large regex) costs a deploy 5-8 ms."""
    v = _release(version)
    if v is None or (clauses := _plain_clauses(versions)) is None:
        return None
    for op, r in clauses:
        n = max(len(v), len(r))
        if not _ORDER[op](v + (0,) * (n - len(v)), r + (0,) * (n - len(r))):
            return False
    return True
