"""The host session (session.py): the lock holder's own shell runs the run's commands.

The real holder (reconciler/sh/holder.sh, installed by lock.install as on a host) runs here
under /bin/sh with its lock and owner files in a temp dir, its stdin, stdout and stderr pipes
standing in for the SSH channel's: commands with and without input keep their output, stderr
and exit status apart; a command that times out is killed with all it started and the session
is left; a busy session sends the next command to a channel of its own; heartbeats keep the holder while a long command
runs, silence ends both; no command line on the machine shows a command's input."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from reconciler import shell
from reconciler.errors import CommandError
from reconciler.frames import HostProgram, Records
from reconciler.host import lock, programs
from reconciler.host.session import HostSession, SessionTransport, standing_command, standing_input
from reconciler.host.transport import Completed
from tests.host.procs import Piped, running, wait_gone
from tests.host.programs import local_programs

pytestmark = pytest.mark.timeout(30)


class _Channels:
    """The transport under the session: each command a `sh -c` of its own, counted."""

    host = "h1"

    def __init__(self) -> None:
        self.ran: list[str] = []

    async def run(self, cmd: str, *, input: str | None = None, check: bool = False,
                  timeout: float | None = 60.0, what: str = "command") -> Completed:
        self.ran.append(what)
        p = await asyncio.create_subprocess_exec("sh", "-c", cmd, stdin=asyncio.subprocess.PIPE,
                                                 stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await p.communicate(input.encode() if input is not None else None)
        return Completed(p.returncode, out.decode(), err.decode())

    async def spawn(self, cmd: str) -> Piped:
        p = await asyncio.create_subprocess_exec("sh", "-c", cmd, stdin=asyncio.subprocess.PIPE,
                                                 stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        return Piped(p)

    async def open_connection(self, host: str, port: int):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    async def close(self) -> None:
        return None


@pytest.fixture
def locked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A host (its state directory in tmp_path) where an earlier run installed the holder."""
    local_programs(monkeypatch, tmp_path)
    asyncio.run(lock.install(_Channels(), SEEN))
    return tmp_path


class Said(HostProgram[str], frozen=True):
    """A program that says what it is given (`say`), as the lock's first program: its parameters
    come after the holder's on stdin."""

    name = "test-said"
    say: str = "seen"

    @classmethod
    def text(cls) -> str:
        return ("#!/bin/sh\nwhile IFS= read -r l && [ -n \"$l\" ]; do case $l in token=*) T=${l#token=} ;; "
                "say=*) S=${l#say=} ;; esac; done\nprintf '%s S %s\\n%s END\\n' \"$T\" \"$S\" \"$T\"\n")

    def params(self) -> dict[str, str]:
        return {"say": self.say}

    def parse(self, answer: Records) -> str:
        return " ".join(f.payload for f in answer.whole("cut short"))


SEEN = Said()


async def _session(then: HostProgram[str] | None = SEEN) -> tuple[_Channels, lock.HostLock, SessionTransport]:
    ch = _Channels()
    held = await lock.acquire(ch, wait=1, then=then)  # type: ignore[arg-type]
    t = held.over(ch)  # type: ignore[arg-type]
    assert isinstance(t, SessionTransport)
    return ch, held, t


def test_commands_keep_their_output_stderr_and_status(locked: Path) -> None:
    async def go() -> None:
        ch, held, t = await _session()
        assert held.answer is not None and SEEN.parse(held.answer) == "seen"
        r = await t.run("echo out; echo err >&2; exit 3")
        assert (r.exit_status, r.stdout, r.stderr) == (3, "out\n", "err\n")
        r = await t.run("printf 'no newline'")           # output without a last newline stays exact
        assert (r.exit_status, r.stdout, r.stderr) == (0, "no newline", "")
        script = "set -u\nread -r a\nprintf '%s|%s\\n' \"$a\" \"$0\"\n"
        r = await t.run("sh -c 'read -r a; echo \"$a\"; cat'", input="héllo wörld\nrest\n")
        assert r.stdout == "héllo wörld\nrest\n"
        r = await t.run("sh -s", input=script.replace("read -r a", "a=1"))   # a script on stdin, as apply sends
        assert r.stdout == "1|sh\n"
        r = await t.run("sh -c 'echo \"$1\"' name 'it'\\''s'")
        assert r.stdout == "it's\n"
        assert ch.ran == []                            # all through the holder's shell
        with pytest.raises(CommandError) as e:
            await t.run("echo nope >&2; false", check=True, what="apply")
        assert e.value.what == "apply" and e.value.exit_status == 1 and "nope" in e.value.stderr
        await held.release()
    asyncio.run(go())


def test_an_end_line_of_another_command_is_output_and_every_command_reads_the_same_separators(
        locked: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ends are found by the session's part of the token (one separator text for all its
    commands, so asyncssh's per-call regex is compiled once); a line that carries the session's
    part but another command's is output like any other line."""
    seps: list[str] = []
    real = Piped.readuntil

    async def counted(self: Piped, separator: str, *, stderr: bool = False) -> str:
        seps.append(separator)
        return await real(self, separator, stderr=stderr)
    monkeypatch.setattr(Piped, "readuntil", counted)

    async def go() -> None:
        _, held, t = await _session()
        session = t.session                     # type: ignore[attr-defined]
        fake = f"{session._prefix}0000000000000000 END"
        r = await t.run(f"printf 'a\\n{fake} 0\\nb\\n'; printf 'c\\n{fake}\\nd\\n' >&2; exit 4")
        assert (r.exit_status, r.stdout, r.stderr) == (4, f"a\n{fake} 0\nb\n", f"c\n{fake}\nd\n")
        seps.clear()
        for _ in range(3):
            assert (await t.run("echo x")).stdout == "x\n"
        assert len(set(seps)) == 2 and len(seps) == 3 * 4   # stdout and stderr: the end line, then "\n"
        await held.release()
    asyncio.run(go())


def test_the_session_gives_each_command_the_hosts_clock_and_apply_needs_no_date(locked: Path,
                                                                                tmp_path: Path) -> None:
    """Each command in the session finds the host's clock in RECONCILER_NOW (bash's printf, no
    process), taken when it starts; the apply script's `now` uses it and runs no `date`, which
    it still runs on a channel of its own (no RECONCILER_NOW there)."""
    from reconciler.frames import batch
    from reconciler.host.script import ApplyScript
    cmd, script = batch([ApplyScript(("now",), 0)], ["T0"])
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "date").write_text("#!/bin/sh\necho 12345\n")
    (fake / "date").chmod(0o755)

    async def go() -> None:
        ch, held, t = await _session()
        t0 = time.time()
        r = await t.run(cmd, input=f"PATH={fake}:$PATH\n" + script)
        assert r.exit_status == 0, r.stderr
        clock = float(r.stdout.split("T0 now ", 1)[1].split()[0])
        assert t0 - 2 <= clock <= time.time() + 1            # the session's clock, not the fake date
        # taken anew for each command: once the host's clock is past that second, a command says so
        while (now := int((await t.run("echo $RECONCILER_NOW")).stdout)) <= clock and time.time() < clock + 10:
            await asyncio.sleep(0.05)                       # (a poll of the host's clock, not a fixed wait)
        assert now >= clock + 1
        await held.release()
        # on a channel of its own, the script asks `date`
        own = await ch.run(cmd, input=f"PATH={fake}:$PATH\n" + script)
        assert "T0 now 12345" in own.stdout
    asyncio.run(go())

def test_a_timed_out_command_is_killed_whole_and_the_session_left(locked: Path) -> None:
    async def go() -> None:
        ch, held, t = await _session()
        mark = locked / "child"
        with pytest.raises(CommandError, match="timed out"):
            await t.run(f"sh -c 'sleep 60 & echo $! > {mark}; wait'", timeout=0.5, what="apply")
        assert wait_gone(int(mark.read_text()))        # its child too: the command's process group
        r = await t.run("echo own channel", what="after")
        assert r.stdout == "own channel\n" and ch.ran == ["after"]
        await held.release()
    asyncio.run(go())


def test_a_busy_session_sends_the_next_command_to_its_own_channel(locked: Path) -> None:
    async def go() -> None:
        ch, held, t = await _session(then=None)
        handoff = locked / "handoff"        # a FIFO: the slow command waits for the quick one's word
        os.mkfifo(handoff)
        slow, quick = await asyncio.wait_for(asyncio.gather(
            t.run(f"read -r word < {handoff}; echo slow $word", what="slow"),
            t.run(f"echo quick; echo go > {handoff}", what="quick")), 10)   # queued behind slow, it never ends
        assert (slow.stdout, quick.stdout) == ("slow go\n", "quick\n")
        assert ch.ran == ["quick"]
        assert (await t.run("echo again", what="again")).stdout == "again\n"
        assert ch.ran == ["quick"]
        await held.release()
    asyncio.run(go())


def test_heartbeats_hold_the_lock_through_a_long_command_and_silence_ends_both(
        locked: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local_programs(monkeypatch, locked, idle=1)
    monkeypatch.setattr(lock, "HEARTBEAT", 0.3)

    async def go() -> None:
        ch, held, t = await _session()
        r = await t.run("sleep 1.5; echo done", timeout=10)   # longer than IDLE: the heartbeats go on
        assert r.stdout == "done\n"
        owner = locked / ".lock.owner"
        assert owner.read_text().strip()                 # says who holds it
        ready = locked / "long"                          # a FIFO: the command says its PID once it runs
        os.mkfifo(ready)
        run = asyncio.create_task(t.run(f"sh -c 'echo $$ > {ready}; exec sleep 20'", timeout=30))
        pid = int(await asyncio.wait_for(asyncio.to_thread(ready.read_text), 10))
        assert running(pid)
        held.beat.cancel()                               # the run goes silent
        holder = held.proc.proc                          # type: ignore[attr-defined]
        await asyncio.wait_for(holder.wait(), 10)        # it lets go by itself (its stdin still open)...
        assert owner.read_text() == ""                   # ...emptying the owner file...
        assert wait_gone(pid)                            # ...and the command under it is killed
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        await held.release()
    asyncio.run(go())


def test_no_command_line_shows_a_command_or_its_input(locked: Path) -> None:
    secret = "s3cr3t-" + os.urandom(6).hex()

    async def go() -> None:
        ch, held, t = await _session()
        ready, gate = locked / "ready", locked / "gate"   # FIFOs: it says it has its input, then waits
        os.mkfifo(ready)
        os.mkfifo(gate)
        task = asyncio.create_task(t.run(f"sh -c 'read -r v; : > {ready}; read -r _ < {gate}; echo ${{#v}}' "
                                         f"# {secret}", input=secret + "\n"))
        await asyncio.wait_for(asyncio.to_thread(ready.read_text), 10)    # the command runs, holding its input
        seen = []
        for p in Path("/proc").iterdir():
            if p.name.isdigit():
                with contextlib.suppress(OSError):
                    seen.append((p / "cmdline").read_bytes())
        assert not any(secret.encode() in c for c in seen)
        gate.write_text("go\n")
        assert (await task).stdout == f"{len(secret)}\n"
        await held.release()
    asyncio.run(go())


class _Fed:
    """Output fed at once, read as a StreamSpawned (readuntil) or, with lines_only, line by line."""

    def __init__(self, data: str, lines_only: bool = False):
        self.reader = asyncio.StreamReader()
        self.reader.feed_data(data.encode())
        self.reader.feed_eof()
        if not lines_only:
            self.readuntil = self._readuntil

    async def readline(self) -> str:
        return (await self.reader.readline()).decode()

    async def _readuntil(self, separator: str, *, stderr: bool = False) -> str:
        return (await self.reader.readuntil(separator.encode())).decode()

    def write(self, data: str) -> None:
        pass

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("lines_only", [False, True])
def test_the_output_under_the_lock_is_read_through_its_last_line_and_no_further(lines_only):
    async def through(data: str) -> tuple[str | None, str]:
        proc = _Fed(data, lines_only)
        got = await lock._read_through(proc, "T END")    # type: ignore[arg-type]
        return got, await proc.readline()

    assert asyncio.run(through("a\nb\nT END\nnext\n")) == ("a\nb\nT END\n", "next\n")
    assert asyncio.run(through("T END\nnext\n")) == ("T END\n", "next\n")
    # the last line's text at the end of another line is not the end
    assert asyncio.run(through("a T END\nb\nT END\nnext\n")) == ("a T END\nb\nT END\n", "next\n")
    assert asyncio.run(through("a\nb\n")) == (None, "")           # the output ended before it


def test_the_first_run_on_a_host_installs_the_holder_by_content_and_later_ones_find_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing on the command line but the launcher: the holder, its loop and the first
    program are files under the state directory, named by their content; the first run
    installs them (one round trip more), every later run starts them as they are, and a new
    release's programs replace the old ones."""
    local_programs(monkeypatch, tmp_path)

    async def go() -> None:
        ch = _Channels()
        held = await lock.acquire(ch, wait=1, then=SEEN)  # type: ignore[arg-type]
        assert held.answer is not None and SEEN.parse(held.answer) == "seen"
        assert ch.ran == ["install the lock holder"]
        await held.release()
        held = await lock.acquire(ch, wait=1, then=SEEN)  # type: ignore[arg-type]
        assert held.answer is not None and SEEN.parse(held.answer) == "seen"
        assert ch.ran == ["install the lock holder"]
        await held.release()
        progs = sorted(p.name for p in (tmp_path / "progs").iterdir())
        assert len(progs) == 3 and all(len(p) == len("0123456789abcdef.sh") for p in progs)
        assert (tmp_path / "progs").stat().st_mode & 0o777 == 0o700
        class Other(Said):
            @classmethod
            def text(cls) -> str:
                return super().text() + "# another release\n"
        held = await lock.acquire(ch, wait=1, then=Other("other"))  # type: ignore[arg-type]
        assert held.answer is not None and SEEN.parse(held.answer) == "other"
        assert ch.ran == ["install the lock holder"] * 2
        await held.release()
        assert len(list((tmp_path / "progs").iterdir())) == 3      # the first command's old program went
    asyncio.run(go())


# ---- what the holder says, read as data (review N5, N6) -----------------------------------------

@pytest.mark.parametrize("status,code", [("0", 0), ("255", 255), ("256", 255), ("²", 255), ("9" * 5000, 255),
                                         ("", 255), ("-1", 255), (" 3 ", 3)])
def test_a_commands_exit_status_is_what_its_end_line_says_or_255(status: str, code: int) -> None:
    from reconciler.host.session import ended
    tok = "ab:cd"
    res = ended(f"out{tok} END {status}", tok, "err")
    assert (res.exit_status, res.stdout, res.stderr) == (code, "out", "err")


def test_who_holds_the_lock_is_redacted_then_cut() -> None:
    from reconciler import redact
    from reconciler.host.lock import OWNER_MAX, holder_said
    from tests.test_redact import fresh, leaked, straddling
    secret = fresh("Zq9-vT3")
    redact.register(secret)
    line = straddling(secret, OWNER_MAX, after=" " + "w" * 500) + "\n"
    said = holder_said(line)
    assert len(said) == OWNER_MAX and "***" in said and not leaked(secret, said)
    assert holder_said("reconcile on ctl pid 7 since 2026-12-03 10:00:00\n") == \
        "reconcile on ctl pid 7 since 2026-12-03 10:00:00"


class Record(HostProgram[str], frozen=True):
    """reconciler/sh/host-record.sh with its record in a test's directory: a program bash runs as
    sh does (in_session), as the observation is."""

    name = "host-record"
    in_session = True
    path: str = ""

    def params(self) -> dict[str, str]:
        return {}

    def parse(self, answer: Records) -> str:
        return "|".join(f.payload for f in answer.whole("cut short"))


def _standing(proc_cmd: list[str]) -> tuple[_Channels, list[str], Callable[[], Awaitable[SessionTransport]]]:
    """A standing session (no lock) over local pipes, and what it was sent (its token first)."""
    ch, sent = _Channels(), []

    async def start() -> SessionTransport:
        p = await asyncio.create_subprocess_exec(*proc_cmd, stdin=asyncio.subprocess.PIPE,
                                                 stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        piped = Piped(p)
        write = piped.write
        piped.write = lambda data: (sent.append(data), write(data))[1]  # type: ignore[method-assign]
        piped.write(standing_input("ab12"))                   # as session.stand does
        return SessionTransport(ch, HostSession("h1", piped, "ab12", standing=True))  # type: ignore[arg-type]
    return ch, sent, start


def test_a_program_bash_runs_as_sh_runs_in_the_sessions_own_bash_and_answers_as_in_its_own_sh(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm daemon's standing session (no lock: standing_command) runs an in_session program's
    text in its own bash, with no sh of its own; its answer is the one `sh -c` gives on a channel
    of its own, to the byte: lines, a last line without its newline, blanks and backslashes."""
    record = tmp_path / "host.json"
    record.write_text('{"a": "x\\\\y"}\n\n  two  \\\n{"last": true}')
    monkeypatch.setattr(Record, "constants", {"HOST_RECORD": str(record)})
    ch, sent, start = _standing(["sh", "-c", standing_command(30)])

    async def go() -> None:
        t = await start()
        own = await programs.run(ch, Record(), what="record")          # its own channel: sh -c
        assert ch.ran == ["record"]
        said = await programs.run(t, Record(), what="record")
        assert ch.ran == ["record"] and said == own
        assert said.split("|")[:4] == ['L {"a": "x\\\\y"}', "L ", "L   two  \\", 'P {"last": true}']
        frame = next(s for s in sent if s.startswith("F "))      # run by the loop's own shell (here())
        assert frame.split("\n", 1)[1].startswith("#!/bin/sh\nHOST_RECORD=")    # the text itself, no `sh -c`
        # a command that sets the session's own names (tok, T, cmd) still ends as itself
        r = await t.run("tok=x T=y cmd=z pid=; echo $tok$T$cmd; exit 5")
        assert (r.exit_status, r.stdout) == (5, "xyz\n") and ch.ran == ["record"]
        await t.session.proc.close()
    asyncio.run(go())


def test_a_standing_sessions_read_runs_in_the_loops_own_shell_and_leaves_it_as_it_was() -> None:
    """A standing session runs an in_session program (an F frame) in the loop's own shell, with no
    process of its own (a daemon's round then costs the host its systemctl alone). What the
    program sets (the loop's own names, IFS, set -f and -u) is the loop's again after it: the next
    read and the next command run as they would have."""
    ch, sent, start = _standing(["sh", "-c", standing_command(30)])

    async def go() -> None:
        t = await start()
        loop = t.session.proc.proc.pid                 # sh, exec'd into the loop's bash
        said = await t.run(shell.ShScript("echo $BASHPID; tok=x T=y cmd=z line=w pid=1 more=q size=0 kind=R"
                                          " inp=v IFS=:; set -f -u; set -- a b; exit_status=3"), what="read")
        assert (said.exit_status, said.stdout, said.stderr) == (0, f"{loop}\n", "")
        again = await t.run(shell.ShScript("echo $BASHPID a:b; echo \"${nosuch-none}\" >&2; false"), what="again")
        assert (again.exit_status, again.stdout, again.stderr) == (1, f"{loop} a:b\n", "none\n")
        own = await t.run("echo $BASHPID; echo /proc/self/statu?; echo $nosuch")     # an R frame: its own group
        pid, glob, unset = own.stdout.split("\n")[:3]
        assert int(pid) != loop and (glob, unset, own.exit_status) == ("/proc/self/status", "", 0)
        assert [f[0] for f in sent[1:]] == ["F", "F", "R"] and ch.ran == []
        await t.session.proc.close()
    asyncio.run(go())


def test_a_standing_session_that_never_comes_up_leaves_its_command_to_its_own_channel() -> None:
    """Where the host has no bash, the standing session's shell ends before it says READY: the
    command it was given goes to a channel of its own, and so does every later one."""
    ch, _, start = _standing(["sh", "-c", "exit 0"])

    async def go() -> None:
        t = await start()
        r = await t.run("echo here", what="first")
        assert (r.exit_status, r.stdout) == (0, "here\n") and ch.ran == ["first"]
        assert t.session.broken and not t.session.came_up
        assert (await t.run("echo again", what="second")).stdout == "again\n"
        assert ch.ran == ["first", "second"]
    asyncio.run(go())


def test_the_sessions_end_signals_no_process_group_of_a_command_whose_end_was_read(locked: Path) -> None:
    """No frame tells the loop that a command's end was read: as the session ends it signals the
    last command's process group only while that group's leader is still its own child, never a
    PID that a command that ended had (it may be another process's by then). What a command left
    running stays, as on a channel of its own."""
    async def go() -> int:
        _, held, t = await _session(then=None)
        r = await t.run("sleep 30 >/dev/null 2>&1 & echo $!")
        await held.release()
        return int(r.stdout)
    left = asyncio.run(go())
    try:
        os.kill(left, 0)                    # still running after the holder went (release waits for it)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(left, 9)


@pytest.mark.parametrize(("leader_named", "status"), [("ended", 0), ("", 143)])
def test_the_sessions_stop_lets_be_a_group_whose_leader_has_begun_to_write_its_ends(
        tmp_path: Path, leader_named: str, status: int) -> None:
    """A command's group leader that has written its ends may not have exited yet when the run's
    release reaches the loop (CI, under load): the leader names itself "ended" before its ends, and
    stop() lets that group be (what it left running stays). A leader that still runs its command
    is TERMed with its whole group. The leader here waits on what it started; its exit status says
    whether stop() signalled it (143: TERM; 0: its wait ended as the test KILLed the sleep)."""
    text = lock.installed_texts()[1]
    start = text.index("stop() {")
    stop = text[start:text.index("\n}\n", start) + 3]
    fifo = tmp_path / "started"
    os.mkfifo(fifo)
    name = f"printf {leader_named} >/proc/self/comm; " if leader_named else ""
    script = stop + f"""set -m
( {name}sleep 30 >/dev/null 2>&1 & echo "$!" > {fifo}; wait ) &
pid=$!; leader=$pid; read -r left < {fifo}
stop
kill -KILL "$left"; wait "$leader"; echo "$?"
"""
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=20)
    assert out.stdout.split() == [str(status)], out


def test_a_standing_session_keeps_nothing_per_command_it_ran() -> None:
    """The daemon's standing session lives as long as its connection, a command a round: its loop
    keeps no job table entry for a command that ran (one kept per command made its memory, and
    the cost of each fork, grow for as long as it lived: about 230 kB a thousand commands), and
    a read it runs in its own shell (an F frame) leaves nothing behind either."""
    _, _, start = _standing(["sh", "-c", standing_command(30)])

    async def go() -> tuple[int, int]:
        t = await start()
        pid = t.session.proc.proc.pid                 # sh, exec'd into the loop's bash
        def rss() -> int:
            return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0])
        read = shell.ShScript("f() { v=$1; }; f x; true")        # as observe does: run by the loop's shell
        for _ in range(200):
            assert (await t.run("true")).exit_status == 0
            assert (await t.run(read)).exit_status == 0
        before = rss()
        for _ in range(1500):
            await t.run("true")
            await t.run(read)
        after = rss()
        await t.session.proc.close()
        return before, after
    before, after = asyncio.run(go())
    assert after - before < 64, (before, after)        # kB


class _Reader:
    """An asyncssh reader's readuntil, as the session's SSH end calls it (the separator it gets)."""

    def __init__(self) -> None:
        self.got: list[tuple[object, int]] = []

    async def readuntil(self, separator: object, max_separator_len: int = 0) -> str:
        self.got.append((separator, max_separator_len))
        return ""


def test_the_ssh_end_compiles_each_separator_once():
    """asyncssh compiles a text separator to a regex at every read; a daemon reads through a
    session a host, more distinct separators than Python's cache of regexes keeps. The SSH end
    gives it each one compiled, once, matching the text literally."""
    from types import SimpleNamespace

    from reconciler.host.transport import _SSHSpawned
    out, err = _Reader(), _Reader()
    spawned = _SSHSpawned(SimpleNamespace(stdout=out, stderr=err))    # type: ignore[arg-type]

    async def reads() -> None:
        for _ in range(3):
            await spawned.readuntil("\nab.c:")
            await spawned.readuntil("\nab.c:", stderr=True)
        await spawned.readuntil("\n")
    asyncio.run(reads())
    (first, n), *rest = out.got[:3]
    assert n == len("\nab.c:") and all(p is first for p, _ in rest + err.got)
    assert first.search("x\nab.c:y") and not first.search("x\nabxc:y")     # literal: the dot is a dot
    assert out.got[3][0] is not first and out.got[3][1] == 1
