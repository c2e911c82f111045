"""systemd unit text: unit files read from the repo, checked, and given the managed-file header.

A unit comes inline (`unit = "..."`) or from a file in the repo (`unit_file = "units/x.service"`).
A unit file is usually shared by many hosts, so it is read and checked once per path and its
problems are reported against the unit file itself, not against every host that uses it.
"""

from __future__ import annotations

import re

from .collect import Problems
from .merge import At
from .repo import SnapshotLike

HEADER = "# Managed by reconciler from git; edits on this host are reverted.\n# Source: {source}\n"

_SERVICE_SECTION = re.compile(r"^[ \t]*\[Service\][ \t]*$", re.MULTILINE)


def managed_unit(rendered: str, source: str) -> str:
    """The unit text as written on the host: the header naming its source, then the unit."""
    return HEADER.format(source=source) + rendered.rstrip("\n") + "\n"


class UnitFiles:
    """The unit files of one load, each read and checked once; faults go to `problems`."""

    def __init__(self, snap: SnapshotLike, problems: Problems):
        self.snap = snap
        self.problems = problems
        self._read: dict[str, str | None] = {}  # unit files read so far; None: unusable

    def read(self, path: str, at: At) -> str | None:
        """The text of a unit file (read and checked once per path), or None with a problem."""
        data = self.snap.read(path)
        if data is None:
            self.problems.add(at.file, at.key, f"file {path!r} not found in the repository")
            return None
        if path not in self._read:
            text: str | None = None
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                self.problems.add(path, "", "not UTF-8 text")
            if text is not None and not self.check_text(text, At(path, "")):
                text = None
            self._read[path] = text
        return self._read[path]

    def check_text(self, text: str, at: At) -> bool:
        """Whether unit text is usable (a service unit, no NUL); a problem at `at` when not."""
        if "\x00" in text:
            self.problems.add(at.file, at.key, "the unit text contains a NUL character")
            return False
        if not _SERVICE_SECTION.search(text):
            self.problems.add(at.file, at.key, "not a service unit: no [Service] section")
            return False
        return True
