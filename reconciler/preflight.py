"""Pre-flight checks before a model server is (re)started: flag rules as data, model presence.

Everything here is pure except the text of one shell command:

* `parse_command(svc)` reads the server command line of a rendered unit (its last
  ExecStart=, after systemd's prefixes and line continuations), splits it into flags and env,
  and detects the server kind (sglang or vllm).
* The rule pack is data: TOML files shipped in reconciler/rules/ plus the desired-state repo's
  own rules/*.toml (`load_rules`), validated with pydantic; a bad user file is a ConfigError
  naming file and key. `check_service` and `check_host` evaluate them, together with a few
  built-in checks that need arithmetic or look across services (parallel sizes vs GPUs, heads
  divisibility, quantization vs checkpoint, GPUs and ports shared on one host). Every result
  is a `Finding` with a rule id, the fix and the source that justifies the rule.
* Model presence: `model_check_command(paths)` reads config.json, the safetensors index and the
  size of every weight file in one round trip; `parse_model_check` names what is missing.

What a model is ("hybrid": it keeps recurrent linear-attention / SSM state) comes from the
model's own config.json when the caller has read it from the host (dry-run, apply), and
otherwise (validate: no host access) from the model id and the declared architecture, looked
up in the `[[model]]` tables of the rule files (rules/models.toml, extendable from the repo).

A rule file::

    disable = ["port-conflict"]          # optional: rule ids (shipped or built-in) to turn off

    [[rule]]
    id = "sglang-spec-hybrid-extra-buffer"   # lowercase, digits, '-'; a repo rule with the id
                                             # of a shipped rule replaces it
    server = "sglang"                    # "sglang" | "vllm" | "any"
    severity = "error"                   # "error" blocks the deploy; "warning" is reported
    when = { flag_any = ["--speculative-algorithm"], model = ["hybrid"] }
    unless = { flag_any = ["--disable-radix-cache"] }      # optional
    require = { flags = { "--mamba-scheduler-strategy" = "extra_buffer" },
                env = { SGLANG_ENABLE_SPEC_V2 = ["1", "true"] } }   # optional
    message = "... needs ... (missing: {missing})"
    fix = "..."
    source = "https://..."

    [[model]]                            # model knowledge: ids/architectures -> traits
    ids = ["*/Qwen3.5-*"]                # globs, case-insensitive
    architectures = ["Qwen3_5*"]
    traits = ["hybrid"]

A rule fires when `when` holds, `unless` does not, and `require` (if any) is not met; without
`require` it fires whenever `when` holds. Conditions (all given keys must hold): `flag_any`,
`flag_none`, `flags` (flag given with one of the values; true = given, false = not given),
`flags_not` (flag given with a value not listed), `env_any`, `env` (value listed), `env_not`
(unset or not listed), `model` (traits, all of them), `architecture`, `model_type` and
`model_id` (globs, any). A condition about the model is false when the model is unknown.
Message placeholders: {flag:--name} (its value), {model}, {model.why}, {missing}. Env values
never appear in messages (they may be secrets).
"""

from __future__ import annotations

import base64
import binascii
import difflib
import fnmatch
import importlib.resources
import json
import re
import secrets
import shlex
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from .errors import ConfigError, ObserveError, Problem
from .spec import DesiredState, HostSpec, ServiceSpec

RULES_DIR = "rules"          # in the desired-state repo, and in this package

Severity = Literal["error", "warning"]
Server = Literal["sglang", "vllm"]

# ---- findings ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
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


# ---- the server command line ------------------------------------------------------------------

DEFAULT_PORT: dict[str, int] = {"sglang": 30000, "vllm": 8000}
# vLLM binds every interface when --host is not given; SGLang binds 127.0.0.1.
DEFAULT_HOST: dict[str, str] = {"sglang": "127.0.0.1", "vllm": "0.0.0.0"}
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", "", "*"})

# Alternative spellings, mapped to one canonical name per server so that rules can name either.
# SGLang: python/sglang/srt/server_args.py (aliases=[...]); vLLM: vllm/engine/arg_utils.py.
_ALIASES: dict[str, dict[str, tuple[str, ...]]] = {
    "sglang": {
        "--model-path": ("--model",),
        "--tp-size": ("--tp", "--tensor-parallel-size"),
        "--dp-size": ("--dp", "--data-parallel-size"),
        "--pp-size": ("--pipeline-parallel-size",),
        "--ep-size": ("--ep", "--expert-parallel-size"),
        "--speculative-algorithm": ("--speculative-algo",),
    },
    "vllm": {
        "--model": (),
        "--tensor-parallel-size": ("-tp",),
        "--pipeline-parallel-size": ("-pp",),
        "--data-parallel-size": ("-dp",),
        "--quantization": ("-q",),
    },
}
_CANONICAL: dict[str, dict[str, str]] = {
    server: {alias: name for name, aliases in table.items() for alias in (name, *aliases)}
    for server, table in _ALIASES.items()
}
# Flags that take no value: without this list `--trust-remote-code MODEL` would read MODEL as
# the flag's value. Any other flag followed by a non-flag token takes that token.
_BOOLEAN_FLAGS: dict[str, frozenset[str]] = {
    "sglang": frozenset({
        "--trust-remote-code", "--enable-dp-attention", "--enable-dp-lm-head",
        "--disable-radix-cache", "--disable-cuda-graph", "--disable-overlap-schedule",
        "--enable-torch-compile", "--enable-metrics", "--enable-mixed-chunk", "--enable-p2p-check",
        "--disable-custom-all-reduce", "--skip-server-warmup", "--enable-multimodal",
        "--enable-cache-report", "--skip-tokenizer-init", "--enable-ep-moe",
    }),
    "vllm": frozenset({
        "--trust-remote-code", "--enforce-eager", "--enable-prefix-caching",
        "--no-enable-prefix-caching", "--enable-chunked-prefill", "--no-enable-chunked-prefill",
        "--enable-expert-parallel", "--enable-auto-tool-choice", "--disable-log-requests",
        "--disable-log-stats", "--disable-custom-all-reduce", "--headless",
    }),
}
_PARALLEL = {
    # (tensor, pipeline, data) flag names after canonicalisation
    "sglang": ("--tp-size", "--pp-size", "--dp-size"),
    "vllm": ("--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size"),
}
_SYSTEMD_EXEC_PREFIX = re.compile(r"^[-@+!:|]+")
_ENV_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.DOTALL)
_VAR_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_BARE_VAR = re.compile(r"^\$([A-Za-z_][A-Za-z0-9_]*)$")
_PYTHON = re.compile(r"^python[0-9.]*$")
_SHELLS = frozenset({"sh", "bash", "dash", "zsh"})


@dataclass(frozen=True)
class Command:
    """A model server's command line as systemd will run it.

    flags maps canonical flag names to their value (None: a flag given without a value; a flag
    given several times keeps the last value; a flag with several values keeps them joined by
    spaces). env is what the process gets: the unit's Environment= lines, then the service's env
    (the reconciler's drop-in, read after the unit), then `env VAR=...` on the command line.
    """

    server: Server | None
    argv: tuple[str, ...] = ()
    flags: Mapping[str, str | None] = field(default_factory=dict)
    positionals: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    error: str | None = None          # why the command line could not be read, if it could not

    def canonical(self, flag: str) -> str:
        """The canonical spelling of a flag for this server (`--tp` -> `--tp-size`)."""
        flag = _normalise_flag(flag)
        return _CANONICAL.get(self.server or "", {}).get(flag, flag)

    def has(self, flag: str) -> bool:
        """Whether the flag (or one of its aliases) is given."""
        return self.canonical(flag) in self.flags

    def value(self, flag: str) -> str | None:
        """The flag's value; None when it is absent or given without a value."""
        return self.flags.get(self.canonical(flag))

    def int_value(self, flag: str, default: int) -> int | None:
        """The flag as an integer: default when absent, None when it is not an integer."""
        if not self.has(flag):
            return default
        raw = self.value(flag)
        try:
            return int(raw) if raw is not None else None
        except ValueError:
            return None

    @property
    def model(self) -> str | None:
        """The model path or id the server loads."""
        if self.server == "vllm":
            if self.positionals:
                return self.positionals[0]
            return self.value("--model")
        if self.server == "sglang":
            return self.value("--model-path")
        return None

    @property
    def port(self) -> int | None:
        """The HTTP port: --port, else the server's default; None when unknown."""
        if self.server is None:
            return None
        return self.int_value("--port", DEFAULT_PORT[self.server])

    @property
    def host(self) -> str:
        """The address the HTTP server binds: --host, else the server's default."""
        value = self.value("--host") if self.server else None
        return value if value is not None else DEFAULT_HOST.get(self.server or "", "")

    @property
    def visible_devices(self) -> list[str] | None:
        """CUDA_VISIBLE_DEVICES as a list of device ids; None when unset (all GPUs).

        CUDA stops at the first invalid id (e.g. -1), so the list does too.
        """
        raw = self.env.get("CUDA_VISIBLE_DEVICES")
        if raw is None:
            return None
        ids: list[str] = []
        for part in raw.split(","):
            part = part.strip()
            if not part or part.startswith("-"):
                break
            ids.append(part)
        return ids

    def world_size(self) -> int | None:
        """How many GPUs the server process group uses, or None when a size is not a number.

        SGLang: tp x pp x dp, except that with --enable-dp-attention the dp groups live inside
        the tp ranks (tp GPUs in all). vLLM: tp x pp x dp (`world_size_across_dp`).
        """
        if self.server is None:
            return None
        tp_flag, pp_flag, dp_flag = _PARALLEL[self.server]
        tp, pp, dp = (self.int_value(tp_flag, 1), self.int_value(pp_flag, 1),
                      self.int_value(dp_flag, 1))
        if tp is None or pp is None or dp is None:
            return None
        if self.server == "sglang" and self.has("--enable-dp-attention"):
            dp = 1
        return tp * pp * dp


def _normalise_flag(flag: str) -> str:
    # vLLM accepts --tensor_parallel_size for --tensor-parallel-size; treat both alike.
    if flag.startswith("--"):
        return "--" + flag[2:].replace("_", "-")
    return flag


def _is_flag(token: str) -> bool:
    return len(token) > 1 and token.startswith("-") and not re.match(r"^-\d", token)


def unit_entries(unit_text: str, section: str = "Service") -> list[tuple[str, str]]:
    """(key, value) pairs of one section of a unit file, in order.

    Follows systemd's syntax: comment lines start with # or ;, a trailing backslash continues
    a line (comment lines inside a continuation are skipped), keys and values are stripped.
    """
    out: list[tuple[str, str]] = []
    current: str | None = None
    pending = ""
    for raw in unit_text.splitlines():
        line = raw.strip()
        if pending:
            if line.startswith(("#", ";")):
                continue
            line = pending + " " + line
            pending = ""
        elif not line or line.startswith(("#", ";")):
            continue
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1].strip()
            continue
        key, sep, value = line.partition("=")
        if sep and current == section:
            out.append((key.strip(), value.strip()))
    if pending:
        key, sep, value = pending.partition("=")
        if sep and current == section:
            out.append((key.strip(), value.strip()))
    return out


def _environment_lines(entries: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for key, value in entries:
        if key != "Environment":
            continue
        if not value:
            continue  # an empty Environment= in a drop-in does not clear; nothing to add
        try:
            words = shlex.split(value)
        except ValueError:
            continue
        for word in words:
            m = _ENV_ASSIGNMENT.match(word)
            if m:
                env[m.group(1)] = m.group(2)
    return env


def _expand(tokens: list[str], env: Mapping[str, str]) -> list[str]:
    """systemd's ExecStart expansion: ${VAR} inside a word, $VAR alone splits into words."""
    out: list[str] = []
    for tok in tokens:
        bare = _BARE_VAR.match(tok)
        if bare:
            if bare.group(1) in env:
                out.extend(env[bare.group(1)].split())
                continue
            out.append(tok)
            continue
        out.append(_VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), tok))
    return out


def _basename(token: str) -> str:
    return token.rsplit("/", 1)[-1]


def _locate_server(tokens: list[str], env: dict[str, str]) -> tuple[Server | None, list[str]]:
    """Find the server entry point; return its kind and the tokens after it.

    Understands `env VAR=x ...`, `sh -c "exec ..."`, `python3 [-u ...] -m module`,
    `sglang serve`, `vllm serve` and the test fleet's `sglang-standin`. Adds env assignments
    it meets to env.
    """
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        base = _basename(tok)
        m = _ENV_ASSIGNMENT.match(tok)
        if m:
            # Before the server's entry point, VAR=value is an assignment (`env A=1 python ...`,
            # `sh -c "A=1 exec python ..."`); the server process sees it.
            env[m.group(1)] = m.group(2)
            i += 1
            continue
        if base in ("env", "exec", "nohup", "numactl", "taskset"):
            i += 1
            continue
        if base in _SHELLS:
            # sh -c "script" (or -lc, -ec): the script, usually `exec python -m ...`, is the
            # command.
            c = next((j for j in range(i + 1, len(tokens))
                      if re.match(r"^-[a-z]*c[a-z]*$", tokens[j])), None)
            if c is not None and c + 1 < len(tokens):
                try:
                    inner = shlex.split(tokens[c + 1])
                except ValueError:
                    return None, []
                return _locate_server(inner, env)
            return None, []
        if _PYTHON.match(base):
            return _python_entry(tokens[i + 1:])
        if base == "sglang" and tokens[i + 1:i + 2] == ["serve"]:
            return "sglang", tokens[i + 2:]
        if base == "vllm" and tokens[i + 1:i + 2] == ["serve"]:
            return "vllm", tokens[i + 2:]
        if "sglang-standin" in base:
            return "sglang", tokens[i + 1:]
        if base in ("sglang", "vllm"):
            return None, []
        i += 1          # a wrapper (numactl, taskset, ...) or one of its options
    return None, []


def _python_entry(args: list[str]) -> tuple[Server | None, list[str]]:
    """`python3 [options] -m module ...` or `python3 [options] path/to/sglang/launch_server.py`."""
    j = 0
    while j < len(args):
        tok = args[j]
        if tok == "-m":
            module, rest = (args[j + 1] if j + 1 < len(args) else ""), args[j + 2:]
            if module == "sglang.launch_server":
                return "sglang", rest
            if module == "vllm.entrypoints.openai.api_server":
                return "vllm", rest
            if module == "sglang" and rest[:1] == ["serve"]:
                return "sglang", rest[1:]
            if module in ("vllm", "vllm.entrypoints.cli.main") and rest[:1] == ["serve"]:
                return "vllm", rest[1:]
            return None, []
        if tok in ("-X", "-W"):
            j += 2                   # options of python itself that take a value
        elif tok.startswith("-"):
            j += 1
        else:                        # a script: python stops reading its own options here
            if tok.endswith("sglang/launch_server.py"):
                return "sglang", args[j + 1:]
            if tok.endswith("vllm/entrypoints/openai/api_server.py"):
                return "vllm", args[j + 1:]
            return None, []
    return None, []


def _parse_flags(server: Server, args: list[str]) -> tuple[dict[str, str | None], list[str]]:
    canonical = _CANONICAL[server]
    booleans = _BOOLEAN_FLAGS[server]
    flags: dict[str, str | None] = {}
    positionals: list[str] = []
    last: str | None = None          # the flag whose value the previous token was
    i = 0
    while i < len(args):
        tok = args[i]
        if tok == "--":
            positionals.extend(args[i + 1:])
            break
        if _is_flag(tok):
            name, eq, val = tok.partition("=")
            name = canonical.get(_normalise_flag(name), _normalise_flag(name))
            last = None
            if eq:
                flags[name] = val
            elif name in booleans or i + 1 >= len(args) or _is_flag(args[i + 1]):
                flags[name] = None
            else:
                flags[name] = args[i + 1]
                last = name
                i += 1
        elif last is not None and server == "sglang":
            # SGLang has no positionals: extra words belong to a multi-value flag
            # (--cuda-graph-bs 1 2 4).
            flags[last] = f"{flags[last]} {tok}"
        else:
            positionals.append(tok)
            last = None
        i += 1
    return flags, positionals


def parse_command(svc: ServiceSpec) -> Command:
    """The model server command of a service: the last ExecStart= of its unit, parsed (pure).

    systemd prefixes (-, @, +, !, :) are dropped (with @ the next word is argv[0] and is
    skipped), continuation lines are joined, ${VAR}/$VAR are expanded from the unit's
    Environment= lines and the service's env. A unit without a recognised server gives a
    Command whose server is None (no server rules apply to it).
    """
    entries = unit_entries(svc.unit_text)
    env = _environment_lines(entries)
    env.update(svc.env)              # the reconciler's env drop-in is read after the unit
    exec_start: str | None = None
    for key, value in entries:
        if key == "ExecStart":
            exec_start = value or None   # an empty ExecStart= resets the list
    if exec_start is None:
        return Command(server=None, env=env, error="no ExecStart= in [Service]")
    m = _SYSTEMD_EXEC_PREFIX.match(exec_start)
    prefix = m.group(0) if m else ""
    try:
        tokens = shlex.split(exec_start[len(prefix):])
    except ValueError as e:
        return Command(server=None, env=env, error=f"ExecStart= cannot be split: {e}")
    if "@" in prefix and len(tokens) > 1:
        tokens = [tokens[0], *tokens[2:]]
    tokens = _expand(tokens, env)
    server, args = _locate_server(tokens, env)
    if server is None:
        return Command(server=None, argv=tuple(tokens), env=env)
    flags, positionals = _parse_flags(server, args)
    return Command(server=server, argv=tuple(tokens), flags=flags,
                   positionals=tuple(positionals), env=env)


# ---- model knowledge --------------------------------------------------------------------------

# Layer kinds that carry recurrent state (Gated DeltaNet / linear attention, Mamba SSM) in the
# layer lists of hybrid configs: Qwen3.5 / Qwen3-Next `layer_types`, Granite-4.0-H `layer_types`,
# Jamba `layers_block_type`, Nemotron-H `hybrid_override_pattern` ("M" = Mamba layer).
_RECURRENT_LAYER_KINDS = frozenset({"linear_attention", "mamba", "mamba2"})


@dataclass(frozen=True)
class ModelInfo:
    """What the checks know about a service's model, and how they know it."""

    id: str | None = None
    architectures: tuple[str, ...] = ()
    model_type: str | None = None
    traits: frozenset[str] = frozenset()
    why: dict[str, str] = field(default_factory=dict)      # trait -> evidence, for messages
    known: bool = False              # False: no config.json and nothing in the table
    config: Mapping[str, Any] | None = None

    @property
    def label(self) -> str:
        return self.id or (self.architectures[0] if self.architectures else "the model")


def _sections(config: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    out: list[tuple[str, Mapping[str, Any]]] = [("", config)]
    text = config.get("text_config")
    if isinstance(text, Mapping):
        out.append(("text_config.", text))
    return out


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config (text_config for multimodal wrappers)."""
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def _recurrent_layers(config: Mapping[str, Any]) -> str | None:
    """Evidence that a config.json describes a model with recurrent (linear/SSM) layers."""
    for prefix, section in _sections(config):
        for key in ("layer_types", "layers_block_type"):
            kinds = section.get(key)
            if isinstance(kinds, list):
                n = sum(1 for k in kinds if isinstance(k, str) and k.lower() in _RECURRENT_LAYER_KINDS)
                if n:
                    names = sorted({k for k in kinds if isinstance(k, str) and k.lower() in _RECURRENT_LAYER_KINDS})
                    return f"config.json {prefix}{key} has {n} of {len(kinds)} {'/'.join(names)} layers"
        pattern = section.get("hybrid_override_pattern")
        if isinstance(pattern, str) and "M" in pattern:
            return f"config.json {prefix}hybrid_override_pattern has {pattern.count('M')} Mamba layers"
    return None


def _glob_any(value: str, patterns: Iterable[str]) -> str | None:
    low = value.lower()
    for p in patterns:
        if fnmatch.fnmatchcase(low, p.lower()):
            return p
    return None


def model_info(svc: ServiceSpec, config: Mapping[str, Any] | None, table: Iterable[ModelEntry]) -> ModelInfo:
    """What is known about the model of a service (pure).

    With the model's config.json (read from the host): its architectures and model_type, and
    its traits from the layer lists (an unknown architecture with linear_attention layers is
    still hybrid) and from the table. Without it: the table, by model id and by the
    architecture declared in the repo (model.architecture).
    """
    entries = list(table)
    model_id = svc.model.id if svc.model else None
    traits: set[str] = set()
    why: dict[str, str] = {}
    if config is not None:
        archs: list[str] = []
        model_type = None
        for _, section in _sections(config):
            a = section.get("architectures")
            if isinstance(a, list):
                archs.extend(x for x in a if isinstance(x, str) and x not in archs)
            if model_type is None and isinstance(section.get("model_type"), str):
                model_type = section["model_type"]
        evidence = _recurrent_layers(config)
        if evidence:
            traits.add("hybrid")
            why["hybrid"] = evidence
        for entry in entries:
            hit = _entry_match(entry, None, archs, model_type)
            if hit:
                for t in entry.traits:
                    if t not in traits:
                        traits.add(t)
                        why[t] = hit
        return ModelInfo(id=model_id, architectures=tuple(archs), model_type=model_type,
                         traits=frozenset(traits), why=why, known=True, config=config)
    declared = svc.model.architecture if svc.model else None
    archs_declared = [declared] if declared else []
    known = False
    for entry in entries:
        hit = _entry_match(entry, model_id, archs_declared, None)
        if hit:
            known = True
            for t in entry.traits:
                if t not in traits:
                    traits.add(t)
                    why[t] = hit
    return ModelInfo(id=model_id, architectures=tuple(archs_declared), traits=frozenset(traits),
                     why=why, known=known)


def _entry_match(entry: ModelEntry, model_id: str | None, archs: list[str], model_type: str | None) -> str | None:
    if model_id:
        p = _glob_any(model_id, entry.ids)
        if p:
            return f"model id matches {p}"
    for a in archs:
        p = _glob_any(a, entry.architectures)
        if p:
            return f"architecture {a}"
    if model_type:
        p = _glob_any(model_type, entry.model_types)
        if p:
            return f"model_type {model_type}"
    return None


# ---- the rule schema --------------------------------------------------------------------------

_RULE_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,79}$")
_FLAG_NAME = re.compile(r"^--?[A-Za-z0-9][A-Za-z0-9_-]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TRAIT = re.compile(r"^[a-z][a-z0-9_-]{0,39}$")
_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
_PLACEHOLDERS_FIXED = ("model", "model.why", "missing")


def _checked_str(pattern: re.Pattern[str], what: str) -> Any:
    def check(v: Any) -> str:
        if not isinstance(v, str) or not pattern.match(v):
            raise ValueError(f"expected {what}, got {_describe(v)}")
        return v
    return BeforeValidator(check)


def _describe(v: Any) -> str:
    if isinstance(v, str):
        return repr(v if len(v) <= 60 else v[:57] + "...")
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return "a table" if isinstance(v, dict) else "a list" if isinstance(v, list) else type(v).__name__


def _values(v: Any, *, allow_bool: bool) -> tuple[str, ...] | bool:
    if isinstance(v, bool):
        if allow_bool:
            return v
        raise ValueError(f"expected a string or a list of strings, got {_describe(v)}")
    if isinstance(v, (str, int)):
        return (str(v),)
    if isinstance(v, list) and v and all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in v):
        return tuple(str(x) for x in v)
    extra = ", true (given) or false (not given)" if allow_bool else ""
    raise ValueError(f"expected a string, an integer or a non-empty list of them{extra}, got {_describe(v)}")


FlagName = Annotated[str, _checked_str(_FLAG_NAME, "a flag such as '--tp-size'")]
EnvName = Annotated[str, _checked_str(_ENV_NAME, "an environment variable name")]
RuleId = Annotated[str, _checked_str(_RULE_ID, "a rule id: lowercase letters, digits and '-'")]
Trait = Annotated[str, _checked_str(_TRAIT, "a trait name such as 'hybrid'")]
FlagValues = Annotated[tuple[str, ...] | bool, BeforeValidator(lambda v: _values(v, allow_bool=True))]
Values = Annotated[tuple[str, ...], BeforeValidator(lambda v: _values(v, allow_bool=False))]


class _Strict(BaseModel):
    # protected_namespaces=(): the fields model, model_type, model_id are ours, not pydantic's.
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


class Condition(_Strict):
    """When a rule applies; every key given must hold (an empty condition always holds)."""

    flag_any: list[FlagName] = Field(default_factory=list)
    flag_none: list[FlagName] = Field(default_factory=list)
    flags: dict[FlagName, FlagValues] = Field(default_factory=dict)
    flags_not: dict[FlagName, Values] = Field(default_factory=dict)
    env_any: list[EnvName] = Field(default_factory=list)
    env: dict[EnvName, Values] = Field(default_factory=dict)
    env_not: dict[EnvName, Values] = Field(default_factory=dict)
    model: list[Trait] = Field(default_factory=list)
    architecture: list[str] = Field(default_factory=list)
    model_type: list[str] = Field(default_factory=list)
    model_id: list[str] = Field(default_factory=list)


class Require(_Strict):
    """What must hold when a rule applies: flags (value, or true/false = given/not) and env."""

    flags: dict[FlagName, FlagValues] = Field(default_factory=dict)
    env: dict[EnvName, Values] = Field(default_factory=dict)


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

    @field_validator("message", "fix")
    @classmethod
    def _placeholders(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        for m in _PLACEHOLDER.finditer(v):
            name = m.group(1)
            if name in _PLACEHOLDERS_FIXED:
                continue
            if name.startswith("flag:") and _FLAG_NAME.match(name[5:]):
                continue
            raise ValueError(f"unknown placeholder {{{name}}} (allowed: {{flag:--name}}, "
                             + ", ".join("{" + p + "}" for p in _PLACEHOLDERS_FIXED) + ")")
        return v

    @field_validator("source")
    @classmethod
    def _url(cls, v: str) -> str:
        if not re.match(r"^https?://\S+$", v):
            raise ValueError("expected the URL (https://...) of the documentation, code or issue "
                             "that justifies the rule")
        return v


class ModelEntry(_Strict):
    """Model knowledge: models matching any of ids / architectures / model_types have traits."""

    ids: list[str] = Field(default_factory=list)
    architectures: list[str] = Field(default_factory=list)
    model_types: list[str] = Field(default_factory=list)
    traits: list[Trait] = Field(min_length=1)
    note: str = ""


class RuleFile(_Strict):
    """One rule file: rules, model knowledge and rule ids to disable."""

    rule: list[Rule] = Field(default_factory=list)
    model: list[ModelEntry] = Field(default_factory=list)
    disable: list[RuleId] = Field(default_factory=list)


# ---- built-in rules (not expressible as data) -------------------------------------------------

_SGLANG_ARGS = "https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/server_args.py"
_VLLM_PARALLEL = "https://github.com/vllm-project/vllm/blob/main/vllm/config/parallel.py"
_VLLM_MODEL = "https://github.com/vllm-project/vllm/blob/main/vllm/config/model.py"


@dataclass(frozen=True)
class BuiltinRule:
    """A check written in Python (arithmetic, or across services), with its id and sources."""

    id: str
    summary: str
    sources: Mapping[str, str]       # server ("sglang", "vllm", "any") -> URL

    def source(self, server: str | None) -> str:
        return self.sources.get(server or "any") or self.sources.get("any") or next(iter(self.sources.values()))


BUILTIN_RULES: dict[str, BuiltinRule] = {r.id: r for r in (
    BuiltinRule(
        "tp-exceeds-gpus",
        "the parallel size (tp x pp x dp) exceeds the GPUs the service may use",
        {"sglang": "https://github.com/sgl-project/sglang/blob/main/docs/backend/server_arguments.md",
         "vllm": _VLLM_PARALLEL}),
    BuiltinRule(
        "gpu-overlap",
        "two services on one host claim the same GPUs",
        {"sglang": _SGLANG_ARGS,
         "any": "https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#env-vars"}),
    BuiltinRule(
        "port-conflict",
        "two services on one host listen on the same port",
        {"sglang": _SGLANG_ARGS,
         "vllm": "https://github.com/vllm-project/vllm/blob/main/vllm/entrypoints/openai/cli_args.py"}),
    BuiltinRule(
        "sglang-dp-attention-tp-divisible",
        "with --enable-dp-attention, --tp-size must be a multiple of --dp-size",
        {"sglang": _SGLANG_ARGS}),
    BuiltinRule(
        "vllm-tp-divides-attention-heads",
        "vLLM needs the attention heads to divide evenly over the tensor-parallel ranks",
        {"vllm": _VLLM_MODEL}),
    BuiltinRule(
        "quantization-mismatch",
        "--quantization contradicts the checkpoint's quantization_config",
        {"sglang": "https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/configs/model_config.py",
         "vllm": _VLLM_MODEL}),
)}


# ---- loading ----------------------------------------------------------------------------------


class SnapshotLike(Protocol):
    """A revision of the desired-state repo (source.Snapshot, load.MemorySnapshot)."""

    def read(self, path: str) -> bytes | None: ...

    def list(self, directory: str) -> list[str]: ...


@dataclass(frozen=True)
class RuleSet:
    """The rules in force: shipped rules, overridden or extended by the repo's, minus disabled."""

    rules: tuple[Rule, ...]
    models: tuple[ModelEntry, ...]
    disabled: frozenset[str] = frozenset()
    origin: Mapping[str, str] = field(default_factory=dict)   # rule id -> file it came from

    def enabled(self, rule_id: str) -> bool:
        return rule_id not in self.disabled

    @property
    def ids(self) -> list[str]:
        """Every rule id in force: declarative and built-in."""
        return [r.id for r in self.rules if self.enabled(r.id)] + [
            i for i in BUILTIN_RULES if self.enabled(i)]


def _problems_from_validation(file: str, data: Mapping[str, Any], error: ValidationError) -> list[Problem]:
    problems = []
    for e in error.errors(include_url=False):
        loc = [str(x) for x in e["loc"] if str(x) != "[key]"]
        parts: list[str] = []
        i = 0
        raw: Any = data
        while i < len(loc):
            part = loc[i]
            if part == "rule" and i + 1 < len(loc) and loc[i + 1].isdigit():
                n = int(loc[i + 1])
                rules = raw.get("rule") if isinstance(raw, Mapping) else None
                entry = rules[n] if isinstance(rules, list) and n < len(rules) else None
                rid = entry.get("id") if isinstance(entry, Mapping) else None
                parts.append(f"rule[{rid}]" if isinstance(rid, str) and rid else f"rule[#{n + 1}]")
                raw = entry
                i += 2
                continue
            if part.isdigit() and parts:
                parts[-1] += f"[#{int(part) + 1}]"     # counted from 1, as a reader counts
                i += 1
                continue
            parts.append(part if re.match(r"^[A-Za-z0-9_-]+$", part) else json.dumps(part))
            raw = raw.get(part) if isinstance(raw, Mapping) else None
            i += 1
        kind = e["type"]
        if kind == "missing":
            message = "required key missing"
        elif kind == "extra_forbidden":
            message = _unknown_key(loc)
        else:
            message = str(e["msg"]).removeprefix("Value error, ")
        problems.append(Problem(file, ".".join(parts), message))
    return problems


def _unknown_key(loc: list[str]) -> str:
    key = loc[-1]
    parent = loc[-2] if len(loc) >= 2 else ""
    model: type[BaseModel] = RuleFile
    if parent in ("when", "unless"):
        model = Condition
    elif parent == "require":
        model = Require
    elif parent.isdigit() and len(loc) >= 3:
        model = Rule if loc[-3] == "rule" else ModelEntry
    allowed = list(model.model_fields)
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown key ({hint}allowed: {', '.join(allowed)})"


def parse_rule_file(data: bytes, file: str) -> RuleFile:
    """Parse and validate one rule file; raise ConfigError with file and key on any problem."""
    try:
        raw = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError([Problem(file, "", "not UTF-8 text")]) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([Problem(file, "", f"invalid TOML: {e}")]) from None
    try:
        return RuleFile.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_problems_from_validation(file, raw, e)) from None


def _package_files() -> list[tuple[str, bytes]]:
    root = importlib.resources.files(__package__ or "reconciler").joinpath(RULES_DIR)
    out = []
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".toml") and entry.is_file():
            out.append((f"reconciler/{RULES_DIR}/{entry.name}", entry.read_bytes()))
    return out


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
    for file, shipped_data in _package_files():
        parsed = parse_rule_file(shipped_data, file)     # a broken shipped file is a bug: raise
        for r in parsed.rule:
            rules[r.id] = r
            origin[r.id] = file
        models.extend(parsed.model)
        for d in parsed.disable:
            disabled[d] = file
    shipped = set(rules)
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
            for d in parsed.disable:
                disabled[d] = file
    known = set(rules) | set(BUILTIN_RULES) | shipped
    for rid, file in disabled.items():
        if rid not in known:
            close = difflib.get_close_matches(rid, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(Problem(file, "disable", f"unknown rule id {rid!r}{hint}"))
    if problems:
        raise ConfigError(problems)
    # Repo model knowledge first: the repo knows its own private models best.
    return RuleSet(rules=tuple(rules.values()), models=tuple(repo_models + models),
                   disabled=frozenset(disabled), origin=origin)


# ---- evaluating declarative rules -------------------------------------------------------------


def _flag_ok(cmd: Command, flag: str, want: tuple[str, ...] | bool) -> bool:
    if isinstance(want, bool):
        return cmd.has(flag) == want
    return cmd.has(flag) and cmd.value(flag) in want


def _model_cond(info: ModelInfo, cond: Condition) -> bool:
    if cond.model and not all(t in info.traits for t in cond.model):
        return False
    if cond.architecture and not any(_glob_any(a, cond.architecture) for a in info.architectures):
        return False
    if cond.model_type and not (info.model_type and _glob_any(info.model_type, cond.model_type)):
        return False
    return not cond.model_id or bool(info.id and _glob_any(info.id, cond.model_id))


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
    if not all(cmd.env.get(v) for v in cond.env_any):
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


def _render(text: str, cmd: Command, info: ModelInfo, missing: list[str]) -> str:
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
    return _PLACEHOLDER.sub(sub, text)


def evaluate_rule(rule: Rule, svc: ServiceSpec, cmd: Command, info: ModelInfo) -> Finding | None:
    """One declarative rule against one service: a Finding when it fails, else None (pure)."""
    if rule.server != "any" and rule.server != cmd.server:
        return None
    if not condition_holds(rule.when, cmd, info):
        return None
    if rule.unless is not None and condition_holds(rule.unless, cmd, info):
        return None
    missing: list[str] = []
    if rule.require is not None:
        missing = missing_requirements(rule.require, cmd)
        if not missing:
            return None
    return Finding(rule.id, svc.name, rule.severity, _render(rule.message, cmd, info, missing),
                   _render(rule.fix, cmd, info, missing), rule.source)


# ---- built-in checks on one service -----------------------------------------------------------


def _builtin(rule_id: str, svc: ServiceSpec, cmd: Command, message: str, fix: str,
             severity: Severity = "error") -> Finding:
    return Finding(rule_id, svc.name, severity, message, fix, BUILTIN_RULES[rule_id].source(cmd.server))


def _parallel_text(cmd: Command) -> str:
    assert cmd.server is not None
    names = _PARALLEL[cmd.server]
    given = [f"{n} {cmd.value(n)}" for n in names if cmd.has(n)]
    if cmd.server == "sglang" and cmd.has("--enable-dp-attention"):
        given = [g for g in given if not g.startswith("--dp-size")]
    return " x ".join(given) or f"{names[0]} 1"


def _gpu_positions(cmd: Command, world: int) -> list[int] | None:
    """The device positions SGLang uses when placed with --base-gpu-id/--gpu-id-step; else None."""
    if cmd.server != "sglang" or not (cmd.has("--base-gpu-id") or cmd.has("--gpu-id-step")):
        return None
    base = cmd.int_value("--base-gpu-id", 0)
    step = cmd.int_value("--gpu-id-step", 1)
    if base is None or step is None or base < 0 or step < 1:
        return None
    return [base + i * step for i in range(world)]


def _check_gpu_count(svc: ServiceSpec, cmd: Command, gpu_count: int | None) -> list[Finding]:
    world = cmd.world_size()
    if world is None or world < 1:
        return []
    visible = cmd.visible_devices
    if visible is not None:
        available, where = len(visible), f"CUDA_VISIBLE_DEVICES lists {len(visible)}"
    elif gpu_count is not None:
        available, where = gpu_count, f"the host has {gpu_count}"
    else:
        return []                      # unknown: nothing to compare with
    positions = _gpu_positions(cmd, world)
    if positions is not None and positions[-1] >= available:
        return [_builtin("tp-exceeds-gpus", svc, cmd,
                         f"{_parallel_text(cmd)} placed from --base-gpu-id {positions[0]} needs GPU "
                         f"position {positions[-1]}, but {where} GPU{'s' if available != 1 else ''}",
                         "lower --base-gpu-id or the parallel size, or give the service more GPUs")]
    if world > available:
        return [_builtin("tp-exceeds-gpus", svc, cmd,
                         f"{_parallel_text(cmd)} needs {world} GPU{'s' if world != 1 else ''}, "
                         f"but {where}",
                         "lower the parallel size, or list more GPUs in CUDA_VISIBLE_DEVICES "
                         "(unset: every GPU of the host)")]
    return []


def _check_dp_attention(svc: ServiceSpec, cmd: Command) -> list[Finding]:
    if cmd.server != "sglang" or not cmd.has("--enable-dp-attention"):
        return []
    tp, dp = cmd.int_value("--tp-size", 1), cmd.int_value("--dp-size", 1)
    if tp is None or dp is None or dp <= 1 or (tp % dp == 0):
        return []
    return [_builtin("sglang-dp-attention-tp-divisible", svc, cmd,
                     f"--enable-dp-attention with --tp-size {tp} and --dp-size {dp}: tp must be a "
                     f"multiple of dp (SGLang asserts tp_size % dp_size == 0 at start-up)",
                     f"use a --dp-size that divides {tp}, e.g. "
                     f"{max(d for d in range(1, tp + 1) if tp % d == 0 and d <= dp)}")]


def _check_heads(svc: ServiceSpec, cmd: Command, info: ModelInfo) -> list[Finding]:
    if cmd.server != "vllm" or info.config is None:
        return []
    heads = text_config(info.config).get("num_attention_heads")
    tp = cmd.int_value("--tensor-parallel-size", 1)
    if not isinstance(heads, int) or isinstance(heads, bool) or heads <= 0 or not tp or tp <= 1:
        return []
    if heads % tp == 0:
        return []
    good = [d for d in range(1, tp) if heads % d == 0]
    return [_builtin("vllm-tp-divides-attention-heads", svc, cmd,
                     f"--tensor-parallel-size {tp} does not divide the model's {heads} attention "
                     f"heads (vLLM: 'Total number of attention heads ({heads}) must be divisible "
                     f"by tensor parallel size ({tp})')",
                     f"use a tensor-parallel size that divides {heads} (e.g. {good[-1] if good else 1}), "
                     f"or add pipeline parallelism")]


# CLI method -> checkpoint methods it may override (SGLang's compatible_quantization_methods,
# plus the kernel upgrades both servers apply themselves: gptq -> gptq_marlin, awq -> awq_marlin).
_QUANT_COMPATIBLE: dict[str, frozenset[str]] = {
    "modelopt_fp8": frozenset({"modelopt"}),
    "modelopt_fp4": frozenset({"modelopt", "fp8"}),
    "modelopt_mixed": frozenset({"modelopt"}),
    "nvfp4_online": frozenset({"fp8", "modelopt_fp8"}),
    "petit_nvfp4": frozenset({"modelopt"}),
    "w8a8_int8": frozenset({"compressed-tensors"}),
    "w8a8_fp8": frozenset({"compressed-tensors"}),
    "auto-round-int8": frozenset({"compressed-tensors"}),
    "gptq_marlin": frozenset({"gptq"}),
    "gptq_marlin_24": frozenset({"gptq"}),
    "gptq_bitblas": frozenset({"gptq"}),
    "marlin": frozenset({"gptq"}),
    "awq_marlin": frozenset({"awq"}),
    "moe_wna16": frozenset({"gptq", "awq"}),
}
# Methods that re-quantize whatever the checkpoint holds (SGLang REQUANTIZATION_METHODS).
_REQUANTIZE = frozenset({"quark_mxfp4"})


def checkpoint_quantization(config: Mapping[str, Any]) -> str | None:
    """quant_method of a checkpoint's quantization_config (or compression_config), if any."""
    for _, section in _sections(config):
        for key in ("quantization_config", "compression_config"):
            q = section.get(key)
            method = q.get("quant_method") if isinstance(q, Mapping) else None
            if isinstance(method, str) and method:
                return method.lower().replace("compressed_tensors", "compressed-tensors")
    return None


def _check_quantization(svc: ServiceSpec, cmd: Command, info: ModelInfo) -> list[Finding]:
    if cmd.server is None or info.config is None:
        return []
    flag = "--quantization"
    cli = (cmd.value(flag) or "").lower().replace("compressed_tensors", "compressed-tensors")
    ckpt = checkpoint_quantization(info.config)
    if not cli or not ckpt or cli == ckpt or cli in _REQUANTIZE:
        return []
    if ckpt in _QUANT_COMPATIBLE.get(cli, frozenset()):
        return []
    return [_builtin("quantization-mismatch", svc, cmd,
                     f"--quantization {cli} contradicts the checkpoint, whose config.json says "
                     f"quant_method {ckpt} (the server refuses to start: 'Quantization method "
                     f"specified in the model config ({ckpt}) does not match the quantization "
                     f"method specified in the `quantization` argument ({cli})')",
                     "remove --quantization (the server reads the method from the checkpoint), "
                     "or point the service at a checkpoint quantized that way")]


# ---- entry points -----------------------------------------------------------------------------


def check_service(svc: ServiceSpec, *, rules: RuleSet, model_config: Mapping[str, Any] | None,
                  gpu_count: int | None) -> list[Finding]:
    """Every rule against one service (pure).

    model_config: the model's config.json from the host, or None (validate: then the model id
    and declared architecture decide). gpu_count: the host's declared or observed GPU count,
    or None when unknown (the GPU-count check is then skipped unless CUDA_VISIBLE_DEVICES is set).
    """
    cmd = parse_command(svc)
    if cmd.server is None:
        return []
    info = model_info(svc, model_config, rules.models)
    findings: list[Finding] = []
    for rule in rules.rules:
        if rules.enabled(rule.id):
            f = evaluate_rule(rule, svc, cmd, info)
            if f is not None:
                findings.append(f)
    builtins: tuple[tuple[str, Callable[[], list[Finding]]], ...] = (
        ("tp-exceeds-gpus", lambda: _check_gpu_count(svc, cmd, gpu_count)),
        ("sglang-dp-attention-tp-divisible", lambda: _check_dp_attention(svc, cmd)),
        ("vllm-tp-divides-attention-heads", lambda: _check_heads(svc, cmd, info)),
        ("quantization-mismatch", lambda: _check_quantization(svc, cmd, info)),
    )
    for rule_id, run in builtins:
        if rules.enabled(rule_id):
            findings.extend(run())
    return findings


def gpu_claim(cmd: Command) -> frozenset[str] | None:
    """The GPUs a server claims: device ids, or None for every GPU of the host.

    CUDA_VISIBLE_DEVICES when set; unset means all GPUs, except for SGLang placed explicitly
    with --base-gpu-id/--gpu-id-step (its documented way to run several servers on one host),
    which claims exactly the positions it will use.
    """
    world = cmd.world_size() or 1
    visible = cmd.visible_devices
    positions = _gpu_positions(cmd, world)
    if positions is not None:
        if visible is None:
            return frozenset(str(p) for p in positions)
        return frozenset(visible[p] for p in positions if p < len(visible))
    if visible is None:
        return None                  # every GPU of the host
    return frozenset(visible)


def _describe_claim(claim: frozenset[str] | None) -> str:
    return "every GPU (CUDA_VISIBLE_DEVICES unset)" if claim is None else "GPU " + ",".join(sorted(claim))


def _overlap(a: frozenset[str] | None, b: frozenset[str] | None) -> str | None:
    """The GPUs two claims share, described; None when they share none."""
    if a is None and b is None:
        return "every GPU"
    common = (b if a is None else a if b is None else a & b) or frozenset()
    return "GPU " + ",".join(sorted(common)) if common else None


def _hosts_overlap(a: str, b: str) -> bool:
    return a == b or a in WILDCARD_HOSTS or b in WILDCARD_HOSTS


def check_host(host: HostSpec, *, rules: RuleSet, model_configs: Mapping[str, Mapping[str, Any]],
               gpu_count: int | None) -> list[Finding]:
    """Every rule against every service of a host, plus the checks across its services (pure).

    model_configs maps a model path to its config.json as read from the host (missing paths:
    decided from the repo's model id and declared architecture). A conflict between two
    services is reported on both of them: either deploy would collide with the other.
    """
    findings: list[Finding] = []
    commands: dict[str, Command] = {}
    for name in sorted(host.services):
        svc = host.services[name]
        config = model_configs.get(svc.model.path) if svc.model else None
        findings.extend(check_service(svc, rules=rules, model_config=config, gpu_count=gpu_count))
        cmd = parse_command(svc)
        if cmd.server is not None:
            commands[name] = cmd
    names = sorted(commands)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ca, cb = commands[a], commands[b]
            if rules.enabled("gpu-overlap"):
                shared = _overlap(gpu_claim(ca), gpu_claim(cb))
                if shared is not None:
                    for me, other, mine, theirs in ((a, b, ca, cb), (b, a, cb, ca)):
                        findings.append(Finding(
                            "gpu-overlap", me, "error",
                            f"claims {_describe_claim(gpu_claim(mine))} and service {other} claims "
                            f"{_describe_claim(gpu_claim(theirs))}: both would use {shared}",
                            "give each service its own GPUs with CUDA_VISIBLE_DEVICES in its env "
                            "(e.g. \"0,1\" and \"2,3\"), or for SGLang --base-gpu-id",
                            BUILTIN_RULES["gpu-overlap"].source(mine.server)))
            if rules.enabled("port-conflict"):
                pa, pb = ca.port, cb.port
                if pa is not None and pa == pb and _hosts_overlap(ca.host, cb.host):
                    for me, other, mine, theirs in ((a, b, ca, cb), (b, a, cb, ca)):
                        findings.append(Finding(
                            "port-conflict", me, "error",
                            f"listens on {mine.host or '*'}:{pa} and service {other} on "
                            f"{theirs.host or '*'}:{pb}: the second to start fails with "
                            f"'Address already in use'",
                            "give each service its own --port",
                            BUILTIN_RULES["port-conflict"].source(mine.server)))
    return findings


# ---- model presence on the host ---------------------------------------------------------------

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

_MODEL_SCRIPT = r"""
T=%(token)s
b64() { base64 | tr -d '\n'; }
size() { stat -L -c %%s -- "$1" 2>/dev/null || wc -c < "$1" 2>/dev/null | tr -d ' '; }
for d in "$@"; do
  printf '%%s P %%s\n' "$T" "$(printf '%%s' "$d" | b64)"
  if [ -d "$d" ]; then
    printf '%%s D 1\n' "$T"
    for f in config.json model.safetensors.index.json; do
      if [ -f "$d/$f" ]; then
        printf '%%s F %%s %%s\n' "$T" "$f" "$(b64 < "$d/$f")-"
      fi
    done
    for w in "$d"/*.safetensors "$d"/*/*.safetensors "$d"/*.bin "$d"/*.gguf; do
      [ -e "$w" ] || [ -L "$w" ] || continue
      s=$(size "$w") || s=-
      [ -n "$s" ] || s=-
      printf '%%s S %%s %%s\n' "$T" "$s" "$(printf '%%s' "${w#"$d"/}" | b64)"
    done
  else
    printf '%%s D 0\n' "$T"
  fi
  p=$d
  while [ ! -d "$p" ] && [ "$p" != / ] && [ "$p" != . ]; do p=$(dirname -- "$p"); done
  printf '%%s A %%s\n' "$T" "$(df -Pk -- "$p" 2>/dev/null | awk 'NR==2 {print $4}')"
done
printf '%%s END\n' "$T"
"""


def model_check_command(paths: list[str], token: str | None = None) -> tuple[str, str]:
    """The POSIX sh command that reads what a completeness check needs, for each model dir.

    Per path: whether it is a directory, config.json and model.safetensors.index.json
    (base64), the size of every weight file (*.safetensors, one sub-directory deep, *.bin,
    *.gguf; symlinks followed, as in a Hugging Face cache) and the free space of its file
    system. No python on the host. Returns (command, token); the token frames the output.
    """
    token = token or secrets.token_hex(8)
    script = _MODEL_SCRIPT % {"token": token}
    args = " ".join(shlex.quote(p) for p in paths)
    return f"sh -c {shlex.quote(script)} reconciler-model-check {args}", token


@dataclass(frozen=True)
class ModelFacts:
    """One model directory on a host, and what is wrong with it."""

    path: str
    exists: bool
    config: dict[str, Any] | None = None
    index: dict[str, Any] | None = None
    files: Mapping[str, int | None] = field(default_factory=dict)   # weight file -> size (None: unreadable)
    missing: list[str] = field(default_factory=list)
    empty: list[str] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)     # files present but unreadable as JSON
    free_bytes: int | None = None                        # free space of the file system

    @property
    def total_size(self) -> int | None:
        """The checkpoint's size according to its index (metadata.total_size), if known."""
        meta = (self.index or {}).get("metadata")
        size = meta.get("total_size") if isinstance(meta, dict) else None
        return size if isinstance(size, int) and not isinstance(size, bool) else None

    def problems(self) -> list[str]:
        """What makes the model unusable, one short phrase per file; [] when complete."""
        if not self.exists:
            return [f"model directory {self.path} missing"]
        out = [f"{name} missing" for name in self.missing]
        out += [f"{name} is invalid JSON" for name in self.invalid]
        out += [f"{name} is empty (0 bytes)" for name in self.empty]
        return out

    @property
    def complete(self) -> bool:
        return not self.problems()


def _b64text(payload: str, host: str) -> str:
    try:
        return base64.b64decode(payload, validate=True).decode("utf-8", errors="replace")
    except (binascii.Error, ValueError):
        raise ObserveError(host, "malformed model check output (bad base64)") from None


def _finish(path: str, exists: bool, raw: dict[str, str], sizes: dict[str, int | None],
            free_kb: int | None) -> ModelFacts:
    missing: list[str] = []
    invalid: list[str] = []
    empty: list[str] = []

    def load(name: str) -> dict[str, Any] | None:
        text = raw.get(name)
        if text is None:
            return None
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            invalid.append(name)
            return None
        if not isinstance(data, dict):
            invalid.append(name)
            return None
        return data

    config = load(CONFIG_FILE)
    index = load(INDEX_FILE)
    if exists and CONFIG_FILE not in raw:
        missing.append(CONFIG_FILE)
    if index is not None:
        weight_map = index.get("weight_map")
        shards = sorted({v for v in weight_map.values() if isinstance(v, str)}) if isinstance(weight_map, dict) else []
        if not shards and INDEX_FILE not in invalid:
            invalid.append(INDEX_FILE)   # an index that names no shard cannot be loaded either
        for shard in shards:
            if shard not in sizes or sizes[shard] is None:
                missing.append(shard)
            elif sizes[shard] == 0:
                empty.append(shard)
    elif exists and INDEX_FILE not in raw:
        # No index: a single-file checkpoint. It needs at least one weight file, none empty.
        if not sizes:
            missing.append("model weights (no model.safetensors.index.json, no *.safetensors)")
        for name, size in sorted(sizes.items()):
            if size == 0:
                empty.append(name)
            elif size is None:
                missing.append(name)
    return ModelFacts(path=path, exists=exists, config=config, index=index, files=dict(sizes),
                      missing=missing, empty=empty, invalid=invalid,
                      free_bytes=free_kb * 1024 if free_kb is not None else None)


def parse_model_check(stdout: str, token: str, host: str = "?") -> dict[str, ModelFacts]:
    """Parse the output of `model_check_command` into {path: ModelFacts} (pure)."""
    out: dict[str, ModelFacts] = {}
    current: str | None = None
    exists = False
    raw: dict[str, str] = {}
    sizes: dict[str, int | None] = {}
    free_kb: int | None = None
    ended = False

    def flush() -> None:
        if current is not None:
            out[current] = _finish(current, exists, raw, sizes, free_kb)

    for line in stdout.splitlines():
        parts = line.split(" ")
        if len(parts) < 2 or parts[0] != token:
            continue
        kind = parts[1]
        if kind == "END":
            ended = True
            break
        if kind == "P" and len(parts) == 3:
            flush()
            current, exists, raw, sizes, free_kb = _b64text(parts[2], host), False, {}, {}, None
        elif current is None:
            raise ObserveError(host, f"malformed model check line: {line[:80]!r}")
        elif kind == "D" and len(parts) == 3:
            exists = parts[2] == "1"
        elif kind == "F" and len(parts) == 4:
            # The payload ends with '-' so that an empty file still gives a field.
            raw[parts[2]] = _b64text(parts[3][:-1], host) if parts[3] != "-" else ""
        elif kind == "S" and len(parts) == 4:
            sizes[_b64text(parts[3], host)] = int(parts[2]) if parts[2].isdigit() else None
        elif kind == "A":
            free_kb = int(parts[2]) if len(parts) == 3 and parts[2].isdigit() else None
        else:
            raise ObserveError(host, f"malformed model check line: {line[:80]!r}")
    if not ended:
        raise ObserveError(host, "model check output ended early (is there a POSIX shell?)")
    flush()
    return out


def check_desired(state: DesiredState, rules: RuleSet) -> tuple[list[Problem], list[str]]:
    """Run every rule on what the repo declares. Returns (blocking problems, warnings)."""
    problems: list[Problem] = []
    warnings: list[str] = []
    for name, host in sorted(state.hosts.items()):
        for f in check_host(host, rules=rules, model_configs={}, gpu_count=None):
            where = f"services.{f.service}"
            text = f"{f.rule_id}: {f.message.rstrip('.')}. Fix: {f.fix.rstrip('.')} (source: {f.source})"
            if f.blocking:
                problems.append(Problem(host.source or f"hosts/{name}.toml", where, text))
            else:
                warnings.append(f"{host.source}: {where}: warning: {text}")
    return problems, warnings
