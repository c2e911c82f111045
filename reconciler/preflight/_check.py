"""The entry points: every rule, declarative and built-in, against a service, a host, the repo (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..desired.spec import DesiredState, HostSpec, ServiceSpec
from ..errors import Problem
from ._builtin import BUILTIN_RULES, RuleFacts
from ._command import Command, parse_command
from ._drain import stop_timeout
from ._hardware import Hardware
from ._models import model_info
from ._rules import Finding, RuleSet, evaluate_rule
from ._secrets import Read, read_toml, secret_warnings


def check_service(svc: ServiceSpec, *, rules: RuleSet, model_config: Mapping[str, Any] | None,
                  gpu_count: int | None, version: str | None = None, hardware: Hardware | None = None,
                  weights_bytes: int | None = None) -> list[Finding]:
    """Every rule against one service (pure).

    model_config: the model's config.json from the host, or None (validate: then the model id
    and declared architecture decide). gpu_count: the host's declared or observed GPU count,
    or None when unknown (the GPU-count check is then skipped unless CUDA_VISIBLE_DEVICES is set).
    version: the server's version on the host, or None when unknown (validate, or not readable).
    hardware: the host's GPUs (memory, holders, compute capability; `Hardware.of(gpu_facts)`),
    or None: the memory and compute-capability rules are then skipped. weights_bytes: the
    checkpoint's size on the host (`weights_bytes(model_facts)`), or None (estimated from
    config.json, and then only a warning).
    """
    return _check_command(svc, parse_command(svc), rules=rules, model_config=model_config, gpu_count=gpu_count,
                          version=version, hardware=hardware, weights_bytes=weights_bytes)


def _check_command(svc: ServiceSpec, cmd: Command, *, rules: RuleSet, model_config: Mapping[str, Any] | None,
                   gpu_count: int | None, version: str | None, hardware: Hardware | None,
                   weights_bytes: int | None) -> list[Finding]:
    """check_service on the service's command line, already parsed."""
    if cmd.server is None:
        return []
    facts = RuleFacts(gpu_count=gpu_count, version=version, weights_bytes=weights_bytes, hardware=hardware,
                      unit=f"{svc.name}.service", drain_timeout=svc.drain.timeout if svc.drain is not None else None,
                      stop_timeout=stop_timeout(svc.unit_text))
    info = model_info(svc, model_config, rules.models)
    findings: list[Finding] = []
    for rule in rules.rules:
        if rules.enabled(rule.id):
            f = evaluate_rule(rule, svc, cmd, info, facts.version)
            if f is not None:
                findings.append(f)
    for builtin in BUILTIN_RULES.values():
        if builtin.scope == "service" and rules.enabled(builtin.id):
            failed = builtin.check(cmd, info, facts)
            if failed is not None:
                findings.append(Finding(builtin.id, svc.name, failed.severity, failed.message, failed.fix,
                                        builtin.source(cmd.server)))
    return findings


def check_host(host: HostSpec, *, rules: RuleSet, model_configs: Mapping[str, Mapping[str, Any]],
               gpu_count: int | None, versions: Mapping[str, str | None] | None = None,
               hardware: Hardware | None = None, weights: Mapping[str, int] | None = None) -> list[Finding]:
    """Every rule against every service of a host, plus the checks across its services (pure).

    model_configs maps a model path to its config.json as read from the host (missing paths:
    decided from the repo's model id and declared architecture). versions: service -> its
    server's version on the host (absent or None: unknown). hardware: the host's GPUs (None:
    not read; the memory and compute-capability rules are skipped). weights: model path -> the
    checkpoint's bytes on the host. A conflict between two services is reported on both of
    them: either deploy would collide with the other.
    """
    findings: list[Finding] = []
    commands: dict[str, Command] = {}
    for name in sorted(host.services):
        svc = host.services[name]
        model, cmd = svc.model, parse_command(svc)
        findings.extend(_check_command(svc, cmd, rules=rules,
                                       model_config=model_configs.get(model.path) if model else None,
                                       gpu_count=gpu_count, version=(versions or {}).get(name), hardware=hardware,
                                       weights_bytes=(weights or {}).get(model.path) if model else None))
        if cmd.server is not None:
            commands[name] = cmd
    pair_rules = [r for r in BUILTIN_RULES.values() if r.scope == "host" and rules.enabled(r.id)]
    names = sorted(commands)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for rule in pair_rules:
                for me, other in ((a, b), (b, a)):
                    mine = commands[me]
                    failed = rule.check(mine, other, commands[other])
                    if failed is not None:
                        findings.append(Finding(rule.id, me, "error", failed.message, failed.fix,
                                                rule.source(mine.server)))
    return findings


def check_desired(state: DesiredState, rules: RuleSet, read: Read | None = None) -> tuple[list[Problem], list[str]]:
    """Run every rule on what the repo declares. Returns (blocking problems, warnings).

    read: the revision's files (Snapshot.read), so that a warning about a secret-looking env
    value names the file that sets it (the host file or the shared definition)."""
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
    warnings.extend(secret_warnings(state, read))
    warnings.extend(rollout_warnings(state, read))
    return problems, warnings


def rollout_warnings(state: DesiredState, read: Read | None = None) -> list[str]:
    """A fleet-wide [rollout] policy only shapes services that use a shared definition: a service
    of the same name defined inline on several hosts is deployed on all of them at once. Say so,
    once per such service, instead of leaving the operator to expect waves."""
    if "rollout" not in read_toml(read, "fleet.toml"):
        return []
    inline: dict[str, list[str]] = {}
    for name, host in sorted(state.hosts.items()):
        for svc in host.services.values():
            if svc.definition is None:
                inline.setdefault(svc.name, []).append(name)
    return [f"fleet.toml: rollout: warning: service {svc} is defined inline on hosts {', '.join(hosts)}, so it "
            f"deploys on all of them at once: only a service that uses a shared definition (services/{svc}.toml "
            f"and `use = \"{svc}\"` in each host's [services.{svc}]) rolls out in waves"
            for svc, hosts in sorted(inline.items()) if len(hosts) > 1]
