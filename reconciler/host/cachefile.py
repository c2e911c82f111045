"""A controller-side cache kept as one JSON object in the state directory: per host, what a probe
of that host answered. Read once, written whole by a rename; a cache, so a file that cannot be
read or written costs one probe next time, never an error."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class CacheFile:
    """`data` is host -> key -> entry, loaded from `path` (None: kept in memory only)."""

    def __init__(self, path: Path | None):
        self.path = path
        self.data: dict[str, dict[str, Any]] = {}
        self._written = ""          # the text the file holds (as read or last written)
        if path is not None and path.exists():
            try:
                self._written = path.read_text()
                loaded = json.loads(self._written)
                self.data = loaded if isinstance(loaded, dict) else {}
            except (OSError, json.JSONDecodeError):
                self.data = {}

    def save(self) -> None:
        """Write the file where its text would change (a deploy that learned nothing new writes
        nothing)."""
        if self.path is None:
            return
        text = json.dumps(self.data)                              # insertion order kept (oldest first)
        if text == self._written:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")     # two runs at once: each its own
            tmp.write_text(text)
            os.replace(tmp, self.path)
            self._written = text
        except OSError:
            pass
