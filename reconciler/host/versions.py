"""The model server's version on a host: which interpreter a unit runs, and which reads to ask.

Pre-flight rules can be true for some server releases only (`versions = ">=0.5.10,<0.5.14"`),
and what says an SGLang server is ready depends on its release (plan/ready.py: /ready from
0.5.20), so the host is asked which sglang or vllm the service's own interpreter has. The
interpreter is the python of ExecStart (`/opt/sglang/bin/python3 -m sglang.launch_server`), or the one named in
the shebang of a console script (`/opt/vllm/bin/vllm serve`). Nothing is run to learn it: the
host program (plan/facts/versions.py, reconciler/sh/versions.sh) reads the files with shell
builtins, so none of the unit's code, environment or search path runs as root on a dry run.

Reading the files costs no process, so there is nothing to cache: every pre-flight reads them
afresh, and an upgrade is seen at once.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..desired.spec import ServiceSpec
from ..plan.facts.versions import VersionRead, Versions
from ..preflight import Command, RuleSet, parse_command, reads_user_site, unit_entries

_PYTHON = re.compile(r"^python[0-9.]*\Z")

__all__ = ["VersionRead", "Versions", "bound", "read_for", "reads_for", "unknown"]


def read_for(service: str, cmd: Command, user: str | None = None) -> VersionRead | None:
    """The version read for a parsed server command, or None when it runs no server we know."""
    if cmd.server is None or not cmd.argv:
        return None
    exe = next((tok for tok in cmd.argv if _PYTHON.match(tok.rsplit("/", 1)[-1])), None)
    if exe is None:
        # a console script (`vllm serve`, `sglang serve`): its shebang names the interpreter
        exe = next((tok for tok in cmd.argv if tok.rsplit("/", 1)[-1] in ("sglang", "vllm")), None)
    if exe is None:
        return None
    return VersionRead(service, exe, cmd.server, cmd.env.get("PYTHONPATH", ""), user or "", reads_user_site(cmd))


def bound(rules: RuleSet | None) -> bool:
    """Whether a rule of the pack is bound to server versions."""
    return rules is not None and any(r.versions for r in rules.rules)


def reads_for(specs: Mapping[str, ServiceSpec], rules: RuleSet | None) -> list[VersionRead]:
    """The server versions a pre-flight reads: every server's where a rule is bound to versions,
    and every SGLang server's in any case (its release decides what ready reads)."""
    every = bound(rules)
    out = []
    for name, svc in sorted(specs.items()):
        cmd = parse_command(svc)
        if not every and cmd.server != "sglang":
            continue
        user = next((v for k, v in reversed(unit_entries(svc.unit_text)) if k == "User"), None)
        if (r := read_for(name, cmd, user)) is not None:
            out.append(r)
    return out


def unknown(reads: list[VersionRead], versions: Mapping[str, str | None]) -> list[str]:
    """A warning for each read whose version is unknown (the rules bound to versions)."""
    return [f"{r.service}: the installed {r.module} version could not be read for {r.executable}: "
            f"rules bound to versions apply as for any version" for r in reads if versions.get(r.service) is None]
