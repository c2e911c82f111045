"""A unit file as systemd reads it (pure): the entries of one section (comments, line
continuations), the variables its Environment= lines set, and the expansion of ${VAR} and $VAR
in an ExecStart= line (systemd.service(5), "Command lines"; systemd.exec(5), Environment=).
_command.py reads the server's command line from them.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping

SYSTEMD_EXEC_PREFIX = re.compile(r"^[-@+!:|]+")
ENV_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.DOTALL)
VAR_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
BARE_VAR = re.compile(r"^\$([A-Za-z_][A-Za-z0-9_]*)\Z")


def unit_entries(unit_text: str, section: str = "Service") -> list[tuple[str, str]]:
    """(key, value) pairs of one section of a unit file, in order.

    Follows systemd's syntax: comment lines start with # or ;, a trailing backslash continues
    a line (comment lines inside a continuation are skipped), keys and values are stripped.
    """
    out: list[tuple[str, str]] = []
    current: str | None = None
    pending = ""
    for raw in [*unit_text.splitlines(), ""]:      # the blank last line ends a continuation left open
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
    return out


def environment_lines(entries: list[tuple[str, str]]) -> dict[str, str]:
    """The variables a unit's Environment= lines set (later ones win), as systemd splits them."""
    env: dict[str, str] = {}
    for key, value in entries:
        if key != "Environment" or not value:
            continue  # an empty Environment= in a drop-in does not clear; nothing to add
        try:
            words = shlex.split(value)
        except ValueError:
            continue
        for word in words:
            m = ENV_ASSIGNMENT.match(word)
            if m:
                env[m.group(1)] = m.group(2)
    return env


def expand(tokens: list[str], env: Mapping[str, str]) -> list[str]:
    """systemd's ExecStart expansion: ${VAR} inside a word, $VAR alone splits into words."""
    out: list[str] = []
    for tok in tokens:
        bare = BARE_VAR.match(tok)
        if bare and bare.group(1) in env:
            out.extend(env[bare.group(1)].split())
        else:              # an unknown $VAR stays as it is, like an unknown ${VAR}
            out.append(VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), tok))
    return out
