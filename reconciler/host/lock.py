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
import shlex
import socket
import time

from .. import redact, shell
from ..errors import HostError
from ..frames import number
from ..plan.facts import LOCK, LOCK_COUNT, LOCK_OWNER, STATE_DIR
from ..reasons import Reason
from ..shell import ShCommand
from .session import HostSession, SessionTransport
from .transport import Spawned, StreamSpawned, Transport

OWNER = LOCK_OWNER
COUNT = LOCK_COUNT
IDLE = 30            # seconds without a heartbeat before the holder lets go
HEARTBEAT = 5.0      # seconds between heartbeats
WAIT = 30.0          # default: how long a run waits for another run's lock


class LockedError(HostError):
    """Another run holds the host's lock (reason Locked, exit 4; nothing was changed there)."""

    reason = Reason.LOCKED


BIN = f"{STATE_DIR}/bin"      # the holder's programs, by content (root's own directory)


def installed_as(text: str) -> str:
    """Where a program lives on the host once installed: named by its content."""
    return f"{BIN}/{shell.digest(text)}.sh"


def holder_command(wait: float, owner: str, then: ShCommand | None = None, since: str | None = None) -> str:
    """The command line that starts the installed holder (reconciler/sh/holder.sh) with its
    arguments, in bash where the host has it (the holder then runs the run's command loop,
    session.sh, in its own shell), else in sh; it says MISSING where the holder (or `then`'s
    program) is not installed yet. `then`: a program the holder runs once it holds the lock (the
    observation under the lock, in the same round trip), its own program installed by content
    too. Nothing but paths and short words on the command line (`ps` shows no program)."""
    holder, session = installed_as(shell.program("holder")), installed_as(shell.program("session"))
    want = [holder, session] + ([installed_as(then.script)] if then is not None else [])
    args = [str(int(wait)), since if since is not None and number(since) is not None else "", owner, session]
    if then is not None:
        args += [installed_as(then.script), *then.args]
    words = " ".join(shlex.quote(a) for a in args)
    present = " && ".join(f"[ -f {shlex.quote(w)} ]" for w in want)
    return (f"if {present}; then if command -v bash >/dev/null 2>&1; then exec bash {shlex.quote(holder)} {words}; "
            f"else exec sh {shlex.quote(holder)} {words}; fi; else echo MISSING; fi")


def install_script(programs: list[str]) -> str:
    """sh that installs programs by content under BIN (root-only, each written atomically) and
    removes the ones no longer used (an older release's)."""
    keep = " ".join(shlex.quote(shell.digest(text) + ".sh") for text in programs)
    lines = ["set -e", "umask 077", f"mkdir -p {BIN}", f"chmod 0700 {BIN}",
             f'for f in {BIN}/*.sh; do [ -e "$f" ] || continue; case " {keep} " in *" ${{f##*/}} "*) ;; '
             f'*) rm -f "$f" ;; esac; done']
    for text in programs:
        blob = base64.b64encode(text.encode()).decode()
        lines.append(f't=$(mktemp {BIN}/.reconciler-tmp.XXXXXX); printf %s {blob} | base64 -d > "$t"; '
                     f'mv -f "$t" {shlex.quote(installed_as(text))}')
    return "\n".join(lines) + "\n"


async def install(t: Transport, then: ShCommand | None = None) -> None:
    """Install the holder, its command loop and `then`'s program on the host (the first run of
    a release on a host: one round trip more)."""
    programs = [shell.program("holder"), shell.program("session")] + ([then.script] if then is not None else [])
    await t.run("sh -s", input=install_script(programs), check=True, timeout=30, what="install the lock holder")


def owner_line() -> str:
    """Who this run is, for the host's owner file (no secrets: host name, PID, start time)."""
    return f"reconcile on {socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"


class HostLock:
    """The held lock of one host; release() lets go (closing the connection does too).

    `output`: what the command run under the lock printed (acquire's `then`), or None when it
    was not asked for, did not end within its time, or was not run: `same` says that (the count
    was still acquire's `since`). `session`: the holder's command loop, where it runs one
    (over(t) sends the run's commands through it)."""

    def __init__(self, proc: Spawned, output: str | None = None, session: HostSession | None = None,
                 same: bool = False):
        self.proc, self.output, self.session, self.same = proc, output, session, same
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


async def acquire(t: Transport, *, wait: float = WAIT, then: tuple[ShCommand, str] | None = None,
                  then_timeout: float = 30.0, since: str | None = None) -> HostLock:
    """Take the host's lock, waiting at most `wait` seconds; raise LockedError when another
    run keeps it that long.

    then: (program, last line) to run on the host once the lock is held, its output read up to
    and including that line (HostLock.output; None if it did not come within then_timeout).
    since: the lock's count as a look saw it; when it has not moved, `then` is not run
    (HostLock.same). The holder's programs are installed first where they are missing."""
    program_then = then[0] if then is not None else None
    command = holder_command(wait, owner_line(), program_then, since)
    proc = await t.spawn(command)
    first = await _first_line(proc, wait)
    if first.strip() == "MISSING":
        await proc.close()
        await install(t, program_then)
        proc = await t.spawn(command)
        first = await _first_line(proc, wait)
    words = first.split()       # LOCKED [bash] [same]: bash runs the session loop; same: see since
    if words[:1] == ["LOCKED"]:
        output = None
        same = "same" in words[1:]
        if then is not None and not same:
            with contextlib.suppress(TimeoutError):
                output = await asyncio.wait_for(_read_through(proc, then[1]), then_timeout)
        # The session only when the holder's output was read whole: what is left unread would
        # pass for a command's
        whole = then is None or output is not None or same
        looping = "bash" in words[1:] and whole
        session = HostSession(t.host, proc) if looping and isinstance(proc, StreamSpawned) else None
        return HostLock(proc, output, session, same)
    who = ""
    if first.strip() == "BUSY":
        with contextlib.suppress(TimeoutError):
            who = holder_said(await asyncio.wait_for(proc.readline(), 5))
    await proc.close()
    holder = f" (held by {who})" if who else ""
    raise LockedError(t.host, f"another reconcile holds {LOCK} on this host{holder}; waited {wait:.0f}s, "
                              f"changed nothing here")


OWNER_MAX = 200        # characters of the owner file's line a Locked message quotes


def holder_said(line: str) -> str:
    """Who holds the lock, as the busy holder read it from the owner file (any text there: another
    run's owner_line, or whatever was written): redacted, then cut."""
    return redact.clip(line.strip(), OWNER_MAX)


async def _first_line(proc: Spawned, wait: float) -> str:
    try:
        return await asyncio.wait_for(proc.readline(), wait + 15)
    except TimeoutError:
        return ""


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
