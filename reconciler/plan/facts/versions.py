"""PURE: which sglang or vllm a service's own interpreter has, read from its files
(reconciler/sh/versions.sh): nothing of the unit (its interpreter, its search path, its
environment) is run.

The host program walks the interpreter's import order (the unit's PYTHONPATH, the user's site
directory, its own site-packages, the system's dist-packages, and what their .pth files name)
with shell builtins and reads the `Version:` of the first `<module>-*.dist-info/METADATA` (or
the package's `__version__` line) it meets. Which services to read, and how the interpreter is
found in a unit, is host/versions.py's (it asks the rule pack).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import ClassVar

import msgspec

from ...frames import HostProgram, Records


class VersionRead(msgspec.Struct, frozen=True):
    """What to read on one host about one service: its executable, the server's package, its
    PYTHONPATH, its unit's User= (whose home holds the user's site directory) and whether the
    interpreter reads that directory."""

    service: str
    executable: str
    module: str                      # "sglang" | "vllm"
    pythonpath: str = ""
    user: str = ""
    user_site: bool = True


class Versions(HostProgram[dict[str, str | None]], frozen=True):
    """reconciler/sh/versions.sh for these reads: service -> version (None: unknown)."""

    name: ClassVar[str] = "versions"
    in_session: ClassVar[bool] = True
    fragments: ClassVar[tuple[str, ...]] = ("venv",)
    reads: Sequence[VersionRead]

    def params(self) -> Sequence[tuple[str, str]]:
        # one group per read, in the order the program takes them (`usersite` closes a group)
        return [pair for r in self.reads for pair in (
            ("service", r.service), ("exe", r.executable), ("module", r.module), ("pythonpath", r.pythonpath),
            ("user", r.user), ("usersite", "1" if r.user_site else "0"))]

    def parse(self, answer: Records) -> dict[str, str | None]:
        return parse_versions(answer.stdout, answer.token)


_VERSION = re.compile(r"^[0-9][0-9A-Za-z.+!-]*\Z")


def parse_versions(stdout: str, token: str) -> dict[str, str | None]:
    """Service -> version (pure): each "V SERVICE @VERSION" record ("-": unknown; a service the
    answer did not reach, cut short, is unknown too)."""
    out: dict[str, str | None] = {}
    for f in Records(stdout, token):
        fields = f.fields()
        if f.kind == "V" and len(fields) == 2:
            text = fields[1][1:] if fields[1].startswith("@") else ""
            out[fields[0]] = text if _VERSION.match(text) else None
    return out
