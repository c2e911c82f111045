"""The trigger file the post-receive hook touches to wake the daemon at once: made ready
without ever acting on a path that may lead elsewhere (security review H2)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

TRIGGER_MODE = 0o660     # the pushing users' group may touch it


def prepare_trigger(path: Path) -> str | None:
    """Make the trigger file ready for the post-receive hook: the daemon's own regular file, mode
    TRIGGER_MODE. Returns None when it is, else why it is not used (and nothing was changed).

    Its directory may be writable by others (a deploy repo shared with the pushing users'
    group), who could leave a symlink or a hard link there to have the daemon create or chmod a
    file of its choosing. So nothing here acts on a path that may lead elsewhere: a new file is
    created with O_EXCL | O_NOFOLLOW; an existing one must be a regular file (lstat) and is
    opened with O_NOFOLLOW, and only that descriptor is judged (fstat: the same inode, one link)
    and changed (fchmod, and only when it is ours). A regular file of another user (made by an
    admin) is watched as it is, its mode left alone."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, TRIGGER_MODE)
    except FileExistsError:
        fd = -1
    except OSError as e:
        return (f"cannot create it ({e.strerror}); make it the daemon's: install -m 0660 -o {user_name()} "
                f"/dev/null {path}")
    try:
        if fd < 0:
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                return "it is a symbolic link (it would make the daemon change the file it points to); remove it"
            if not stat.S_ISREG(st.st_mode):
                return "it is not a regular file; remove it"
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
            except OSError as e:
                return f"cannot open it ({e.strerror}); remove it"
            opened = os.fstat(fd)
            if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(opened.st_mode):
                return "it was replaced while the daemon looked at it; remove it"
            if opened.st_uid != os.geteuid():
                return None                 # an admin's file: watched as it is
            if opened.st_nlink != 1:
                return (f"it has {opened.st_nlink} hard links (a chmod would change the other names too); "
                        f"remove it")
        os.fchmod(fd, TRIGGER_MODE)
        return None
    finally:
        if fd >= 0:
            os.close(fd)


def user_name() -> str:
    """This process's user name (the daemon's, for a fix to show; the pusher's, in a hook), or
    its uid."""
    import pwd
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())
