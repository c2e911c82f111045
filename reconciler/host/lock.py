"""One reconcile of a host at a time, across processes and controllers: a lock on the host.

The lock is `flock` on /var/lib/reconciler/.lock, held by a program the run starts on the host
(reconciler/sh/holder.sh, with its command loop session.sh: real shell files, installed once per
host by content under /var/lib/reconciler/bin and started by path, so the command line holds
nothing but paths and short words) over its own SSH connection and keeps for the whole host
run, from observe to verdict. It ends, and the lock with it, when the run closes it, when the
connection drops (the process reads EOF), or when the controller goes silent: the run writes a heartbeat line every few
seconds, and the holder gives up after IDLE seconds without one (a controller that was
partitioned away, whose connection the host has not noticed yet, never blocks later runs
for long). While it holds the lock it keeps who it is in /var/lib/reconciler/.lock.owner, so
a run that waits in vain can say who holds it. Once it holds the lock it can run one command
first (`acquire(then=...)`): the run's observation under the lock, in the same round trip;
then, where the host has bash, it runs the run's commands too (session.py; HostLock.over).

As it lets go (EOF, a signal, IDLE seconds of silence), the holder arms the dead-man's switch of
every deploy on the host that got no verdict (confirm.py): the holder lives exactly as long as
the controller's hold on the host, so a deploy that is confirmed never arms a timer at all.

Every holder (this one, and the dead-man's switch: confirm.py) counts itself in
/var/lib/reconciler/.lock.count before it changes anything. A run that looked at the host
before it asked for the lock passes the count it saw (`acquire(since=...)`): when the holder
finds it unmoved, no other run held the lock since the look, and the look stands (the holder
says LOCKED ... same and skips the observation: one `systemctl show` fewer per host).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import secrets
import socket
import time
from collections.abc import Mapping
from typing import Any, ClassVar

from .. import redact, shell
from ..errors import HostError
from ..frames import HostProgram, Param, Records, number
from ..plan import confirm
from ..plan.layout import BIN, LOCK, LOCK_COUNT, LOCK_OWNER, TEMP
from ..reasons import Reason
from . import programs
from .session import HostSession, SessionTransport
from .transport import Spawned, StreamSpawned, Transport

IDLE = 30            # seconds without a heartbeat before the holder lets go
HEARTBEAT = 5.0      # seconds between heartbeats
WAIT = 30.0          # default: how long a run waits for another run's lock


class LockedError(HostError):
    """Another run holds the host's lock (reason Locked, exit 4; nothing was changed there)."""

    reason = Reason.LOCKED


PARAMS = HostProgram.fragments        # holder.sh and launch.sh read their parameters as the programs do


def holder_constants() -> Mapping[str, str]:
    """What holder.sh shares with the Python side (plan/layout.py, this module's IDLE)."""
    return {"LOCK": LOCK, "COUNT": LOCK_COUNT, "OWNER": LOCK_OWNER, "CONFIRM": confirm.CONFIRM_DIR,
            "REARM": confirm.REARM_SCRIPT, "IDLE": str(IDLE)}


def installed_texts(then: HostProgram[Any] | None = None) -> list[str]:
    """The programs a lock installs on a host, as they are installed: the holder (its constants
    in front), its command loop, and the program it runs first."""
    texts = [shell.with_constants(shell.with_fragments(shell.program("holder"), PARAMS), holder_constants()),
             shell.program("session")]
    return texts + ([then.text()] if then is not None else [])


def installed_as(text: str) -> str:
    """Where a program lives on the host once installed: named by its content."""
    return f"{BIN}/{shell.digest(text)}.sh"


def holder_stdin(token: str, wait: float, owner: str, then: HostProgram[Any] | None = None,
                 then_token: str = "", since: str | None = None) -> str:
    """What the lock's launcher (sh/launch.sh), then the holder (sh/holder.sh), then `then`
    read on stdin, in that order: each its named parameters. `then`: a program the holder runs
    once it holds the lock (the observation under the lock, in the same round trip), installed
    by content too. The command line holds nothing of it (`ps` shows the launcher alone)."""
    holder, session, *first = [installed_as(x) for x in installed_texts(then)]
    launch = shell.param_lines({"token": token, "need": [holder, session, *first], "run": holder})
    held = shell.param_lines({"token": token, "wait": str(int(wait)), "owner": owner, "session": session,
                              "since": since if since is not None and number(since) is not None else None,
                              "then": first[0] if first else None})
    return launch + held + (then.stdin(then_token) if then is not None else "")


def launch_text() -> str:
    """sh/launch.sh as it is sent: it reads its parameters as the programs do."""
    return shell.with_fragments(shell.program("launch"), PARAMS)


def launch_command() -> str:
    """The command line that starts the installed holder: sh/launch.sh's text."""
    return shell.sh_c(launch_text(), "reconciler-lock")


class Install(HostProgram[tuple[str, ...]], frozen=True):
    """reconciler/sh/install.sh: the given program texts installed under BIN by content (root's
    alone, each written atomically), the ones no longer given removed. Its answer: the names it
    installed; an answer cut short (a failed write) is an ObserveError."""

    name: ClassVar[str] = "install"
    texts: tuple[str, ...]

    @classmethod
    def text(cls) -> str:
        """install.sh with its constants: BIN (this module's, as installed_as names the programs
        by it) and the temp files' prefix."""
        return shell.with_constants(shell.with_fragments(shell.program(cls.name), cls.fragments),
                                    {"BIN": BIN, "TEMP": TEMP})

    def params(self) -> Mapping[str, Param]:
        return {"file": [f"{shell.digest(x)}.sh {base64.b64encode(x.encode()).decode()}" for x in self.texts]}

    def parse(self, answer: Records) -> tuple[str, ...]:
        return tuple(f.payload for f in answer.whole("the lock holder's programs were not all installed")
                     if f.kind == "I")


async def install(t: Transport, then: HostProgram[Any] | None = None) -> None:
    """Install the holder, its command loop and `then`'s program on the host (the first run of
    a release on a host: one round trip more)."""
    await programs.run(t, Install(tuple(installed_texts(then))), timeout=30, what="install the lock holder")


def owner_line() -> str:
    """Who this run is, for the host's owner file (no secrets: host name, PID, start time)."""
    return f"reconcile on {socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"


class HostLock:
    """The held lock of one host; release() lets go (closing the connection does too).

    `answer`: what the program run under the lock answered (acquire's `then`), or None when it
    was not asked for, did not end within its time, or was not run: `same` says that (the count
    was still acquire's `since`). `session`: the holder's command loop, where it runs one
    (over(t) sends the run's commands through it)."""

    def __init__(self, proc: Spawned, answer: Records | None = None, session: HostSession | None = None,
                 same: bool = False):
        self.proc, self.answer, self.session, self.same = proc, answer, session, same
        self.beat = asyncio.create_task(self._heartbeat())

    def over(self, t: Transport) -> Transport:
        """t, its commands run by the holder while it is free (t itself without a session)."""
        return SessionTransport(t, self.session) if self.session is not None else t

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT)
            try:
                self.proc.write(".\n")
            except (OSError, ConnectionError, RuntimeError):
                return

    async def release(self) -> None:
        self.beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.beat
        with contextlib.suppress(OSError, ConnectionError):
            await self.proc.close()


async def acquire(t: Transport, *, wait: float = WAIT, then: HostProgram[Any] | None = None,
                  then_timeout: float = 30.0, since: str | None = None) -> HostLock:
    """Take the host's lock, waiting at most `wait` seconds; raise LockedError when another
    run keeps it that long.

    then: a program to run on the host once the lock is held, its answer read through its END
    record (HostLock.answer; None if it did not come within then_timeout). since: the lock's
    count as a look saw it; when it has not moved, `then` is not run (HostLock.same). The
    holder's programs are installed first where they are missing."""
    token, then_token = secrets.token_hex(8), secrets.token_hex(8)
    stdin = holder_stdin(token, wait, owner_line(), then, then_token, since)

    async def start() -> tuple[Spawned, list[str]]:
        proc = await t.spawn(launch_command())
        proc.write(stdin)
        return proc, await _said(proc, token, wait)
    proc, words = await start()
    if words[:1] == ["MISSING"]:
        await proc.close()
        await install(t, then)
        proc, words = await start()
    if words[:1] == ["LOCKED"]:       # LOCKED [bash] [same]: bash runs the session loop; same: see since
        answer = None
        same = "same" in words[1:]
        if then is not None and not same:
            with contextlib.suppress(TimeoutError):
                out = await asyncio.wait_for(_read_through(proc, f"{then_token} END"), then_timeout)
                answer = Records(out, then_token, t.host) if out is not None else None
        # The session only when the holder's output was read whole: what is left unread would
        # pass for a command's
        whole = then is None or answer is not None or same
        looping = "bash" in words[1:] and whole
        session = HostSession(t.host, proc, token) if looping and isinstance(proc, StreamSpawned) else None
        return HostLock(proc, answer, session, same)
    who = holder_said(" ".join(words[1:])) if words[:1] == ["BUSY"] else ""
    await proc.close()
    holder = f" (held by {who})" if who else ""
    raise LockedError(t.host, f"another reconcile holds {LOCK} on this host{holder}; waited {wait:.0f}s, "
                              f"changed nothing here")


OWNER_MAX = 200        # characters of the owner file's line a Locked message quotes


def holder_said(line: str) -> str:
    """Who holds the lock, as the busy holder read it from the owner file (any text there: another
    run's owner_line, or whatever was written): redacted, then cut."""
    return redact.clip(line.strip(), OWNER_MAX)


async def _said(proc: Spawned, token: str, wait: float) -> list[str]:
    """What the launcher or the holder says first, its record's words after the token
    (MISSING; BUSY and who; LOCKED and how): [] when it says nothing of the kind in time. A
    line without the token (a login banner) is not its."""
    async def first() -> list[str]:
        while line := await proc.readline():
            words = line.split()
            if words[:1] == [token]:
                return words[1:]
        return []
    try:
        return await asyncio.wait_for(first(), wait + 15)
    except TimeoutError:
        return []


async def _read_through(proc: Spawned, last: str) -> str | None:
    """Lines up to and including `last` (None: the output ended before it): in one read where the
    output can be read up to a separator (not a line at a time: the observation is dozens)."""
    lines: list[str] = []
    if isinstance(proc, StreamSpawned):
        try:
            got = await proc.readuntil(f"{last}\n")
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            return None
        if got == f"{last}\n" or got.endswith(f"\n{last}\n"):
            return got
        lines.append(got)         # `last` ended another line: not the end, read on
    while line := await proc.readline():
        lines.append(line)
        if line.rstrip("\n") == last:
            return "".join(lines)
    return None
