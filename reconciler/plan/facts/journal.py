"""PURE: a unit's journal since a moment, read as data (reconciler/sh/journal.sh).

`Journal(unit, since)` reads the unit's last JOURNAL_LINES entries as JSON (`journalctl -o
json`), of those the newest JOURNAL_BYTES bytes; `parse_journal` takes any text (a line that is
not a journal entry is skipped) into `JournalEntry`s: what each says, whether the service's own
processes said it (not systemd), its invocation, and how its process ended. What a failure's
lines mean is plan/health.py's (`explain`, `spawn_failure`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import msgspec

from ...frames import HostProgram, Param, Records
from ..lenient import json_or_none

JOURNAL_LINES = 200          # journal entries read for a failure
JOURNAL_BYTES = 1 << 20      # the newest bytes of them kept (a cut first entry is no JSON: skipped)


class JournalEntry(msgspec.Struct, frozen=True):
    """One journal line of a unit: what it says, whether the service's own processes said it
    (not systemd), the invocation it belongs to, and, on systemd's "Main process exited" line,
    how the process ended (EXIT_CODE exited | killed | dumped, EXIT_STATUS)."""

    message: str
    own: bool
    invocation: str = ""
    exit_code: str = ""
    exit_status: str = ""


class Journal(HostProgram[list[JournalEntry]], frozen=True):
    """reconciler/sh/journal.sh: the unit's journal since `since` (epoch seconds): the last
    JOURNAL_LINES entries of it, and of those the newest JOURNAL_BYTES bytes."""

    name: ClassVar[str] = "journal"
    constants: ClassVar[Mapping[str, str]] = {"LINES": str(JOURNAL_LINES), "BYTES": str(JOURNAL_BYTES)}
    unit: str
    since: int

    def params(self) -> Mapping[str, Param]:
        return {"unit": self.unit, "since": str(max(0, self.since))}

    def parse(self, answer: Records) -> list[JournalEntry]:
        _, mark, rest = answer.stdout.partition(f"{answer.token} J -\n")
        lines, _, _ = rest.rpartition(f"\n{answer.token} END")
        return parse_journal(lines if mark else "")


def _field(e: dict[str, object], key: str) -> str:
    """A journal field as text: journalctl writes strings (a field that is not valid UTF-8 as an
    array of bytes); anything else is no value."""
    v = e.get(key)
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 256 for b in v):
        return bytes(v).decode(errors="replace")
    return ""


def parse_journal(stdout: str) -> list[JournalEntry]:
    """journalctl -o json -> entries in journal order; systemd's own lines have _PID 1. Total: a
    line that is not a JSON object of journal fields is skipped, whatever it holds."""
    out: list[JournalEntry] = []
    for line in stdout.splitlines():
        e = json_or_none(line)
        if not isinstance(e, dict):
            continue
        from_systemd = _field(e, "_PID") == "1" or _field(e, "SYSLOG_IDENTIFIER") == "systemd"
        invocation = _field(e, "INVOCATION_ID" if from_systemd else "_SYSTEMD_INVOCATION_ID")
        code, status = (_field(e, "EXIT_CODE"), _field(e, "EXIT_STATUS")) if from_systemd else ("", "")
        for part in _field(e, "MESSAGE").splitlines():
            out.append(JournalEntry(part, not from_systemd, invocation, code, status))
    return out
