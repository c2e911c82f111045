"""A revision of the desired-state repository as loading sees it: its layout and how it is read.

The layout is the file and folder names load.py looks for (desired-state/README.md documents
them for users). SnapshotLike is all that loading needs from a revision, read and list, so the
same loader runs on a git revision (source.Snapshot), on files held in memory (MemorySnapshot:
tests, previews, tools) or on a test double. Kept apart from load.py so that every part of the
loader can name these without importing the loader.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

FLEET_FILE = "fleet.toml"
HOSTS_DIR = "hosts"
SERVICES_DIR = "services"


class SnapshotLike(Protocol):
    """What load needs from a revision: source.Snapshot, MemorySnapshot, or a test double."""

    @property
    def revision(self) -> str: ...

    def read(self, path: str) -> bytes | None: ...

    def list(self, directory: str) -> list[str]: ...


class MemorySnapshot:
    """A revision held in memory: {repo path: content}. For tests, previews and tools."""

    def __init__(self, files: Mapping[str, bytes | str], revision: str = "0" * 40):
        self.files = {
            path.strip("/"): data.encode() if isinstance(data, str) else data for path, data in files.items()
        }
        self.revision = revision

    @property
    def short(self) -> str:
        return self.revision[:7]

    def read(self, path: str) -> bytes | None:
        """The bytes of a file, or None when there is no such file."""
        return self.files.get(path.strip("/"))

    def list(self, directory: str) -> list[str]:
        """Names of the files directly inside a directory (sorted; [] when absent)."""
        prefix = directory.strip("/") + "/" if directory.strip("/") else ""
        names = {p[len(prefix) :] for p in self.files if p.startswith(prefix)}
        return sorted(n for n in names if n and "/" not in n)
