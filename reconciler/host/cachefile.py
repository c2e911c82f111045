"""A controller-side cache kept as one JSON object in the state directory: per host, what a probe
of that host answered. Read once, written whole by a rename; a cache, so a file that cannot be
read or written costs one probe next time, never an error.

What it says decides whether a check runs (an `ok` engine verdict skips the shipped rules), and
the state directory comes from the environment (`sudo -E`): so it is read and written only in a
directory of this user's alone, as a file of this user's alone (dirs.py: O_NOFOLLOW, fstat, one
link; a fresh O_EXCL temporary name renamed over it). Anything else is not read and not written:
the cache lives in memory for the run. The doors refuse such a state directory before a run
(dirs.own_dir, with the fix in words); this is the same rule where the file is opened.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .. import dirs

MAX_BYTES = 16 << 20        # a cache larger than this is not read


class CacheFile:
    """`data` is host -> key -> entry, loaded from `path` (None: kept in memory only)."""

    def __init__(self, path: Path | None):
        self.path = path
        self.data: dict[str, dict[str, Any]] = {}
        self._written = ""          # the text the file holds (as read or last written)
        raw = _read(path) if path is not None else None
        if raw is None:
            return
        try:
            text = raw.decode()
            loaded = json.loads(text)
        except (UnicodeDecodeError, ValueError, RecursionError):
            return
        if isinstance(loaded, dict):
            self.data, self._written = loaded, text

    def save(self) -> None:
        """Write the file where its text would change (a deploy that learned nothing new writes
        nothing)."""
        if self.path is None:
            return
        text = json.dumps(self.data)                              # insertion order kept (oldest first)
        if text == self._written:
            return
        try:
            d = dirs.open_own_dir(dirs.own_dir(self.path.parent))
        except (OSError, dirs.UnsafePath):
            return
        try:
            dirs.write_own(d, self.path.name, text.encode())
            self._written = text
        except OSError:
            pass
        finally:
            os.close(d)


def _read(path: Path) -> bytes | None:
    """The file's bytes when it and its directory are ours alone, else None."""
    try:
        d = dirs.open_own_dir(dirs.own_dir(path.parent, create=False))
    except (OSError, dirs.UnsafePath):
        return None
    try:
        return dirs.read_own(d, path.name, MAX_BYTES)
    finally:
        os.close(d)
