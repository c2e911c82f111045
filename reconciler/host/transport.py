"""The one narrow interface through which the reconciler touches a host.

`Transport.run(cmd, input=..., timeout=...) -> Completed` (asyncssh's own shape) plus
`open_connection(host, port)` for HTTP health probes through the same connection, and
`spawn(cmd)` for a process that lives as long as the run (the host lock's holder). Every other
module talks to this interface, never to asyncssh directly.

Two implementations: `SSHTransport` (asyncssh; one connection per host, reused for the whole
run; host keys verified strictly; agent forwarding off) and `LocalTransport` (a local shell,
for a machine without sshd, such as the GPU check host, and for `reconcile pull`: a host that
reconciles itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

from ..desired.spec import SSHSpec
from ..errors import CommandError, ConnectError, HostKeyError

if TYPE_CHECKING:
    import asyncssh


class Completed(msgspec.Struct, frozen=True):
    """The result of one command on a host."""

    exit_status: int | None
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_status == 0


class Transport(Protocol):
    """What the reconciler needs from a connection to a host."""

    host: str

    async def run(self, cmd: str, *, input: str | None = None, check: bool = False,
                  timeout: float | None = 60.0, what: str = "command") -> Completed:
        """Run a shell command on the host; with check=True raise CommandError on non-zero."""
        ...

    async def open_connection(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A byte stream to host:port as seen from the host itself."""
        ...

    async def spawn(self, cmd: str) -> Spawned:
        """Start a long-lived command on the host; it ends when closed or when the connection drops."""
        ...

    async def close(self) -> None:
        ...


class Spawned(Protocol):
    """A command running on the host: lines out, lines in, and an end."""

    async def readline(self) -> str:
        """The next line of its output ('' at its end)."""
        ...

    def write(self, data: str) -> None:
        ...

    async def close(self) -> None:
        ...


@runtime_checkable
class StreamSpawned(Spawned, Protocol):
    """A spawned command whose stdout and stderr can each be read up to a separator (the host
    session's framing, session.py)."""

    async def readuntil(self, separator: str, *, stderr: bool = False) -> str:
        """Up to and including separator; asyncio.IncompleteReadError at the end."""
        ...


KEEPALIVE = 5.0
KEEPALIVE_COUNT = 3
# The longest a vanished peer goes unnoticed: keepalives go out after KEEPALIVE s of silence and
# the connection closes when KEEPALIVE_COUNT of them are unanswered. A command whose time-out is
# shorter can time out on a connection that is gone (its failure then is the command's, not the
# connection's): the health watch's reads wait longer.
LOST_AFTER = KEEPALIVE * (KEEPALIVE_COUNT + 1)
# AES-GCM first: as strong as asyncssh's default chacha20-poly1305, and far cheaper per packet in
# asyncssh (one AESGCM object per connection and AES-NI, where its chacha20 builds a cipher
# context per packet: a quarter of a warm 100-host round's controller CPU went there). The rest
# of asyncssh's defaults follow, for sshds that offer no GCM.
CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "chacha20-poly1305@openssh.com",
           "aes256-ctr", "aes192-ctr", "aes128-ctr")


def checked(host: str, res: Completed, check: bool, what: str) -> Completed:
    if check and not res.ok:
        raise CommandError(host, what, res.exit_status, res.stderr)
    return res


async def close_quietly(t: Transport) -> None:
    """Close `t`; a connection that already broke has nothing left to close."""
    with contextlib.suppress(Exception):
        await t.close()


def known_hosts_for(spec: SSHSpec) -> asyncssh.SSHKnownHosts:
    """Trusted keys for one host: its pinned host_key, else the fleet's known_hosts text.

    There is no trust on first use: with neither, every key is unknown and the host fails.
    """
    if spec.host_key:
        pattern = spec.address if spec.port == 22 else f"[{spec.address}]:{spec.port}"
        return _parsed(f"{pattern} {spec.host_key}\n")
    return _parsed(spec.known_hosts or "")


@functools.lru_cache(maxsize=4)
def _parsed(text: str) -> asyncssh.SSHKnownHosts:
    """The fleet's known_hosts, parsed once per text: every host shares the one file, and
    parsing it for each connection made a 1,000-host run quadratic (1,000 parses of 1,000 lines)."""
    import asyncssh  # imported by connect(), its one caller: a run that never connects skips it
    return asyncssh.import_known_hosts(text)


class SSHTransport:
    """One asyncssh connection to one host, reused for every command of a run."""

    def __init__(self, host: str, conn: asyncssh.SSHClientConnection):
        self.host = host
        self._conn = conn

    @classmethod
    async def connect(cls, host: str, spec: SSHSpec, *, identity: str | None = None,
                      connect_timeout: float = 10.0) -> SSHTransport:
        """Connect and verify the host key strictly; map failures to ConnectError/HostKeyError."""
        import asyncssh  # here, not at the top: a run that never connects (or a local one) skips it
        keys = identity or os.environ.get("RECONCILER_IDENTITY")     # --identity, else ssh's defaults
        kwargs: dict = dict(
            port=spec.port, username=spec.user, known_hosts=known_hosts_for(spec),
            agent_forwarding=False, config=[], connect_timeout=connect_timeout,
            x11_forwarding=False,
            # A peer that vanished without a RST (a partition, a frozen host) is found within
            # KEEPALIVE * KEEPALIVE_COUNT seconds: every command on the connection then fails.
            keepalive_interval=KEEPALIVE, keepalive_count_max=KEEPALIVE_COUNT,
            encryption_algs=CIPHERS,
        )
        if keys:
            kwargs["client_keys"] = [str(Path(keys).expanduser())]
            kwargs["agent_path"] = None
        where = f"{spec.user}@{spec.address}:{spec.port}"
        try:
            conn = await asyncssh.connect(spec.address, **kwargs)
        except asyncssh.HostKeyNotVerifiable as e:
            src = "pinned ssh.host_key" if spec.host_key else (spec.known_hosts_file or "no known_hosts file")
            raise HostKeyError(host, f"host key of {spec.address}:{spec.port} is unknown or has changed "
                                     f"(checked against {src}): {e.reason}. If the host was reinstalled, "
                                     f"enroll its new key (see desired-state/README.md).") from None
        except asyncssh.PermissionDenied as e:
            raise ConnectError(host, f"{where}: authentication failed ({e.reason})") from None
        except (TimeoutError, OSError, asyncssh.Error) as e:
            msg = getattr(e, "reason", None) or str(e) or type(e).__name__
            raise ConnectError(host, f"{where}: cannot connect: {msg}") from None
        return cls(host, conn)

    async def run(self, cmd: str, *, input: str | None = None, check: bool = False,
                  timeout: float | None = 60.0, what: str = "command") -> Completed:
        import asyncssh
        try:
            r = await self._conn.run(cmd, input=input, check=False, timeout=timeout)
        except asyncssh.TimeoutError as e:
            raise CommandError(self.host, what, None, f"timed out after {timeout}s: {_text(e.stderr)}") from None
        except (OSError, asyncssh.Error) as e:
            raise ConnectError(self.host, f"connection lost during {what}: {e}") from None
        if r.exit_status is None and r.exit_signal is None:
            # The channel closed with neither an exit status nor a signal: the connection went
            # (asyncssh returns rather than raises). Unreachable, like a loss anywhere else.
            raise ConnectError(self.host, f"connection lost during {what}")
        if r.exit_status is None and r.exit_signal is not None:
            raise CommandError(self.host, what, None, f"killed by signal {r.exit_signal[0]} on the host")
        res = Completed(r.exit_status, _text(r.stdout), _text(r.stderr))
        return checked(self.host, res, check, what)

    async def open_connection(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await self._conn.open_connection(host, port)  # type: ignore[return-value]

    async def spawn(self, cmd: str) -> Spawned:
        import asyncssh
        try:
            proc = await self._conn.create_process(cmd, errors="replace")
        except (OSError, asyncssh.Error) as e:
            raise ConnectError(self.host, f"connection lost starting {cmd.split()[0]}: {e}") from None
        return _SSHSpawned(proc)

    async def close(self) -> None:
        self._conn.close()
        with contextlib.suppress(TimeoutError, OSError):
            await asyncio.wait_for(self._conn.wait_closed(), 5)


class _SSHSpawned:
    def __init__(self, proc: asyncssh.SSHClientProcess[str]):
        self.proc = proc
        # asyncssh compiles a separator given as text to a regex at every read; a session reads
        # up to the same few texts all its life (session.py), and a daemon keeps a session a host
        # (more than Python's own cache of compiled regexes holds): each is compiled once here
        self._separators: dict[str, re.Pattern[str]] = {}

    async def readline(self) -> str:
        try:
            return await self.proc.stdout.readline()
        except (OSError, ConnectionError):
            return ""

    async def readuntil(self, separator: str, *, stderr: bool = False) -> str:
        import asyncssh
        try:
            if (pattern := self._separators.get(separator)) is None:
                pattern = self._separators[separator] = re.compile(re.escape(separator))
            return await (self.proc.stderr if stderr else self.proc.stdout).readuntil(pattern, len(separator))
        except asyncssh.Error as e:      # the connection went (keepalives unanswered, a reset)
            raise ConnectionError(e.reason or type(e).__name__) from None

    def write(self, data: str) -> None:
        self.proc.stdin.write(data)

    async def close(self) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            self.proc.stdin.write_eof()
        self.proc.close()


class _LocalSpawned:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    async def readline(self) -> str:
        assert self.proc.stdout is not None
        return (await self.proc.stdout.readline()).decode(errors="replace")

    def write(self, data: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data.encode())

    async def close(self) -> None:
        # End of input first, as an SSH channel's close gives it: the lock holder then ends its
        # own way (its owner file emptied, lock.py); terminated only if it does not end soon.
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        if self.proc.returncode is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 2)
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            await self.proc.wait()


async def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """Kill a local command and whatever it started (it leads its own process group)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(proc.wait(), 5)


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


class LocalTransport:
    """Runs commands on this machine through bash: for a machine without sshd (the GPU check
    host) and for a host that reconciles itself (`reconcile pull`); bash, the shell that runs
    them over SSH for root. A command that times out or is cancelled is killed with everything
    it started (its own process group)."""

    def __init__(self, host: str = "local"):
        self.host = host

    async def run(self, cmd: str, *, input: str | None = None, check: bool = False,
                  timeout: float | None = 60.0, what: str = "command") -> Completed:
        try:
            proc = await asyncio.create_subprocess_exec(
                "bash", "-c", cmd, stdin=asyncio.subprocess.PIPE if input is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        except OSError as e:
            raise ConnectError(self.host, f"cannot run {what} in a local shell: {e}") from None
        try:
            out, err = await asyncio.wait_for(proc.communicate(input.encode() if input is not None else None), timeout)
        except TimeoutError:
            await _kill_group(proc)
            raise CommandError(self.host, what, None, f"timed out after {timeout}s") from None
        except BaseException:
            await _kill_group(proc)
            raise
        res = Completed(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))
        return checked(self.host, res, check, what)

    async def open_connection(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(host, port)

    async def spawn(self, cmd: str) -> Spawned:
        proc = await asyncio.create_subprocess_exec("bash", "-c", cmd, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.DEVNULL)
        return _LocalSpawned(proc)

    async def close(self) -> None:
        return None
