"""Pre-flight checks before a model server is (re)started: flag rules as data, model presence.

See docs/preflight.md for what is checked and when, and its "Writing rules" section for the
rule-file format and when a rule fires.

Everything here is pure except the text of one shell command (`ModelCheck`, _hostcheck). The
rule pack is data: the shipped reconciler/rules/*.toml plus the repo's own rules/*.toml
(`load_rules`; their schema, _schema, comes with the first rule file read: a run that starts
nothing never loads it). `check_service`, `check_host` and `check_desired` evaluate it together
with the built-in rules (`@builtin`, _registry), each result a `Finding`. What a model is comes
from its config.json where one was read from the host, and from the `[[model]]` tables of the
rule files (rules/models.toml, extendable from the repo).

The package, one concern a module (all private; this module's `__all__` is the interface):
_unitfile (a unit file as systemd reads it), _command (the server command line), _engine (the
engine's own check of a command line: which services have one, what its answers mean),
_enginebox (the environment and systemd properties the engine's probe runs with), _models
(model knowledge), _schema (the rule-file schema, whose models the checks evaluate), _message
(a finding's severity and placeholders), _versions (server version ranges), _rules (loading the
rule pack, evaluating declarative rules), _registry (what a built-in rule is given and returns,
and their registry), _builtin (the built-in rules), _shapes (MoE and FP8-block shapes per rank),
_hardware (the host's GPUs as the rules see them), _capacity (memory and compute capability),
_drain (what a stop does to the requests in flight), _check (check_service, check_host,
check_desired), _hostcheck (model presence on the host) and _secrets (secret-looking env
values, undecryptable secrets).
"""

from __future__ import annotations

from ._builtin import BUILTIN_RULES
from ._check import check_desired, check_host, check_service
from ._command import Command, gpu_claim, parse_command
from ._engine import EngineRun, EngineVerdict, engine_run_for, parse_verdict, reads_user_site
from ._enginebox import elsewhere, probe_env, probe_properties
from ._hardware import GpuHolder, GpuState, Hardware, weights_bytes
from ._hostcheck import ModelCheck, ModelFacts, parse_model_check
from ._models import model_info
from ._rules import Finding, RuleSet, load_rules
from ._secrets import argv_secret_warnings, env_secret_warnings, secret_file, secret_problems, secret_warnings
from ._unitfile import unit_entries

__all__ = [
    "BUILTIN_RULES",
    "Command",
    "EngineRun",
    "EngineVerdict",
    "Finding",
    "GpuHolder",
    "GpuState",
    "Hardware",
    "ModelCheck",
    "ModelFacts",
    "RuleSet",
    "argv_secret_warnings",
    "check_desired",
    "check_host",
    "check_service",
    "elsewhere",
    "engine_run_for",
    "env_secret_warnings",
    "gpu_claim",
    "load_rules",
    "model_info",
    "parse_command",
    "parse_model_check",
    "parse_verdict",
    "probe_env",
    "probe_properties",
    "reads_user_site",
    "secret_file",
    "secret_problems",
    "secret_warnings",
    "unit_entries",
    "weights_bytes",
]
