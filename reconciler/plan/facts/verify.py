"""PURE: systemd's own check of the units a plan is about to write (reconciler/sh/verify.sh).

`Verify(units)` hands each unit (and its env drop-in) to `systemd-analyze verify` under a
throw-away name in a private directory, so no live drop-in of the real unit is mixed in; its
answer says, per service, what systemd objects to (each problem with the offending line quoted)
and whether systemd-analyze was there at all. The texts go on stdin as counted lines, never on a
command line, never decoded by another process: the shell writes them byte for byte.
"""

from __future__ import annotations

import base64
import contextlib
import re
import secrets
from collections.abc import Mapping
from typing import ClassVar

import msgspec

from ...frames import Frame, HostProgram, Param, Records
from ..layout import ENV_DROPIN

Units = Mapping[str, tuple[str, str | None]]      # service -> (unit text, env drop-in or None)


class Verified(msgspec.Struct, frozen=True):
    """systemd's verdict on the units: service -> its problems (none: it accepts the unit), and
    whether systemd-analyze was there to ask."""

    problems: Mapping[str, list[str]]
    available: bool = True


def _lines(text: str) -> tuple[int, str]:
    """A text as verify.sh's `put` reads it: how many pieces it has between newlines, and those
    pieces each on a line of its own (so a missing final newline stays missing)."""
    pieces = text.split("\n")
    return len(pieces), "".join(p + "\n" for p in pieces)


class Verify(HostProgram[Verified], frozen=True):
    """reconciler/sh/verify.sh for these units (`nonce`: the private directory's random part)."""

    name: ClassVar[str] = "verify"
    constants: ClassVar[Mapping[str, str]] = {"ENV_DROPIN": ENV_DROPIN}
    units: Units
    nonce: str = msgspec.field(default_factory=lambda: secrets.token_hex(8))

    def params(self) -> Mapping[str, Param]:
        heads = []
        for name, (unit, env) in sorted(self.units.items()):
            nenv = _lines(env)[0] if env else "-"
            heads.append(f"{name} reconciler-verify-{self.nonce[:8]}-{name} {_lines(unit)[0]} {nenv}")
        return {"dir": self.nonce, "unit": heads}

    def payload(self) -> str:
        return "".join(_lines(unit)[1] + (_lines(env)[1] if env else "")
                       for _, (unit, env) in sorted(self.units.items()))

    def parse(self, answer: Records) -> Verified:
        return parse_verify(answer.stdout, answer.token, self.units)


_LINE_REF = re.compile(r"^(?P<file>/\S+?):(?P<line>[0-9]{1,9}): (?P<msg>.*)$")


def _problem(msg: str, unit: str, env: str | None) -> str | None:
    """One line of systemd-analyze's about the unit we would write (None: about another unit on
    the host), with the offending line quoted where it names one."""
    if "reconciler-verify-" not in msg:
        return None
    m = _LINE_REF.match(msg.strip())
    if not m:
        return re.sub(r"reconciler-verify-[0-9a-f]+-", "", msg.strip())
    dropin = m.group("file").endswith(".conf")
    lines = ((env if dropin else unit) or "").splitlines()
    n = int(m.group("line"))
    quoted = f" (`{lines[n - 1].strip()}`)" if 0 < n <= len(lines) else ""
    where = f"{ENV_DROPIN} line {n}" if dropin else f"line {n}"
    return f"{where}: {m.group('msg')}{quoted}"


class _Verdicts:
    """parse_verify's reading of the records: O a line of systemd-analyze's output, B all of it
    in base64, V its exit status for a service (`V - -`: there is no systemd-analyze)."""

    def __init__(self, units: Units) -> None:
        self.units = units
        self.out: dict[str, list[str]] = {}
        self.available = True
        self.said: dict[str, list[str]] = {}        # service -> systemd-analyze's output lines so far

    def read(self, f: Frame) -> None:
        fields = f.fields(2)
        if len(fields) != 2:
            return
        name, rest = fields
        if f.kind == "O":
            self.said.setdefault(name, []).append(rest)
        elif f.kind == "B":
            with contextlib.suppress(ValueError):     # not base64 (binascii.Error is one): said nothing
                self.said.setdefault(name, []).append(base64.b64decode(rest, validate=True).decode(errors="replace"))
        elif f.kind == "V":
            self.verdict(name, rest)

    def verdict(self, name: str, rc: str) -> None:
        if name == "-":
            self.available = False
            return
        unit, env = self.units.get(name, ("", None))
        said = "\n".join(self.said.pop(name, []))
        problems = [p for msg in said.splitlines() if (p := _problem(msg, unit, env)) is not None]
        if rc != "0" and not problems:
            problems.append(f"systemd-analyze verify exited {rc}")
        if problems:
            self.out[name] = problems


def parse_verify(stdout: str, token: str, units: Units) -> Verified:
    """Pure: service -> what systemd objects to in its unit (each with the offending line quoted);
    and whether systemd-analyze was there at all."""
    verdicts = _Verdicts(units)
    for f in Records(stdout, token):
        verdicts.read(f)
    return Verified(verdicts.out, verdicts.available)
