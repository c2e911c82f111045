"""Reading the desired-state repository at a revision, from git objects (pygit2).

The working tree is never read: what is deployed is exactly what a commit holds. `--repo` is a
local path (working clone or bare repo) or a URL, which is mirrored into a cache directory and
fetched on every run.

pygit2 is imported when a repository is first opened: a run whose revision (a local repo's
HEAD, read from git's own ref files by `deferred_snapshot`) was loaded before reads its state
from the load cache and never opens the repository, unless a later step reads from it.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from .errors import SourceError

if TYPE_CHECKING:
    import pygit2

_URL = re.compile(r"^[a-z][a-z0-9+.-]*://|^[^/\s]+@[^:\s]+:")


def default_cache_dir() -> Path:
    """Where URL repos are mirrored: $RECONCILER_CACHE_DIR or the user's cache dir."""
    env = os.environ.get("RECONCILER_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "reconciler"


class Snapshot:
    """The files of one commit (optionally below a sub-directory), read on demand.

    Made from an open repository and commit, or deferred: a revision id and how to open them,
    which happens on first use of `repo`, `commit` or the files."""

    def __init__(self, repo: pygit2.Repository | None, commit: pygit2.Commit | None, subdir: str = "", *,
                 revision: str | None = None,
                 opener: Callable[[], tuple[pygit2.Repository, pygit2.Commit]] | None = None):
        self._repo, self._commit, self.subdir = repo, commit, subdir
        self._revision = revision if revision is not None else str(commit.id) if commit is not None else ""
        self._opener = opener
        self._tree: str | None = None

    def _open(self) -> None:
        if self._repo is None or self._commit is None:
            assert self._opener is not None
            self._repo, self._commit = self._opener()

    @property
    def repo(self) -> pygit2.Repository:
        self._open()
        assert self._repo is not None
        return self._repo

    @property
    def commit(self) -> pygit2.Commit:
        self._open()
        assert self._commit is not None
        return self._commit

    @property
    def revision(self) -> str:
        return self._revision

    @property
    def short(self) -> str:
        return self.revision[:7]

    @property
    def tree_id(self) -> str | None:
        """The id of the tree this snapshot reads (the commit's, or the sub-directory's): a name
        for its content (loadcache.py keys loaded states by it)."""
        if self._tree is None:
            obj = self._entry("")
            self._tree = str(obj.id) if obj is not None else ""
        return self._tree or None

    def know_tree(self, tree_id: str) -> None:
        """Its tree id, as the load cache recorded it for this revision (no need to open git)."""
        self._tree = tree_id

    def _entry(self, path: str) -> Any:
        full = str(PurePosixPath(self.subdir, path)) if self.subdir else path
        full = full.strip("/")
        try:
            return self.commit.tree[full] if full else self.commit.tree
        except KeyError:
            return None

    def read(self, path: str) -> bytes | None:
        """The bytes of a file at this revision, or None when there is no such file."""
        import pygit2
        obj = self._entry(path)
        if obj is None or obj.type != pygit2.GIT_OBJECT_BLOB:
            return None
        return bytes(obj.data)

    def list(self, directory: str) -> list[str]:
        """Names of the files directly inside a directory (sorted; [] when absent)."""
        import pygit2
        obj = self._entry(directory) if directory else self._entry("")
        if obj is None or obj.type != pygit2.GIT_OBJECT_TREE:
            return []
        return sorted(e.name for e in obj if e.type == pygit2.GIT_OBJECT_BLOB)


_HEX40 = re.compile(r"^[0-9a-f]{40}$")


def _git_dir(repo: str) -> Path | None:
    """The git directory of a plain local repo at exactly this path (a clone's .git, or a bare
    repo); None for anything else (a sub-directory of a clone, a linked worktree, reftable)."""
    p = Path(repo).resolve()
    g = p / ".git" if (p / ".git").is_dir() else p if (p / "HEAD").is_file() and (p / "objects").is_dir() else None
    if g is None or (g / "commondir").exists() or (g / "reftable").exists():
        return None
    return g


def _ref(gitdir: Path, name: str, depth: int = 0) -> str | None:
    """A ref's commit id from git's files: the loose ref, else packed-refs; None when unsure."""
    if depth > 4 or not (name == "HEAD" or name.startswith("refs/heads/")) or ".." in name:
        return None
    try:
        text: str | None = (gitdir / name).read_text().strip()
    except FileNotFoundError:
        text = None
    except OSError:
        return None
    if text is not None:
        if text.startswith("ref: "):
            return _ref(gitdir, text[5:].strip(), depth + 1)
        return text if _HEX40.match(text) else None
    try:
        packed = (gitdir / "packed-refs").read_text()
    except OSError:
        return None
    for line in packed.splitlines():
        if line[41:] == name and _HEX40.match(line[:40]):
            return line[:40]
    return None


def deferred_snapshot(repo: str, rev: str | None = None, subdir: str = "") -> Snapshot | None:
    """The snapshot of a local repo's HEAD, its commit id read from git's ref files and the
    repository opened only when something reads it; None when that is not plain (a URL, a
    revision given, a pre-receive hook's quarantine, an unusual repository): snapshot() then."""
    if rev not in (None, "HEAD") or is_url(repo) or os.environ.get("GIT_QUARANTINE_PATH"):
        return None
    gitdir = _git_dir(repo)
    commit = _ref(gitdir, "HEAD") if gitdir is not None else None
    if commit is None:
        return None
    sub = subdir.strip("/")

    def opener() -> tuple[pygit2.Repository, pygit2.Commit]:
        snap = snapshot(open_repo(repo), commit, sub)
        return snap.repo, snap.commit
    return Snapshot(None, None, sub, revision=commit, opener=opener)


def is_url(repo: str) -> bool:
    return bool(_URL.match(repo)) and not Path(repo).exists()


def open_repo(repo: str, cache_dir: Path | None = None, *, also_fetch: Sequence[str] = ()) -> pygit2.Repository:
    """Open a local repository, or mirror a URL into the cache and fetch it (its branches, and
    the refspecs in `also_fetch` in the same round trip: pull mode's notes)."""
    import pygit2
    if not is_url(repo):
        path = pygit2.discover_repository(str(Path(repo).resolve()))
        if path is None:
            raise SourceError(f"{repo}: not a git repository")
        r = pygit2.Repository(path)
        quarantine = os.environ.get("GIT_QUARANTINE_PATH")
        if quarantine:
            # Inside a pre-receive hook the pushed objects are still in git's quarantine dir.
            r.odb.add_disk_alternate(quarantine)
        return r
    cache = (cache_dir or default_cache_dir()) / "repos"
    cache.mkdir(parents=True, exist_ok=True)
    dest = cache / hashlib.sha256(repo.encode()).hexdigest()[:16]
    try:
        if not (dest / "HEAD").exists():
            r = pygit2.clone_repository(repo, str(dest), bare=True)
        else:
            r = pygit2.Repository(str(dest))
        remote = r.remotes["origin"]
        remote.fetch(["+refs/heads/*:refs/heads/*", *also_fetch], prune=pygit2.enums.FetchPrune.PRUNE)
        # Follow the remote's default branch if it has one we know.
        return r
    except (pygit2.GitError, KeyError, ValueError) as e:
        raise SourceError(f"cannot fetch {_redact(repo)}: {e}") from None


def _redact(url: str) -> str:
    """Drop user:password@ from a URL so a token in it never reaches a message."""
    return re.sub(r"//[^/@]*@", "//***@", url)


def snapshot(repo: pygit2.Repository, rev: str | None = None, subdir: str = "") -> Snapshot:
    """Resolve a revision (default HEAD) to a commit and return its snapshot."""
    import pygit2
    spec = rev or "HEAD"
    try:
        obj = repo.revparse_single(spec)
        commit = obj.peel(pygit2.Commit)
    except (KeyError, ValueError, pygit2.GitError, pygit2.InvalidSpecError) as e:
        raise SourceError(f"revision {spec!r} not found in {repo.path}: {e}") from None
    snap = Snapshot(repo, commit, subdir.strip("/"))
    if subdir and snap._entry("") is None:
        raise SourceError(f"{subdir!r} does not exist at {snap.short}")
    return snap
