"""The rule-file schema (pydantic): RuleFile = [[rule]] tables (Rule, Condition, Require) and [[model]] tables.

Every table forbids unknown keys, and every name (rule id, flag, env variable, trait) is
checked by a small validator of our own, so that a wrong value reads "expected a flag such as
'--tp-size', got 'tp-size'"; `..problems` turns the errors into file and dotted key.

These frozen models are also what the checks evaluate (_rules): one definition of a rule. The
modules that evaluate import them for their annotations only, so a run that loads no rule file
never imports pydantic; pydantic comes with the first rule file read (_rules.parse_rule_file).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from ..errors import describe
from ._message import Severity, placeholder_problem
from ._versions import Unknown, covers

_RULE_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,79}\Z")
_FLAG_NAME = re.compile(r"^--?[A-Za-z0-9][A-Za-z0-9_-]*\Z")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_TRAIT = re.compile(r"^[a-z][a-z0-9_-]{0,39}\Z")


def _checked_str(pattern: re.Pattern[str], what: str) -> BeforeValidator:
    def check(v: Any) -> str:
        if not isinstance(v, str) or not pattern.match(v):
            raise ValueError(f"expected {what}, got {describe(v)}")
        return v
    return BeforeValidator(check)


def _values(v: Any, *, allow_bool: bool) -> tuple[str, ...] | bool:
    if isinstance(v, bool):
        if allow_bool:
            return v
        raise ValueError(f"expected a string or a list of strings, got {describe(v)}")
    if isinstance(v, (str, int)):
        return (str(v),)
    if isinstance(v, list) and v and all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in v):
        return tuple(str(x) for x in v)
    extra = ", true (given) or false (not given)" if allow_bool else ""
    raise ValueError(f"expected a string, an integer or a non-empty list of them{extra}, got {describe(v)}")


FlagName = Annotated[str, _checked_str(_FLAG_NAME, "a flag such as '--tp-size'")]
EnvName = Annotated[str, _checked_str(_ENV_NAME, "an environment variable name")]
RuleId = Annotated[str, _checked_str(_RULE_ID, "a rule id: lowercase letters, digits and '-'")]
Trait = Annotated[str, _checked_str(_TRAIT, "a trait name such as 'hybrid'")]
FlagValues = Annotated[tuple[str, ...] | bool, BeforeValidator(lambda v: _values(v, allow_bool=True))]
Values = Annotated[tuple[str, ...], BeforeValidator(lambda v: _values(v, allow_bool=False))]


class _Strict(BaseModel):
    # protected_namespaces=(): the fields model, model_type, model_id are ours, not pydantic's.
    # Empty defaults are written [] and {}: pydantic copies them for each instance, and
    # default_factory=list would cost an inspect.signature call (~0.4 ms) per field at import.
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


class Condition(_Strict):
    """When a rule applies; every key given must hold (an empty condition always holds)."""

    flag_any: list[FlagName] = []
    flag_none: list[FlagName] = []
    flags: dict[FlagName, FlagValues] = {}
    flags_not: dict[FlagName, Values] = {}
    env_any: list[EnvName] = []
    env: dict[EnvName, Values] = {}
    env_not: dict[EnvName, Values] = {}
    model: list[Trait] = []
    architecture: list[str] = []
    model_type: list[str] = []
    model_id: list[str] = []


class Require(_Strict):
    """What must hold when a rule applies: flags (value, or true/false = given/not) and env."""

    flags: dict[FlagName, FlagValues] = {}
    env: dict[EnvName, Values] = {}


class Rule(_Strict):
    """One declarative rule from a rule file."""

    id: RuleId
    server: Literal["sglang", "vllm", "any"]
    severity: Severity = "error"
    when: Condition = Field(default_factory=Condition)
    unless: Condition | None = None
    require: Require | None = None
    message: str
    fix: str
    source: str
    # The server versions the rule is true for, as a PEP 440 specifier ("">=0.5.10,<0.5.14"):
    # outside it the rule does not fire. Where the host's version could not be read, the rule
    # fires ("apply", the default: as if no range were given) or does not ("skip": for a rule
    # that would wrongly block what other versions need, e.g. a flag that a later release removed).
    versions: str | None = None
    unknown_version: Unknown = "apply"

    def covers(self, version: str | None) -> bool:
        """Whether the rule is true for this server version (None: unknown)."""
        return covers(self.versions, self.unknown_version, version)

    @field_validator("versions")
    @classmethod
    def _specifier(cls, v: str | None) -> str | None:
        if v is None:
            return v
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
        try:
            SpecifierSet(v)
        except InvalidSpecifier:
            raise ValueError(f"expected a version range such as '>=0.5.10,<0.5.14', got {describe(v)}") from None
        return v

    @field_validator("message", "fix")
    @classmethod
    def _placeholders(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        problem = placeholder_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @field_validator("source")
    @classmethod
    def _url(cls, v: str) -> str:
        if not re.match(r"^https?://\S+\Z", v):
            raise ValueError("expected the URL (https://...) of the documentation, code or issue "
                             "that justifies the rule")
        return v


class ModelEntry(_Strict):
    """Model knowledge: models matching any of ids / architectures / model_types have traits."""

    ids: list[str] = []
    architectures: list[str] = []
    model_types: list[str] = []
    traits: list[Trait] = Field(min_length=1)
    note: str = ""


class RuleFile(_Strict):
    """One rule file: rules, model knowledge and rule ids to disable."""

    rule: list[Rule] = []
    model: list[ModelEntry] = []
    disable: list[RuleId] = []
