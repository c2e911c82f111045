"""Loaded desired state kept as plain data, so that a run of a tree loaded before skips the
loader (parsing, checking, merging and rendering every file).

Every door loads through `load_desired` here: the CLI, the daemon, the hooks and pull mode.

What is kept: JSON, one file per tree (the id of the tree the snapshot reads: a new commit of
the same files hits), holding the DesiredState as data (dataclass fields, bytes as base64) and
the fingerprint of the loader's own code (a changed loader never reads an old entry). Only a
load that succeeded is kept; a ConfigError is raised again by the loader every time.

Nothing read from the cache runs as code: msgspec (the project's one serialiser, see
docs/architecture.md) decodes it straight into the spec's frozen value types, checking every
value against their annotations as it reads (a value of another type is a miss). Still, what it says is deployed,
so it is used only when the cache directory, its `desired/` and the entry are this user's and
writable by no one else: looked at (lstat) before anything in them is opened, so another user's
cache directory (`sudo -E` keeps XDG_CACHE_HOME) is never opened at all, and checked again on
the opened descriptors (O_NOFOLLOW: a link is refused; a directory swapped after the first look
is the one checked; the checks are the ones every file of the controller's own passes, in
dirs.py); and only when the entry names the tree and fingerprint asked for. Anything else, and
every error, is a miss: the loader runs, and nothing is written there.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from .. import dirs
from ..values import replace
from .spec import DesiredState

if TYPE_CHECKING:
    from collections.abc import Callable

    from .repo import SnapshotLike
    from .source import Snapshot

FORMAT = 3                  # 3: known_hosts texts once (2: in every host; 1 wrote bytes as {"base64": ...})
KEEP = 32                   # entries kept; the oldest go when a new one is written
MAX_BYTES = 64 << 20        # an entry larger than this is not read
_DIR = "desired"
_CODE = Path(__file__).resolve().parent


def load_desired(snap: SnapshotLike, cache_dir: Path | None = None) -> DesiredState:
    """The desired state of the snapshot: from the cache when this tree was loaded before by
    this loader, else loaded (desired.load.load_desired: ConfigError on bad input) and kept."""
    tree: str | None = getattr(snap, "tree_id", None)
    revision: str | None = getattr(snap, "revision", None)
    where = (cache_dir or dirs.default_cache_dir()) / _DIR if tree and revision else None
    if where is not None and dirs.usable_dir(where.parent) and dirs.usable_dir(where):
        entry = _read(where, f"{tree}.json")
        if entry is not None and revision and (entry.format, entry.tree, entry.fingerprint) == (FORMAT, tree,
                                                                                            fingerprint()):
            return replace(entry.state, revision=revision)
    from .load import load_desired as load  # the loader: only on a miss
    state = load(snap)
    if where is not None and tree and _prepare(where):
        _write(where, f"{tree}.json", CacheEntry(FORMAT, tree, fingerprint(), state))
    return state


def render_at(snap: Snapshot, cache_dir: Path | None = None) -> Callable[[str], DesiredState | None]:
    """A function giving the desired state at another revision of the same repo (for rollback),
    kept per revision; None where that revision is missing or invalid."""
    from ..errors import ConfigError, SourceError
    from .source import snapshot

    kept: dict[str, DesiredState | None] = {}

    def at(rev: str) -> DesiredState | None:
        if rev not in kept:
            try:
                kept[rev] = load_desired(snapshot(snap.repo, rev, snap.subdir), cache_dir)
            except (ConfigError, SourceError):
                kept[rev] = None
        return kept[rev]
    return at


@functools.cache
def fingerprint() -> str:
    """The loader's code: name, size and modification time of every module of desired/ (the
    loader and everything it imports of ours lives there or in the base layer it never changes
    without a release), the format, and the Python version."""
    h = hashlib.sha256(f"{FORMAT} {sys.version}".encode())
    for entry in sorted(os.scandir(_CODE), key=lambda e: e.name):
        if entry.name.endswith(".py"):
            st = entry.stat()
            h.update(f"\0{entry.name} {st.st_size} {st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


# ---- the entry as JSON: msgspec, typed by the spec's own dataclasses -----------------------------


class CacheEntry(msgspec.Struct, frozen=True):
    """One kept load: the tree it is of, the loader that made it, and the state."""

    format: int
    tree: str
    fingerprint: str
    state: DesiredState
    # As written: each known_hosts text once, and which one a host's SSHSpec holds (host ->
    # index). Every host of a fleet holds the fleet's whole file: written into each it made an
    # entry grow with the square of the fleet (1,000 hosts: 100 MB, over MAX_BYTES, so it was
    # never read back). Empty in an entry as the loader gave it.
    known_hosts: list[str] = msgspec.field(default_factory=list)
    known_by: dict[str, int] = msgspec.field(default_factory=dict)


def encode(entry: CacheEntry) -> bytes:
    """An entry as JSON (msgspec: dataclasses as objects, tuples as arrays, bytes as base64),
    each known_hosts text once."""
    texts: dict[str, int] = {}
    by: dict[str, int] = {}
    hosts = dict(entry.state.hosts)
    for name, h in hosts.items():
        if h.ssh.known_hosts is not None:
            by[name] = texts.setdefault(h.ssh.known_hosts, len(texts))
            hosts[name] = replace(h, ssh=replace(h.ssh, known_hosts=None))
    return msgspec.json.encode(replace(entry, state=replace(entry.state, hosts=hosts), known_hosts=list(texts),
                                       known_by=by))


def decode(raw: bytes) -> CacheEntry | None:
    """The entry `encode` made, checked against the spec's annotations as it is read (a value of
    another type, a missing field: None), each host's known_hosts text put back (the hosts that
    share a text share one string); None for anything that is not such an entry."""
    try:
        entry = msgspec.json.decode(raw, type=CacheEntry)
        hosts = dict(entry.state.hosts)
        for name, i in entry.known_by.items():
            h = hosts[name]
            if i < 0 or h.ssh.known_hosts is not None:
                return None
            hosts[name] = replace(h, ssh=replace(h.ssh, known_hosts=entry.known_hosts[i]))
    except (msgspec.MsgspecError, RecursionError, ValueError, TypeError, KeyError, IndexError):
        return None
    return CacheEntry(entry.format, entry.tree, entry.fingerprint, replace(entry.state, hosts=hosts))


# ---- the files: this user's, writable by no one else (the checks are dirs.py's) ---------------


def _prepare(where: Path) -> bool:
    """The cache directory and its `desired/` made (0700) where missing; whether both are usable."""
    for d in (where.parent, where):
        if not os.path.lexists(d):
            with contextlib.suppress(OSError):
                d.mkdir(mode=dirs.DIR_MODE, parents=True)
        if not dirs.usable_dir(d):
            return False
    return True


def _open_dir(where: Path) -> int | None:
    try:
        return dirs.open_own_dir(where)
    except OSError:
        return None


def _read(where: Path, name: str) -> CacheEntry | None:
    d = _open_dir(where)
    if d is None:
        return None
    try:
        raw = dirs.read_own(d, name, MAX_BYTES)
    finally:
        os.close(d)
    return decode(raw) if raw is not None else None


def _write(where: Path, name: str, entry: CacheEntry) -> None:
    """Kept atomically (a fresh temp file renamed over the entry) in a 0700 directory; best
    effort: a cache that cannot be written is only a slower next run."""
    d = _open_dir(where)
    if d is None:
        return
    try:
        dirs.write_own(d, name, encode(entry))
        _prune(d)
    except (OSError, TypeError, ValueError):
        pass
    finally:
        os.close(d)


def _prune(d: int) -> None:
    """Keep the KEEP newest entries."""
    entries = []
    for name in os.listdir(d):
        if name.endswith(".json") and not name.startswith("."):
            with contextlib.suppress(OSError):
                entries.append((os.stat(name, dir_fd=d, follow_symlinks=False).st_mtime_ns, name))
    for _mtime, name in sorted(entries, reverse=True)[KEEP:]:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=d)
