"""The model server's version on a host: which interpreter a unit runs, and a read of the files.

Pre-flight rules can be true for some server releases only (`versions = ">=0.5.10,<0.5.14"`),
so the host is asked which sglang or vllm the service's own interpreter has. The interpreter is
the python of ExecStart (`/opt/sglang/bin/python3 -m sglang.launch_server`), or the one named in
the shebang of a console script (`/opt/vllm/bin/vllm serve`). Nothing is run to learn it
(reconciler/sh/versions.sh): the host program walks the interpreter's import order (the unit's
PYTHONPATH, the user's site directory, its own site-packages, the system's dist-packages, and
what their .pth files name) with shell builtins and reads the `Version:` of the first
`<module>-*.dist-info/METADATA` (or the package's `__version__` line) it meets. No python
starts, so none of the unit's code, environment or search path runs as root on a dry run.

Reading the files costs no process, so there is nothing to cache: every pre-flight reads them
afresh, and an upgrade is seen at once.

Like facts.py: `probe_command(...)` builds the shell, `parse_probe(...)` reads it (pure).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from .. import shell
from ..desired.spec import ServiceSpec
from ..frames import frames
from ..preflight import Command, RuleSet, parse_command, reads_user_site, unit_entries
from ..shell import ShCommand

_PYTHON = re.compile(r"^python[0-9.]*\Z")


@dataclass(frozen=True)
class Probe:
    """What to read on one host about one service: its executable, the server's package, its
    PYTHONPATH, its unit's User= (whose home holds the user's site directory) and whether the
    interpreter reads that directory."""

    service: str
    executable: str
    module: str                      # "sglang" | "vllm"
    pythonpath: str = ""
    user: str = ""
    user_site: bool = True


def probe_for(service: str, cmd: Command, user: str | None = None) -> Probe | None:
    """The probe for a parsed server command, or None when it runs no server we know."""
    if cmd.server is None or not cmd.argv:
        return None
    exe = next((tok for tok in cmd.argv if _PYTHON.match(tok.rsplit("/", 1)[-1])), None)
    if exe is None:
        # a console script (`vllm serve`, `sglang serve`): its shebang names the interpreter
        exe = next((tok for tok in cmd.argv if tok.rsplit("/", 1)[-1] in ("sglang", "vllm")), None)
    if exe is None:
        return None
    return Probe(service, exe, cmd.server, cmd.env.get("PYTHONPATH", ""), user or "", reads_user_site(cmd))


def probes_for(specs: Mapping[str, ServiceSpec], rules: RuleSet | None) -> list[Probe]:
    """The server versions a pre-flight reads: only where a rule is bound to versions."""
    if rules is None or not any(r.versions for r in rules.rules):
        return []
    out = []
    for name, svc in sorted(specs.items()):
        user = next((v for k, v in reversed(unit_entries(svc.unit_text)) if k == "User"), None)
        if (p := probe_for(name, parse_command(svc), user)) is not None:
            out.append(p)
    return out


def probe_command(probes: list[Probe], token: str | None = None) -> tuple[ShCommand, str]:
    """The shell that reads every probe's version: reconciler/sh/versions.sh. Returns (command, token)."""
    token = token or secrets.token_hex(8)
    args = [token, *(x for p in probes for x in (p.service, p.executable, p.module, p.pythonpath, p.user,
                                                 "1" if p.user_site else "0"))]
    return ShCommand(shell.program("versions"), "reconciler-probe", args), token


_VERSION = re.compile(r"^[0-9][0-9A-Za-z.+!-]*\Z")


def parse_probe(stdout: str, token: str) -> dict[str, str | None]:
    """Service -> version (pure): each "V SERVICE @VERSION" record ("-": unknown; a service the
    answer did not reach, cut short, is unknown too)."""
    out: dict[str, str | None] = {}
    for f in frames(stdout, token):
        fields = f.fields()
        if f.kind == "V" and len(fields) == 2:
            text = fields[1][1:] if fields[1].startswith("@") else ""
            out[fields[0]] = text if _VERSION.match(text) else None
    return out


def read_versions(probes: list[Probe], stdout: str, token: str) -> tuple[dict[str, str | None], list[str]]:
    """Each probed service's version (None: unknown), and a warning for each unknown one."""
    versions = parse_probe(stdout, token)
    return versions, [f"{p.service}: the installed {p.module} version could not be read for {p.executable}: "
                      f"rules bound to versions apply as for any version" for p in probes
                      if versions.get(p.service) is None]
