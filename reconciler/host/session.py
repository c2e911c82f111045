"""One shell per host run: the commands of a locked run go through the lock holder's own shell
(its command loop is reconciler/sh/session.sh; this is the controller's end of it).

A channel per command (pre-flight, apply, each health reading, each verdict) would cost the
host's sshd a session and a login shell (`bash -c`) each, and the run a round trip to open it.
Once the holder (lock.py) holds the lock and has read the host, it becomes this loop (bash): it
reads frames from the run on its stdin and runs each command in the background, so it goes on
reading heartbeats while a command runs (a model fetch or a GPU wait may take many minutes) and
still lets go of the lock IDLE seconds after the run went silent.

    R <token> <command bytes> <input bytes, or ->     then the command, then its input
    F ...                                             as R: a standing session's read, in its shell
    K                                                 kill the running command (a time-out)
    .                                                 heartbeat
    (empty line, EOF, or IDLE s of silence)           kill any running command, let go

A command's stdout and stderr go to the channel's own streams, each ended by its token's END
record (frames.py), right after the command's last byte, on stdout with the exit status: `TOKEN
END STATUS`. Nothing is parsed from the command's output, and output of another command never
passes for it. The command text and its input travel on the channel, never on a command line
(`ps` would show it to every user), and no file holds them. The command runs as it would in its
own channel: `sh -c ...` or `sh -s` with its input on stdin, in a process group of its own (so a
kill reaches all of it).

A program marked `in_session` (the observation: shell.ShScript) runs in the session's bash
itself, with no sh of its own (a process fewer, and bash reads a file's lines in blocks where
dash reads a byte per call); a standing session runs it in the loop's own shell, in the
foreground (an `F` frame): see docs/architecture.md, "Where a program runs".

One command at a time: while one runs (the health watches of several services run at once),
another goes through a channel of its own. A host without bash, a holder that did not come back
whole, a command that timed out (killed, its output unread): the session is left and every
later command has its own channel.

A *standing* session (`standing_command`: the same loop with no lock) is the warm daemon's, one
on each kept connection (host/pool.py). One that never says READY (no bash on the host) leaves
its commands to their own channels.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shlex

from .. import frames, shell
from ..errors import CommandError, ConnectError
from .transport import Completed, Spawned, StreamSpawned, Transport, checked


class _NotSent(Exception):
    """The frame could not be written: the command did not start (run it on its own channel)."""


class HostSession:
    """The controller's end of the holder's command loop."""

    def __init__(self, host: str, proc: StreamSpawned, token: str, *, standing: bool = False):
        self.host, self.proc, self.token = host, proc, token
        self.busy = False
        self.broken = False
        # standing: a session of its own (no lock) that may never come up (no bash on the host):
        # its first command then goes to a channel of its own
        self.standing = standing
        self.came_up = False
        # A command's token is the holder's (`token`), then the command's own: the ends are
        # looked for by the holder's part, the same text for every command (the SSH end compiles
        # each text it reads up to once: transport._SSHSpawned).
        self._prefix = token + ":"

    def takes(self, cmd: str, input: str | None) -> bool:
        """Whether this command can go through the session now (bash reads no NUL byte)."""
        return not (self.busy or self.broken or "\0" in cmd or (input is not None and "\0" in input))

    async def run(self, cmd: str, *, input: str | None, timeout: float | None, what: str) -> Completed:
        tok = self._prefix + secrets.token_hex(8)
        # a program's text: this bash runs it itself (F: a standing session's read, in its own shell)
        kind = "F" if self.standing and isinstance(cmd, shell.ShScript) else "R"
        if isinstance(cmd, shell.ShScript):
            cmd = cmd.script
        size = len(cmd.encode())
        more = "-" if input is None else str(len(input.encode()))
        self.busy = True
        try:
            try:
                self.proc.write(f"{kind} {tok} {size} {more}\n{cmd}{input or ''}")
            except (OSError, RuntimeError):
                self.broken = True
                raise _NotSent() from None
            try:
                async with asyncio.timeout(timeout):        # in this task: wait_for would make one more
                    out, err = await self._collect(tok)
            except TimeoutError:
                self._abandon()
                raise CommandError(self.host, what, None, f"timed out after {timeout}s") from None
            except (asyncio.IncompleteReadError, OSError) as e:    # ConnectionError is an OSError
                self.broken = True
                why = "" if isinstance(e, asyncio.IncompleteReadError) or not str(e) else f": {e}"
                raise ConnectError(self.host, f"connection lost during {what}{why}") from None
            except BaseException:
                self._abandon()
                raise
        finally:
            self.busy = False
        return ended(out, tok, err)

    async def _collect(self, tok: str) -> tuple[str, str]:
        if not self.came_up:            # whatever the holder wrote to stderr before its loop
            try:
                await self.proc.readuntil(f"{self.token} READY\n", stderr=True)
            except (asyncio.IncompleteReadError, OSError):
                if not self.standing:
                    raise
                self.broken = True      # never came up: nothing ran the command
                raise _NotSent() from None
            self.came_up = True
        own = tok[len(self._prefix):]
        # stderr read meanwhile (a command may write much there before its last stdout byte), in
        # a task of its own; stdout in this one
        errs = asyncio.get_running_loop().create_task(self._until(f"{own} END\n", stderr=True))
        try:
            out = await self._until(f"{own} END ")
            err = await errs
        finally:
            if not errs.done():
                errs.cancel()
            elif not errs.cancelled():
                errs.exception()        # seen: the connection's end, which stdout's read raised too
        return out, err[: -len(f"{tok} END\n")]

    async def _until(self, own: str, *, stderr: bool = False) -> str:
        """The stream up to and including the command's END record: the holder's part of the
        token, then `own` (the command's part, END, and on stdout the exit status, up to the
        line's end). An END record with another token is output like any other line."""
        got = ""
        while True:
            got += await self.proc.readuntil(self._prefix, stderr=stderr)
            got += (line := await self.proc.readuntil("\n", stderr=stderr))
            if line.startswith(own):
                return got

    def _abandon(self) -> None:
        """Kill the running command; its output may still come, so the session is done."""
        self.broken = True
        with contextlib.suppress(OSError, RuntimeError):
            self.proc.write("K\n")


def standing_command(idle: float) -> str:
    """The command line of a standing session: session.sh in bash, with no lock (nothing to let
    go), ending after `idle` seconds of silence; where the host has no bash, it ends at once. Its
    token is the first line on its stdin (`standing_input`), not on the command line."""
    loop = f"IFS= read -r T\nIDLE={int(idle)}\nlet_go() {{ :; }}\n" + shell.program("session")
    return f"command -v bash >/dev/null && exec bash -c {shlex.quote(loop)} reconciler-session"


def standing_input(token: str) -> str:
    """What a standing session reads first: its token."""
    return token + "\n"


async def stand(t: Transport, idle: float) -> HostSession | None:
    """A standing session on this connection (its first command waits for it to come up), or
    None where it cannot start (the connection is gone: the caller's next command finds that)."""
    token = secrets.token_hex(8)
    try:
        proc = await t.spawn(standing_command(idle))
    except ConnectError:
        return None
    if not isinstance(proc, StreamSpawned):
        await proc.close()
        return None
    with contextlib.suppress(OSError, RuntimeError):   # a write that fails: it never comes up
        proc.write(standing_input(token))
    return HostSession(t.host, proc, token, standing=True)


def ended(out: str, tok: str, err: str) -> Completed:
    """A command's result from what the session read of it (pure): stdout up to its END record
    (`TOKEN END STATUS`, read by frames.ended), and the exit status that record says; 255 (as
    ssh's own for a command it could not run) where it says no status of 0-255."""
    body, code = frames.ended(out, tok)
    return Completed(code if code is not None else 255, body, err)


class SessionTransport:
    """A transport whose commands go through the host session when it is free."""

    def __init__(self, t: Transport, session: HostSession):
        self.t, self.session = t, session
        self.host = t.host

    async def run(self, cmd: str, *, input: str | None = None, check: bool = False,
                  timeout: float | None = 60.0, what: str = "command") -> Completed:
        if self.session.takes(cmd, input):
            with contextlib.suppress(_NotSent):
                res = await self.session.run(cmd, input=input, timeout=timeout, what=what)
                return checked(self.host, res, check, what)
        return await self.t.run(cmd, input=input, check=check, timeout=timeout, what=what)

    async def open_connection(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await self.t.open_connection(host, port)

    async def spawn(self, cmd: str) -> Spawned:
        return await self.t.spawn(cmd)

    async def close(self) -> None:
        await self.t.close()
