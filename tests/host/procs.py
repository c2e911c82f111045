"""Real processes in unit tests: whether one runs, and waiting for its end as an event (a pidfd
becomes readable when the process exits), not by sleeping and looking again."""

from __future__ import annotations

import os
import select
from pathlib import Path


def running(pid: int) -> bool:
    """The process exists and is no zombie (a zombie has ended; only its parent has not looked)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_gone(pid: int, timeout: float = 10) -> bool:
    """Wait until the process has ended (at most `timeout` s, a bound for a failing test); True
    when it has. Any process, not only a child of ours."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ended, _, _ = select.select([fd], [], [], timeout)
        return bool(ended) or not running(pid)
    finally:
        os.close(fd)
