"""The problems of one load, collected in order and reported once each.

Loading is all-or-nothing and reports every problem of a revision together, so the loader
collects rather than raises. A shared file (a definition, a unit file) is checked once for each
host service that uses it: the same problem there is one line listing the services and hosts it
affects (a unit file used by 500 hosts gives one line, not 500), not one line per use.
"""

from __future__ import annotations

import json

import msgspec

from ..errors import Problem
from ..redact import redact


class Use(msgspec.Struct, frozen=True):
    """One service on one host: the context a problem in a shared file is reported for."""

    service: str
    host: str


class Problems:
    """Collects problems in order; the same problem in a shared file is reported once, listing
    the services and hosts it affects."""

    def __init__(self) -> None:
        self._found: dict[tuple[str, str, str], list[Use]] = {}
        self.count = 0  # every add, duplicates included: "did this step find anything?"

    def add(self, file: str, key: str, message: str, use: Use | None = None) -> None:
        self.count += 1
        uses = self._found.setdefault((file, key, message), [])
        if use is not None and use not in uses:
            uses.append(use)

    def __bool__(self) -> bool:
        return bool(self._found)

    def result(self) -> list[Problem]:
        """The problems, each redacted (file, key and message): a ConfigError is printed, sent
        to the pusher and stored, and a value a validator showed may hold a token. A file name
        with a control character in it (`hosts/gpu9\n.toml`) is quoted, its newline escaped:
        it must not start a line of its own in the report."""
        return [Problem(redact(_quoted(f)), redact(k), redact(m + _uses_text(uses)))
                for (f, k, m), uses in self._found.items()]


def _quoted(file: str) -> str:
    return json.dumps(file, ensure_ascii=False) if any(c < " " or c == "\x7f" for c in file) else file


def _uses_text(uses: list[Use]) -> str:
    if not uses:
        return ""
    by_service: dict[str, list[str]] = {}
    for u in uses:
        by_service.setdefault(u.service, []).append(u.host)
    parts = []
    for service, hosts in by_service.items():
        shown = ", ".join(hosts[:5]) + (f" and {len(hosts) - 5} more" if len(hosts) > 5 else "")
        parts.append(f"service {service} on host{'s' if len(hosts) > 1 else ''} {shown}")
    return " (in " + "; ".join(parts) + ")"
