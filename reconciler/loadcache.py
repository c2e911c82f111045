"""Loaded desired states, kept by content: a run at a revision already loaded skips the loader.

Loading a revision (load.py: parsing, the pydantic schema, merging, rendering) costs about 0.1 s
of a cold `reconcile` run, most of it importing pydantic and building the schema. What it
returns is a pure function of the files below `--path` at that revision and of the loader's
code, and it is plain frozen dataclasses (spec.py). The repo's own pre-flight rules
(rules/*.toml) are input too: they are checked with the load, so a bad one fails the run before
any host (exit 1), and a revision read back from the cache had valid ones; the rule pack itself
is parsed only when pre-flight runs (`rules`). So a successful load is pickled under the
cache dir (`$RECONCILER_CACHE_DIR` or ~/.cache/reconciler, `desired/`), keyed by the git tree id
of that directory (content-addressed: a commit that changes nothing there hits too; its own
revision is put in) and a fingerprint of the package's modules (another version of the
reconciler loads afresh). A load that fails is never kept: it fails again, with its problems.

The entries are the user's own, like Python's bytecode cache: a 0700 directory, 0600 files,
checked to be owned by this user and writable by nobody else before one is read. An entry that
is missing, unreadable, foreign or stale means: load from git again. The newest KEEP entries
stay. They hold what the revision holds (env values included; secrets only as the encrypted
bytes from the repo, never decrypted).

Beside the entries, a small file per commit names the tree it was loaded from
(`<commit>-<path hash>-<fingerprint>.key`): a run at a commit loaded before (`load_known`, with
source.deferred_snapshot's HEAD read from git's ref files) needs neither the loader nor git.

A run at a local commit not loaded before has it loaded by a forked child, which keeps it here,
while the run itself imports what it needs to reach the hosts (`load_aside`): the two halves of
a cold start overlap on a machine with a second core.

A commit loaded from git also gets a note of its nearest ancestors (`<commit>.ancestors`, the
newest ANCESTORS of them): a run that deploys it over a host's applied revision asks whether it
descends from it (the rewind check, trust.py), and a note that lists that revision says yes
without importing pygit2 (about 70 ms of a run at a new commit). A commit's history never
changes, so the note is written once; anything it does not list is asked of git.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ConfigError, SourceError

if TYPE_CHECKING:
    from .preflight import RuleSet
    from .source import Snapshot
    from .spec import DesiredState

KEEP = 64
ANCESTORS = 256      # how many of a commit's ancestors its note lists, newest first
_HEX = frozenset("0123456789abcdef")
# by key: the rule pack parsed while loading a revision in this process, or as kept in the
# cache (pickled: unpickled when pre-flight first asks, so a run that starts nothing never
# imports the rule modules)
_rulesets: dict[str, RuleSet | bytes] = {}
_PACKAGE = Path(__file__).resolve().parent
_fingerprint: str | None = None


def fingerprint() -> str:
    """The reconciler's own code, as far as a load depends on it: path, size and mtime of every
    module of the package and its sub-packages, and of the shipped rule pack (rules/*.toml): a
    reinstall or an edit changes it."""
    global _fingerprint
    if _fingerprint is None:
        h = hashlib.sha256()
        for d, dirs, files in sorted(os.walk(_PACKAGE)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            for name in sorted(f for f in files if f.endswith((".py", ".toml"))):
                st = os.stat(os.path.join(d, name))
                h.update(f"{os.path.relpath(d, _PACKAGE)}/{name} {st.st_size} {st.st_mtime_ns}\n".encode())
        _fingerprint = h.hexdigest()[:16]
    return _fingerprint


def cache_dir(base: Path | None = None) -> Path:
    from .source import default_cache_dir
    return (base or default_cache_dir()) / "desired"


def _alias(directory: Path, snap: Snapshot) -> Path:
    sub = hashlib.sha256(snap.subdir.encode()).hexdigest()[:8]
    return directory / f"{snap.revision}-{sub}-{fingerprint()}.key"


def _remember_tree(directory: Path, snap: Snapshot, tree: str) -> None:
    """Note which tree this commit loads (once per commit; a commit's tree never changes)."""
    alias = _alias(directory, snap)
    if alias.exists():
        return
    with contextlib.suppress(OSError):
        _put_text(directory, alias, tree)


def _put_text(directory: Path, path: Path, text: str) -> None:
    """A small file of the cache written whole (a 0600 temp renamed over it); raises OSError."""
    import tempfile
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _trusted_text(directory: Path, path: Path) -> str | None:
    """A small file of the cache, where it and its directory are only this user's (None else)."""
    try:
        if not _trusted(directory.stat()) or not _trusted(path.stat()):
            return None
        return path.read_text()
    except OSError:
        return None


def _ancestry(directory: Path, revision: str) -> Path | None:
    """Where a commit's ancestors note lives; None for anything but a full commit id."""
    if len(revision) not in (40, 64) or not _HEX.issuperset(revision):
        return None
    return directory / f"{revision}.ancestors"


def _note_ancestors(directory: Path, snap: Snapshot) -> None:
    """Note the commit's nearest ancestors, once per commit (its history never changes)."""
    path = _ancestry(directory, snap.revision)
    if path is None or path.exists():
        return
    import itertools

    import pygit2
    try:
        walk = snap.repo.walk(snap.commit.id, pygit2.enums.SortMode.NONE)   # lazy: never the whole history
        ids = [str(c.id) for c in itertools.islice(walk, 1, ANCESTORS + 1)]
        _put_text(directory, path, "".join(f"{c}\n" for c in ids))
    except (OSError, pygit2.GitError, ValueError):
        pass


def descends_known(revision: str, applied: str, base: Path | None = None) -> bool:
    """True when `applied` is among the ancestors noted for `revision` (a note that only this
    user can have written); False when that is not known here (ask git)."""
    directory = cache_dir(base)
    path = _ancestry(directory, revision)
    if path is None or len(applied) != len(revision) or not _HEX.issuperset(applied):
        return False
    noted = _trusted_text(directory, path)
    return noted is not None and f"\n{applied}\n" in "\n" + noted


def load_known(snap: Snapshot, base: Path | None = None) -> DesiredState | None:
    """The kept load of a commit loaded before by this code (without git: the tree it read is
    noted beside the entry); None when there is none."""
    directory = cache_dir(base)
    tree = (_trusted_text(directory, _alias(directory, snap)) or "").strip()
    if not tree or not _HEX.issuperset(tree):
        return None
    key = f"{tree}-{fingerprint()}"
    kept = _read(directory / f"{key}.pickle")
    if kept is None:
        return None
    snap.know_tree(tree)
    _rulesets[key] = kept[1]
    return replace(kept[0], revision=snap.revision)


def _last_path(directory: Path, repo: str, subdir: str) -> Path:
    where = hashlib.sha256(f"{os.path.realpath(repo)}\0{subdir.strip('/')}".encode()).hexdigest()[:16]
    return directory / f"last-{where}"


def remember_last(repo: str, subdir: str, revision: str, base: Path | None = None) -> None:
    """Note the revision a run at this local repo (and --path) loaded, for `last_loaded`."""
    directory = cache_dir(base)
    path = _last_path(directory, repo, subdir)
    if _trusted_text(directory, path) == revision:
        return
    with contextlib.suppress(OSError):
        if _trusted(directory.stat()):
            _put_text(directory, path, revision)


def last_loaded(repo: str, subdir: str, base: Path | None = None) -> DesiredState | None:
    """The state a run at this repo (and --path) loaded last, as kept (no git, no loader); None
    when there is none, or it is not kept any more."""
    from .source import Snapshot
    directory = cache_dir(base)
    revision = (_trusted_text(directory, _last_path(directory, repo, subdir)) or "").strip()
    if _ancestry(directory, revision) is None:        # a full commit id, nothing else
        return None
    return load_known(Snapshot(None, None, subdir.strip("/"), revision=revision), base)


def load_aside(snap: Snapshot, meanwhile: Callable[[], object], base: Path | None = None, *,
               spare: Callable[[], object] | None = None,
               wait: Callable[[int], object] | None = None) -> DesiredState | None:
    """A commit not loaded before, loaded in a forked child while this process runs `meanwhile`
    (the run's own imports: the SSH stack, the fleet modules); None where that did not happen.

    A first load costs about 0.3 s of CPU (importing pygit2 and pydantic, building the schema,
    reading and validating the files), and so does `meanwhile`: on a machine with a core to
    spare they overlap instead of adding up. The child keeps its load in the cache, as `load`
    does, and exits; this process then reads it from there (`load_known`), so what it gets is
    what an in-process load would have kept. None (the caller then loads the commit itself, and
    reports a bad one's problems as ever) when: no fork here (not Linux, or threads running,
    which a fork would not carry), the child failed (a bad revision: nothing is kept), or the
    cache could not be written. `meanwhile` has then run all the same.

    `spare` (what a run that deploys needs later) runs after `meanwhile` only where the child is
    still loading: this process would otherwise wait on it idle. So does `wait`, after it, given
    the child's PID: it returns once the child has exited (it does not reap it), having done
    meanwhile what it could (clicore: connect to the hosts).
    """
    import threading
    if sys.platform != "linux" or threading.active_count() != 1:
        meanwhile()
        return None
    pid = os.fork()
    if pid == 0:                   # the child: load, keep, exit without running the parent's exit handlers
        code = 1
        try:
            from .faults import pause_if_asked
            pause_if_asked("slow-load")
            _without_pydantic_plugins()
            load(snap, base)
            code = 0
        except BaseException:      # the parent loads again, and reports it
            pass
        finally:
            with contextlib.suppress(BaseException):   # nothing may keep the child from leaving
                from .dccache import save
                save()             # the methods of the dataclasses it imported (no atexit here)
            os._exit(code)
    reaped = False
    try:
        meanwhile()
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == 0:
            if spare is not None:
                spare()
            if wait is not None:
                wait(pid)
            _, status = os.waitpid(pid, 0)
        reaped = True
    finally:
        if not reaped:             # meanwhile failed (or Ctrl-C): the child is not waited for
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
                os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return None
    return load_known(snap, base)


def _without_pydantic_plugins() -> None:
    """In the loading child only: pydantic without its plugin loader. That module imports
    importlib.metadata and scans every installed distribution's entry points for plugins (about
    25 ms of the child, which a new commit's run waits for), and a load, whose result is plain
    dataclasses, has no use for plugins. PYDANTIC_DISABLE_PLUGINS is pydantic's own switch; the
    loader module in its place is not, so where a pydantic release imports something else from
    it, the child fails and the run loads the commit itself, as without the fork."""
    import types
    os.environ["PYDANTIC_DISABLE_PLUGINS"] = "__all__"
    if "pydantic.plugin._loader" not in sys.modules:
        loader = types.ModuleType("pydantic.plugin._loader")
        loader.get_plugins = lambda: ()        # type: ignore[attr-defined]
        sys.modules["pydantic.plugin._loader"] = loader


def _key(snap: Snapshot) -> str | None:
    """The id of the tree the loader reads (the commit's, or --path's), with the code's."""
    tree = snap.tree_id
    return f"{tree}-{fingerprint()}" if tree is not None else None


def _trusted(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _read(path: Path) -> tuple[DesiredState, bytes] | None:
    """A kept load: the desired state, and the revision's compiled rule pack (no pydantic) as a
    pickle of its own."""
    import pickle

    from .spec import DesiredState
    try:
        if not _trusted(path.parent.stat()):
            return None
        with open(path, "rb") as f:
            if not _trusted(os.fstat(f.fileno())):
                return None
            state = pickle.load(f)
    except Exception:          # missing, truncated, written by another version: load afresh
        return None
    if not (isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], DesiredState)
            and isinstance(state[1], bytes)):
        return None
    return state[0], state[1]


def _shipped(directory: Path) -> Path:
    return directory / f"shipped-{fingerprint()}.rules"


def _shipped_pack(directory: Path) -> bytes | None:
    """The compiled rule pack (pickled) of a revision with no rules/ of its own: only the
    shipped pack, the same for every such revision of this code, kept once beside the entries
    (a new commit then skips parsing it, about 45 ms)."""
    path = _shipped(directory)
    try:
        if not _trusted(directory.stat()):
            return None
        with open(path, "rb") as f:
            return f.read() if _trusted(os.fstat(f.fileno())) else None
    except OSError:
        return None


def _write(directory: Path, path: Path, state: DesiredState, rules: RuleSet | bytes, *,
           shipped: bool = False) -> None:
    """Keep a load (and, with `shipped`, its rule pack as the shipped-only one)."""
    import pickle
    import tempfile
    tmp: str | None = None
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _trusted(directory.stat()):
            return
        rules_blob = rules if isinstance(rules, bytes) else pickle.dumps(rules, protocol=pickle.HIGHEST_PROTOCOL)
        if shipped:
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(rules_blob)
            os.replace(tmp, _shipped(directory))
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")      # 0600
        with os.fdopen(fd, "wb") as f:
            pickle.dump((state, rules_blob), f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
        tmp = None
        for pattern, keep in (("*.pickle", KEEP), ("*.key", 16 * KEEP), ("*.ancestors", 4 * KEEP),
                              ("shipped-*.rules", 2)):
            entries = sorted(directory.glob(pattern), key=lambda p: p.stat().st_mtime, reverse=True)
            for old in entries[keep:]:
                old.unlink(missing_ok=True)
    except OSError:
        pass               # no cache this time; the run goes on
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def load(snap: Snapshot, base: Path | None = None) -> DesiredState:
    """load.load_desired(snap), from the cache when this content was loaded before by this code.

    Raises ConfigError as load_desired does (a failed load is never cached)."""
    key = _key(snap)
    directory = cache_dir(base)
    path = directory / f"{key}.pickle"
    if key is not None:
        kept = _read(path)
        if kept is not None:
            _rulesets[key] = kept[1]
            _remember_tree(directory, snap, key.split("-", 1)[0])
            _note_ancestors(directory, snap)
            return replace(kept[0], revision=snap.revision)
    from .load import load_desired
    state = load_desired(snap)
    shipped_only = not snap.list("rules")
    rules: RuleSet | bytes | None = _shipped_pack(directory) if shipped_only else None
    keep_shipped = shipped_only and rules is None
    if rules is None:
        from .preflight import load_rules
        rules = load_rules(snap)    # the repo's own rule files, checked before any host is touched
    if key is not None:
        _rulesets[key] = rules
        _write(directory, path, state, rules, shipped=keep_shipped)
        _remember_tree(directory, snap, key.split("-", 1)[0])
        _note_ancestors(directory, snap)
    return state


def rules(snap: Snapshot) -> RuleSet:
    """The revision's pre-flight rule pack (shipped + the repo's rules/*.toml): the one parsed with
    its load in this process, else parsed now (ConfigError for a bad repo rule file)."""
    key = _key(snap)
    kept = _rulesets.get(key) if key is not None else None
    if isinstance(kept, bytes):
        import pickle

        from .preflight import RuleSet
        try:
            kept = pickle.loads(kept)
        except Exception:      # written by another version after all: parse afresh
            kept = None
        kept = kept if isinstance(kept, RuleSet) else None
    if kept is not None:
        if key is not None:
            _rulesets[key] = kept
        return kept
    from .preflight import load_rules
    return load_rules(snap)


def render_at(snap: Snapshot, base: Path | None = None) -> Callable[[str], DesiredState | None]:
    """load.render_at through the cache: the desired state at another revision of the same repo
    (a rollback renders the last good one), per revision; None where it is missing or invalid."""
    from .source import snapshot

    done: dict[str, DesiredState | None] = {}

    def at(rev: str) -> DesiredState | None:
        if rev not in done:
            try:
                done[rev] = load(snapshot(snap.repo, rev, snap.subdir), base)
            except (ConfigError, SourceError):
                done[rev] = None
        return done[rev]
    return at
