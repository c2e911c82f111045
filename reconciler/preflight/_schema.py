"""The rule-file schema: RuleFile = [[rule]] tables (Rule, Condition, Require) and [[model]] tables.

Tables of desired/tables.py (checked against their annotations, every error of a file at
once): every table forbids unknown keys, and every name (rule id, flag, env variable, trait) is
checked by a small function of our own, so that a wrong value reads "expected a flag such as
'--tp-size', got 'tp-size'"; `..problems` turns the errors into file and dotted key.

These frozen tables are also what the checks evaluate (_rules): one definition of a rule. The
modules that evaluate import them for their annotations only; this module comes with the first
rule file read (_rules.parse_rule_file).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from ..desired.tables import After, Check, Invalid, Table
from ..errors import describe
from ._message import FLAG_NAME, Severity, placeholder_problem
from ._versions import Unknown, covers, plain_range

_RULE_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,79}\Z")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_TRAIT = re.compile(r"^[a-z][a-z0-9_-]{0,39}\Z")


def _fail(msg: str) -> Invalid:
    # "value_error": a bad name of a key reads as the message alone (no "invalid name: ")
    return Invalid(msg, kind="value_error")


def _checked_str(pattern: re.Pattern[str], what: str) -> Check:
    def check(v: Any) -> str:
        if not isinstance(v, str) or not pattern.match(v):
            raise _fail(f"expected {what}, got {describe(v)}")
        return v
    return Check(check)


def _values(v: Any, *, allow_bool: bool) -> tuple[str, ...] | bool:
    if isinstance(v, bool):
        if allow_bool:
            return v
        raise _fail(f"expected a string or a list of strings, got {describe(v)}")
    if isinstance(v, (str, int)):
        return (str(v),)
    if isinstance(v, list) and v and all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in v):
        return tuple(str(x) for x in v)
    extra = ", true (given) or false (not given)" if allow_bool else ""
    raise _fail(f"expected a string, an integer or a non-empty list of them{extra}, got {describe(v)}")


FlagName = Annotated[str, _checked_str(FLAG_NAME, "a flag such as '--tp-size'")]
EnvName = Annotated[str, _checked_str(_ENV_NAME, "an environment variable name")]
RuleId = Annotated[str, _checked_str(_RULE_ID, "a rule id: lowercase letters, digits and '-'")]
Trait = Annotated[str, _checked_str(_TRAIT, "a trait name such as 'hybrid'")]
FlagValues = Annotated[tuple[str, ...] | bool, Check(lambda v: _values(v, allow_bool=True))]
Values = Annotated[tuple[str, ...], Check(lambda v: _values(v, allow_bool=False))]


def _specifier(v: str) -> str:
    if plain_range(v):          # the rule pack's own: valid, with no import of packaging (5-8 ms)
        return v
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    try:
        SpecifierSet(v)
    except InvalidSpecifier:
        raise _fail(f"expected a version range such as '>=0.5.10,<0.5.14', got {describe(v)}") from None
    return v


def _placeholders(v: str) -> str:
    if not v.strip():
        raise _fail("must not be empty")
    problem = placeholder_problem(v)
    if problem is not None:
        raise _fail(problem)
    return v


def _url(v: str) -> str:
    if not re.match(r"^https?://\S+\Z", v):
        raise _fail("expected the URL (https://...) of the documentation, code or issue that justifies the rule")
    return v


def _some(v: list[str]) -> list[str]:
    if not v:
        raise _fail("expected at least one trait, got none")
    return v


class Condition(Table, frozen=True):
    """When a rule applies; every key given must hold (an empty condition always holds)."""

    flag_any: list[FlagName] = msgspec.field(default_factory=list)
    flag_none: list[FlagName] = msgspec.field(default_factory=list)
    flags: dict[FlagName, FlagValues] = msgspec.field(default_factory=dict)
    flags_not: dict[FlagName, Values] = msgspec.field(default_factory=dict)
    env_any: list[EnvName] = msgspec.field(default_factory=list)
    env: dict[EnvName, Values] = msgspec.field(default_factory=dict)
    env_not: dict[EnvName, Values] = msgspec.field(default_factory=dict)
    model: list[Trait] = msgspec.field(default_factory=list)
    architecture: list[str] = msgspec.field(default_factory=list)
    model_type: list[str] = msgspec.field(default_factory=list)
    model_id: list[str] = msgspec.field(default_factory=list)


class Require(Table, frozen=True):
    """What must hold when a rule applies: flags (value, or true/false = given/not) and env."""

    flags: dict[FlagName, FlagValues] = msgspec.field(default_factory=dict)
    env: dict[EnvName, Values] = msgspec.field(default_factory=dict)


class Rule(Table, frozen=True, kw_only=True):
    """One declarative rule from a rule file."""

    id: RuleId
    server: Literal["sglang", "vllm", "any"]
    severity: Severity = "error"
    when: Condition = msgspec.field(default_factory=Condition)
    unless: Condition | None = None
    require: Require | None = None
    message: Annotated[str, After(_placeholders)]
    fix: Annotated[str, After(_placeholders)]
    source: Annotated[str, After(_url)]
    # The server versions the rule is true for, as a PEP 440 specifier ("">=0.5.10,<0.5.14"):
    # outside it the rule does not fire. Where the host's version could not be read, the rule
    # fires ("apply", the default: as if no range were given) or does not ("skip": for a rule
    # that would wrongly block what other versions need, e.g. a flag that a later release removed).
    versions: Annotated[str, After(_specifier)] | None = None
    unknown_version: Unknown = "apply"

    def covers(self, version: str | None) -> bool:
        """Whether the rule is true for this server version (None: unknown)."""
        return covers(self.versions, self.unknown_version, version)


class ModelEntry(Table, frozen=True, kw_only=True):
    """Model knowledge: models matching any of ids / architectures / model_types have traits."""

    ids: list[str] = msgspec.field(default_factory=list)
    architectures: list[str] = msgspec.field(default_factory=list)
    model_types: list[str] = msgspec.field(default_factory=list)
    traits: Annotated[list[Trait], After(_some)]
    note: str = ""


class RuleFile(Table, frozen=True):
    """One rule file: rules, model knowledge and rule ids to disable."""

    rule: list[Rule] = msgspec.field(default_factory=list)
    model: list[ModelEntry] = msgspec.field(default_factory=list)
    disable: list[RuleId] = msgspec.field(default_factory=list)
