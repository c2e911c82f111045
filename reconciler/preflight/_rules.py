"""The rule pack: loading it (load_rules -> RuleSet) and evaluating its declarative rules (pure).

Shipped rule files (reconciler/rules/*.toml) come first; the desired-state repo's own
rules/*.toml extend them, replace a shipped rule by id, or disable rules (shipped, repo or
built-in). A declarative rule against one service gives a `Finding` or None (`evaluate_rule`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from ..desired.spec import ServiceSpec
from ..errors import ConfigError, Problem
from ._builtin import BUILTIN_RULES
from ._command import Command
from ._message import PLACEHOLDER, Severity
from ._models import ModelInfo, glob_any

if TYPE_CHECKING:        # the rule file's own types, loaded only by parse_rule_file
    from ..desired.repo import SnapshotLike
    from ._schema import Condition, ModelEntry, Require, Rule, RuleFile

RULES_DIR = "rules"          # in the desired-state repo, and in the reconciler package


class Finding(msgspec.Struct, frozen=True):
    """One failed pre-flight check for one service: what, why, how to fix it, and who says so."""

    rule_id: str
    service: str
    severity: Severity
    message: str
    fix: str
    source: str

    @property
    def blocking(self) -> bool:
        """An error blocks this service's deploy; a warning is only reported."""
        return self.severity == "error"

    def __str__(self) -> str:
        return (f"{self.service}: {self.rule_id}: {self.message.rstrip('.')}. "
                f"Fix: {self.fix.rstrip('.')} (source: {self.source})")


class RuleSet(msgspec.Struct, frozen=True):
    """The rules in force: shipped rules, overridden or extended by the repo's, minus disabled."""

    rules: tuple[Rule, ...]
    models: tuple[ModelEntry, ...]
    disabled: frozenset[str] = frozenset()
    origin: Mapping[str, str] = msgspec.field(default_factory=dict)   # rule id -> file it came from

    def enabled(self, rule_id: str) -> bool:
        """Whether a rule (declarative or built-in) is in force, i.e. not disabled."""
        return rule_id not in self.disabled

    @property
    def ids(self) -> list[str]:
        """Every rule id in force: declarative and built-in."""
        return [r.id for r in self.rules if self.enabled(r.id)] + [
            i for i in BUILTIN_RULES if self.enabled(i)]


def parse_rule_file(data: bytes, file: str) -> RuleFile:
    """Parse and validate one rule file (the schema, loaded here and only here: its frozen
    tables are what the checks evaluate); raise ConfigError with file and key on any problem."""
    import tomllib

    from ..desired.tables import Invalid, validate
    from ..desired.toml_files import MAX_DEPTH, MAX_FILE_BYTES, nesting_depth
    from ._schema import RuleFile
    if len(data) > MAX_FILE_BYTES:      # the limits of every desired-state TOML file (toml_files.py)
        raise ConfigError([Problem(file, "", f"the file is {len(data):,} bytes: a rule file may be at most "
                                             f"{MAX_FILE_BYTES:,} bytes (1 MiB); it was not read")])
    try:
        raw = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError([Problem(file, "", "not UTF-8 text")]) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([Problem(file, "", f"invalid TOML: {e}")]) from None
    except (RecursionError, MemoryError):
        raw = None
    if raw is None or nesting_depth(raw) > MAX_DEPTH:
        raise ConfigError([Problem(file, "", f"tables or arrays nested more than {MAX_DEPTH} deep: not a rule "
                                             "file; it was not read")])
    try:
        return validate(RuleFile, raw)
    except Invalid as e:
        # problems.py loads only to explain a bad file
        from ..desired.problems import validation_problems
        raise ConfigError(validation_problems(file, RuleFile, e.errors, data=raw)) from None


def load_rules(snap: SnapshotLike | None = None) -> RuleSet:
    """The shipped rule pack plus the repo's own rules/*.toml (when a snapshot is given).

    A repo rule with the id of a shipped rule replaces it; `disable = [...]` turns rules off
    (shipped, repo or built-in). Every problem in every file is collected and raised as one
    ConfigError.
    """
    problems: list[Problem] = []
    rules: dict[str, Rule] = {}
    origin: dict[str, str] = {}
    models: list[ModelEntry] = []
    disabled: dict[str, str] = {}
    for entry in sorted((Path(__file__).parents[1] / RULES_DIR).iterdir(), key=lambda p: p.name):
        if not entry.name.endswith(".toml") or not entry.is_file():
            continue
        file = f"reconciler/{RULES_DIR}/{entry.name}"
        parsed = parse_rule_file(entry.read_bytes(), file)     # a broken shipped file is a bug: raise
        for r in parsed.rule:
            rules[r.id] = r
            origin[r.id] = file
        models.extend(parsed.model)
        disabled.update(dict.fromkeys(parsed.disable, file))
    repo_models: list[ModelEntry] = []
    if snap is not None:
        seen: dict[str, str] = {}
        for name in snap.list(RULES_DIR):
            if not name.endswith(".toml"):
                continue
            file = f"{RULES_DIR}/{name}"
            data = snap.read(file)
            if data is None:
                continue
            try:
                parsed = parse_rule_file(data, file)
            except ConfigError as e:
                problems.extend(e.problems)
                continue
            for r in parsed.rule:
                if r.id in seen:
                    problems.append(Problem(file, f"rule[{r.id}].id",
                                            f"duplicate rule id (also in {seen[r.id]})"))
                    continue
                if r.id in BUILTIN_RULES:
                    problems.append(Problem(file, f"rule[{r.id}].id",
                                            "this id belongs to a built-in rule; pick another id "
                                            "(or turn the built-in off with disable = [...])"))
                    continue
                seen[r.id] = file
                rules[r.id] = r           # replaces a shipped rule of the same id
                origin[r.id] = file
            repo_models.extend(parsed.model)
            disabled.update(dict.fromkeys(parsed.disable, file))
    known = set(rules) | set(BUILTIN_RULES)
    for rid, file in disabled.items():
        if rid not in known:
            import difflib
            close = difflib.get_close_matches(rid, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(Problem(file, "disable", f"unknown rule id {rid!r}{hint}"))
    if problems:
        raise ConfigError(problems)
    # Repo model knowledge first: the repo knows its own private models best.
    return RuleSet(rules=tuple(rules.values()), models=tuple(repo_models + models),
                   disabled=frozenset(disabled), origin=origin)


def _flag_ok(cmd: Command, flag: str, want: tuple[str, ...] | bool) -> bool:
    if isinstance(want, bool):
        return cmd.has(flag) == want
    return cmd.has(flag) and cmd.value(flag) in want


def _model_cond(info: ModelInfo, cond: Condition) -> bool:
    if cond.model and not all(t in info.traits for t in cond.model):
        return False
    if cond.architecture and not any(glob_any(a, cond.architecture) for a in info.architectures):
        return False
    if cond.model_type and not (info.model_type and glob_any(info.model_type, cond.model_type)):
        return False
    return not cond.model_id or bool(info.id and glob_any(info.id, cond.model_id))


def condition_holds(cond: Condition, cmd: Command, info: ModelInfo) -> bool:
    """Whether every key of a condition holds for this command and model (pure)."""
    if cond.flag_any and not any(cmd.has(f) for f in cond.flag_any):
        return False
    if any(cmd.has(f) for f in cond.flag_none):
        return False
    if not all(_flag_ok(cmd, f, want) for f, want in cond.flags.items()):
        return False
    for f, values in cond.flags_not.items():
        if not cmd.has(f) or cmd.value(f) in values:
            return False
    if cond.env_any and not any(cmd.env.get(v) for v in cond.env_any):
        return False
    if not all(cmd.env.get(v) in values for v, values in cond.env.items()):
        return False
    if any(cmd.env.get(v) in values for v, values in cond.env_not.items()):
        return False
    return _model_cond(info, cond)


def missing_requirements(req: Require, cmd: Command) -> list[str]:
    """The requirements a command does not meet, described without echoing env values."""
    out = []
    for f, want in req.flags.items():
        if _flag_ok(cmd, f, want):
            continue
        if want is True:
            out.append(f"{f} (not given)")
        elif want is False:
            out.append(f"no {f} (given)")
        else:
            expected = want[0] if len(want) == 1 else " | ".join(want)
            got = "not given" if not cmd.has(f) else f"given: {cmd.value(f) or 'no value'}"
            out.append(f"{f} {expected} ({got})")
    for name, values in req.env.items():
        if cmd.env.get(name) in values:
            continue
        state = "not set" if name not in cmd.env else "set to another value"
        out.append(f"{name}={values[0]} ({state})")
    return out


def render(text: str, cmd: Command, info: ModelInfo, missing: list[str]) -> str:
    """A message with its placeholders filled in for this command and model."""
    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        if name == "model":
            return info.label
        if name == "model.why":
            return "; ".join(info.why.values()) or "no model facts"
        if name == "missing":
            return ", ".join(missing) or "nothing"
        if name.startswith("flag:"):
            return cmd.value(name[5:]) or ("given" if cmd.has(name[5:]) else "not given")
        return m.group(0)
    return PLACEHOLDER.sub(sub, text)


def evaluate_rule(rule: Rule, svc: ServiceSpec, cmd: Command, info: ModelInfo,
                  version: str | None = None) -> Finding | None:
    """One declarative rule against one service: a Finding when it fails, else None (pure).

    version: the server's version on the host (None: unknown), for rules with a range."""
    if (rule.server not in ("any", cmd.server) or not rule.covers(version) or not condition_holds(rule.when, cmd, info)
            or (rule.unless is not None and condition_holds(rule.unless, cmd, info))):
        return None
    missing: list[str] = []
    if rule.require is not None:
        missing = missing_requirements(rule.require, cmd)
        if not missing:
            return None
    return Finding(rule.id, svc.name, rule.severity, render(rule.message, cmd, info, missing),
                   render(rule.fix, cmd, info, missing), rule.source)
