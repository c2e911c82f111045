"""One reconcile of a host at a time, across processes and controllers: a lock on the host.

The lock is `flock` on /var/lib/reconciler/.lock, held by a process the run starts on the host
over its own SSH connection and keeps for the whole host run, from observe to verdict. It
ends, and the lock with it, when the run closes it, when the connection drops (the process
reads EOF), or when the controller goes silent: the run writes a heartbeat line every few
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
import contextlib
import os
import shlex
import socket
import time

from ..errors import HostError
from ..plan.confirm import arm_pending
from ..plan.facts import LOCK, LOCK_COUNT, LOCK_OWNER, STATE_DIR, count_holder
from ..shell import ShCommand
from .session import HostSession, SessionTransport, loop_script
from .transport import Spawned, StreamSpawned, Transport

OWNER = LOCK_OWNER
COUNT = LOCK_COUNT
IDLE = 30            # seconds without a heartbeat before the holder lets go
HEARTBEAT = 5.0      # seconds between heartbeats
WAIT = 30.0          # default: how long a run waits for another run's lock


class LockedError(HostError):
    """Another run holds the host's lock (reason Locked, exit 4; nothing was changed there)."""

    reason = "Locked"


def holder_command(wait: float, owner: str, then: str = "", since: str | None = None) -> str:
    """The shell that takes the lock (waiting at most `wait` s), counts itself (COUNT), says
    LOCKED (`LOCKED bash` where bash runs its loop; `... same` when the count was still
    `since`), runs `then` unless it said same (a command whose output the run reads under the
    lock: its observation, in the same round trip), and keeps the lock while heartbeats
    arrive; it prints BUSY and the owner's line when the wait runs out.

    Where bash exists, the holder then runs the run's commands too (session.py: one shell for
    the whole host run, no SSH channel per command) and reads the heartbeats with bash's
    `read -t`; a host without bash reads each heartbeat with `timeout head` (two processes
    every HEARTBEAT seconds), and the run opens a channel per command."""
    # An sh command (the observation) runs as a subshell of the holder's own sh, not a new sh
    run = then.subshell() if isinstance(then, ShCommand) else then
    first = f"[ -n \"$s\" ] || {{ {run}; }} </dev/null 2>/dev/null; " if then else ""
    same = f"[ \"$g\" != {since} ] || s=same; " if since is not None and since.isdigit() else ""
    # As it lets go, the holder empties the owner file and arms the dead-man's switch of every
    # deploy that got no verdict (confirm.arm_pending: none, and no process, after a verdict):
    # the controller went (EOF), was killed or cut off (a signal, or silence for IDLE seconds).
    last = f": > {OWNER}; {arm_pending()}"
    plain = (f"trap {shlex.quote(last + '; exit 129')} HUP TERM PIPE; "
             f"while line=$(timeout {IDLE} head -n 1) && [ -n \"$line\" ]; do :; done; {last}")
    loop = shlex.quote(loop_script(IDLE, last))
    # The login shell holds the lock itself (flock on its fd 9) and, where it is bash, runs the
    # loop too: two processes (the shell, flock) where `flock FILE sh -c ...` then `bash -c`
    # took four. The owner file is emptied, not removed, when it lets go (no `rm` process): a
    # look reads an empty one as no holder.
    keep = (f"{count_holder(COUNT)}; s=; {same}"
            f"printf '%s\\n' {shlex.quote(owner)} > {OWNER}; b=; command -v bash >/dev/null 2>&1 && b=bash; "
            f"echo LOCKED $b $s; {first}"
            f"if [ -z \"$b\" ]; then {plain}; elif [ -n \"${{BASH_VERSION:-}}\" ]; then eval {loop}; "
            f"else bash -c {loop}; fi; : > {OWNER}")
    return (f"{{ [ -d {STATE_DIR} ] || mkdir -p {STATE_DIR}; }} && exec 9>>{LOCK} && "
            f"if flock -w {int(wait)} 9; then {keep}; "
            f"else echo BUSY; cat {OWNER} 2>/dev/null; fi")


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


async def acquire(t: Transport, *, wait: float = WAIT, then: tuple[str, str] | None = None,
                  then_timeout: float = 30.0, since: str | None = None) -> HostLock:
    """Take the host's lock, waiting at most `wait` seconds; raise LockedError when another
    run keeps it that long.

    then: (command, last line) to run on the host once the lock is held, its output read up to
    and including that line (HostLock.output; None if it did not come within then_timeout).
    since: the lock's count as a look saw it; when it has not moved, `then` is not run
    (HostLock.same)."""
    proc = await t.spawn(holder_command(wait, owner_line(), then[0] if then else "", since))
    try:
        first = await asyncio.wait_for(proc.readline(), wait + 15)
    except TimeoutError:
        first = ""
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
            who = (await asyncio.wait_for(proc.readline(), 5)).strip()
    await proc.close()
    holder = f" (held by {who})" if who else ""
    raise LockedError(t.host, f"another reconcile holds {LOCK} on this host{holder}; waited {wait:.0f}s, "
                              f"changed nothing here")


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
