"""What a finding says: its severity, and the placeholders a rule's message and fix may hold
({flag:--name}, {model}, {model.why}, {missing}), checked when a rule file is read (_schema) and
filled in when a rule fires (_rules.render). Pure; imports nothing of the package."""

from __future__ import annotations

import re
from typing import Literal

Severity = Literal["error", "warning"]      # an error blocks the service's deploy; a warning is reported

PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
FIXED = ("model", "model.why", "missing")
FLAG_NAME = re.compile(r"^--?[A-Za-z0-9][A-Za-z0-9_-]*\Z")


def placeholder_problem(text: str) -> str | None:
    """What is wrong with a message's placeholders (an unknown one), or None."""
    for m in PLACEHOLDER.finditer(text):
        name = m.group(1)
        if name in FIXED or (name.startswith("flag:") and FLAG_NAME.match(name[5:])):
            continue
        return (f"unknown placeholder {{{name}}} (allowed: {{flag:--name}}, "
                + ", ".join("{" + p + "}" for p in FIXED) + ")")
    return None
