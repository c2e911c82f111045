"""Real processes in unit tests: whether one runs, waiting for its end as an event (a pidfd
becomes readable when the process exits), not by sleeping and looking again, and a spawned
command over local pipes read as an SSH channel's is."""

from __future__ import annotations

import asyncio
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


class Piped:
    """A spawned command (a lock holder, a standing session) over local pipes, read as the SSH
    one is (transport.StreamSpawned)."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    async def readline(self) -> str:
        assert self.proc.stdout is not None
        return (await self.proc.stdout.readline()).decode()

    async def readuntil(self, separator: str, *, stderr: bool = False) -> str:
        stream = self.proc.stderr if stderr else self.proc.stdout
        assert stream is not None
        return (await stream.readuntil(separator.encode())).decode()

    def write(self, data: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data.encode())

    async def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        await self.proc.wait()
