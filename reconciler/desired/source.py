"""Reading the desired-state repository at a revision, from git objects (pygit2).

The working tree is never read: what is deployed is exactly what a commit holds. `--repo` is a
local path (working clone or bare repo) or a URL, which is mirrored into a cache directory and
fetched on every run.

pygit2 is imported when a repository is first opened (a command that opens none, `--help` or
`status`, never imports it).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from ..dirs import default_cache_dir
from ..errors import SourceError

if TYPE_CHECKING:
    import pygit2

    from .gitauth import GitAuth

_URL = re.compile(r"^[a-z][a-z0-9+.-]*://|^[^/\s]+@[^:\s]+:")
# libgit2's network timeouts for a URL repo's fetch (milliseconds; its default is none): a
# remote that accepts and then stalls fails the fetch, never hangs its caller (the daemon's
# thread for it, a pull run) for ever. Set only where the process has not chosen its own.
CONNECT_TIMEOUT_MS = 15_000
SERVER_TIMEOUT_MS = 60_000


class Snapshot:
    """The files of one commit (optionally below a sub-directory), read on demand."""

    def __init__(self, repo: pygit2.Repository, commit: pygit2.Commit, subdir: str = ""):
        self.repo, self.commit, self.subdir = repo, commit, subdir
        self.revision = str(commit.id)
        self._tree: str | None = None

    @property
    def short(self) -> str:
        return self.revision[:7]

    @property
    def tree_id(self) -> str | None:
        """The id of the tree this snapshot reads (the commit's, or the sub-directory's): a name
        for its content (the daemon loads a tree it loaded before from memory)."""
        if self._tree is None:
            obj = self._entry("")
            self._tree = str(obj.id) if obj is not None else ""
        return self._tree or None

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
        obj = self._entry(directory)
        if obj is None or obj.type != pygit2.GIT_OBJECT_TREE:
            return []
        return sorted(e.name for e in obj if e.type == pygit2.GIT_OBJECT_BLOB)


def is_url(repo: str) -> bool:
    return bool(_URL.match(repo)) and not Path(repo).exists()


def open_repo(repo: str, cache_dir: Path | None = None, *, also_fetch: Sequence[str] = (),
              auth: GitAuth | None = None) -> pygit2.Repository:
    """Open a local repository, or mirror a URL into the cache and fetch it (its branches, and
    the refspecs in `also_fetch` in the same round trip: pull mode's notes), authenticated as
    gitauth.py says: the server by its SSH host key or TLS certificate, the client by `auth`'s
    key or git's credential helpers."""
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
    from .gitauth import Callbacks, GitAuth
    auth = auth or GitAuth()
    auth.check()
    _network_timeouts(pygit2)
    cache = (cache_dir or default_cache_dir()) / "repos"
    cache.mkdir(parents=True, exist_ok=True)
    dest = cache / hashlib.sha256(repo.encode()).hexdigest()[:16]
    used: list[Callbacks] = []

    def callbacks() -> Callbacks:          # one per connection: a second ask is then a refusal
        used.append(Callbacks(repo, auth))
        return used[-1]
    try:
        with known_hosts(auth.known_hosts):
            if not (dest / "HEAD").exists():
                r = pygit2.clone_repository(repo, str(dest), bare=True, callbacks=callbacks())
            else:
                r = pygit2.Repository(str(dest))
            remote = r.remotes["origin"]
            remote.fetch(["+refs/heads/*:refs/heads/*", *also_fetch], prune=pygit2.enums.FetchPrune.PRUNE,
                         callbacks=callbacks())
    except (pygit2.GitError, KeyError, ValueError, SourceError) as e:
        problem = next((c.problem for c in reversed(used) if c.problem), None)
        raise SourceError(f"cannot fetch {shown_url(repo)}: {problem or e}") from None
    for c in used:
        c.succeeded()
    return r


_HOME = threading.Lock()


@contextlib.contextmanager
def known_hosts(path: str | None) -> Iterator[None]:
    """libgit2 checks an SSH server's key against <its home directory>/.ssh/known_hosts: for a
    known_hosts file of the caller's choosing, its home directory is a private copy's for the
    while (one at a time: the setting is the process's). None: the user's own file."""
    if path is None:
        yield
        return
    import pygit2
    from pygit2.enums import Option
    with _HOME, tempfile.TemporaryDirectory(prefix="reconciler-ssh-") as home:
        os.mkdir(os.path.join(home, ".ssh"), 0o700)
        shutil.copyfile(path, os.path.join(home, ".ssh", "known_hosts"))
        before = pygit2.option(Option.GET_HOMEDIR)
        pygit2.option(Option.SET_HOMEDIR, home)
        try:
            yield
        finally:
            pygit2.option(Option.SET_HOMEDIR, before)


def _network_timeouts(pygit2: Any) -> None:
    """Bound libgit2's connect and each read or write on a remote (HTTP(S) and git://)."""
    settings = pygit2.settings
    if not settings.server_connect_timeout:
        settings.server_connect_timeout = CONNECT_TIMEOUT_MS
    if not settings.server_timeout:
        settings.server_timeout = SERVER_TIMEOUT_MS


def shown_url(repo: str) -> str:
    """A repo URL fit for a message: any user name and password replaced by *** (up to the last
    @ of the authority: a password may hold an @ of its own)."""
    if "://" not in repo:
        return repo
    scheme, rest = repo.split("://", 1)
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = "***@" + authority.rsplit("@", 1)[1]
    return f"{scheme}://{authority}{slash}{path}"


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
