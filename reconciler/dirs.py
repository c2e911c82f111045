"""Where the controller keeps its own files on this machine, and how they are opened: only in a
directory of this user's alone (no reconciler imports here).

The state directory holds the store (`state.db`) and the caches of what hosts answered (engine
verdicts, server versions); the cache directory the loaded desired state (desired/cache.py).
Both are found through the environment (`$RECONCILER_STATE_DIR`, `$XDG_STATE_HOME`, `$HOME`),
which `sudo -E` hands from a user to root. So nothing there is trusted by its name: a directory
is used only when it is this user's (the effective uid), writable by no one else, and reached
through directories no other user can change (ssh's StrictModes, for ~/.ssh); a file in it only
when it is a regular file of this user's, writable by no one else, with one link, opened with
O_NOFOLLOW and checked on the descriptor (fstat); a new one is written to a fresh temporary name
(O_EXCL|O_NOFOLLOW) and renamed over the old. A planted link is then never followed: not to
read what it points to, and not to write it.

`own_dir` refuses (UnsafePath, one line naming the directory and the fix) where a door must say
so; `usable_dir`, `read_own` and `write_own` are the quiet forms a cache uses (a miss, never an
error).
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

DIR_MODE = 0o700            # a directory this module makes
FILE_MODE = 0o600           # a file this module writes


class UnsafePath(Exception):
    """A directory or file of the controller's own that another user chose or could change: the
    message says which, whose it is, and what to do (one line)."""


def default_state_dir() -> Path:
    """$RECONCILER_STATE_DIR, else $XDG_STATE_HOME/reconciler, else ~/.local/state/reconciler."""
    return _default_dir("RECONCILER_STATE_DIR", "XDG_STATE_HOME", ".local/state")


def default_cache_dir() -> Path:
    """Where URL repos are mirrored: $RECONCILER_CACHE_DIR or the user's cache dir."""
    return _default_dir("RECONCILER_CACHE_DIR", "XDG_CACHE_HOME", ".cache")


def _default_dir(own: str, xdg: str, home: str) -> Path:
    """$own, else $xdg/reconciler, else ~/home/reconciler."""
    if env := os.environ.get(own):
        return Path(env)
    return Path(os.environ.get(xdg) or str(Path.home() / home)) / "reconciler"


def ours(st: os.stat_result) -> bool:
    """Owned by this process's effective user and writable by no one else."""
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def own_file(st: os.stat_result) -> bool:
    """A regular file of ours with one link (a hard link to another file is not ours to write)."""
    return stat.S_ISREG(st.st_mode) and ours(st) and st.st_nlink == 1


def usable_dir(path: Path) -> bool:
    """A directory of ours, by its own entry (a link is not): looked at before anything in it is
    opened, so another user's directory is never opened at all."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and ours(st)


def _ancestor_problem(st: os.stat_result) -> bool:
    """An ancestor another user could rename our directory out of: owned by someone other than
    root or us, or writable by others without the sticky bit (/tmp is fine)."""
    if st.st_uid not in (0, os.geteuid()):
        return True
    return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)) and not st.st_mode & stat.S_ISVTX


def unsafe_dir(path: Path, what: str = "state directory") -> str | None:
    """Why `path` (resolved) may not hold our files, in one line with the fix; None when it may."""
    euid = os.geteuid()
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"{what} {path}: {e.strerror or e}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{what} {path} is not a directory"
    if st.st_uid != euid:
        return (f"{what} {path} belongs to uid {st.st_uid}, not to this run's uid {euid}: run as its owner "
                f"(sudo -u '#{st.st_uid}' ...), or set RECONCILER_STATE_DIR to a directory of uid {euid}'s (sudo -E "
                f"keeps a user's HOME, XDG_STATE_HOME and RECONCILER_STATE_DIR)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"{what} {path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): "
                f"chmod go-w {path}")
    for parent in path.parents:
        try:
            pst = os.lstat(parent)
        except OSError as e:
            return f"{what} {path}: {parent}: {e.strerror or e}"
        if _ancestor_problem(pst):
            return (f"{what} {path} lies in {parent}, which uid {pst.st_uid} or others can change (mode "
                    f"{stat.S_IMODE(pst.st_mode):04o}): set RECONCILER_STATE_DIR to a directory reached only "
                    f"through root's and uid {euid}'s directories")
    return None


def own_dir(path: Path, *, create: bool = True, what: str = "state directory") -> Path:
    """`path` resolved (links in it followed once, here), made (0700) when missing and `create`;
    UnsafePath when it is not ours alone (see unsafe_dir)."""
    real = Path(os.path.realpath(path))
    if create and not os.path.lexists(real):
        with contextlib.suppress(FileExistsError):
            real.mkdir(mode=DIR_MODE, parents=True)
    problem = unsafe_dir(real, what)
    if problem is not None:
        raise UnsafePath(problem)
    return real


def open_own_dir(path: Path) -> int:
    """A descriptor of the directory `path` (no link followed at its last step), checked on the
    descriptor: ours alone. OSError when it cannot be opened or is not ours (a directory swapped
    after a look is the one checked)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    if not ours(os.fstat(fd)):
        os.close(fd)
        raise PermissionError(f"{path} is not this user's alone")
    return fd


def entry_problem(dirfd: int, name: str) -> str | None:
    """Why the entry `name` of a directory (by descriptor) may not be opened as our file: a link,
    not a regular file, another user's, writable by others, or linked elsewhere too. None when it
    is ours alone or absent."""
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not {os.geteuid()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    if st.st_nlink != 1:
        return f"has {st.st_nlink} hard links"
    return None


def read_own(dirfd: int, name: str, max_bytes: int) -> bytes | None:
    """The bytes of our file `name` in a directory (by descriptor), or None: absent, a link,
    not ours alone, larger than max_bytes, or unreadable."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dirfd)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not own_file(st) or st.st_size > max_bytes:
            return None
        try:
            return f.read(max_bytes + 1)
        except OSError:
            return None


def write_own(dirfd: int, name: str, data: bytes) -> None:
    """Write our file `name` in a directory (by descriptor) whole: a new file under a fresh name
    (O_EXCL|O_NOFOLLOW, 0600: a name planted beforehand is never written through), renamed over
    the entry (a link planted there is replaced, its target untouched). OSError when it cannot."""
    for _ in range(8):
        tmp = f".{name}.{os.urandom(6).hex()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE,
                         dir_fd=dirfd)
        except FileExistsError:
            continue
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.rename(tmp, name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dirfd)
            raise
        return
    raise FileExistsError(f"no fresh temporary name for {name}")
