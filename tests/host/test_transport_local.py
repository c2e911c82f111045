"""LocalTransport: the Transport a host uses against itself (`reconcile pull`, the GPU check host).

Real processes on this machine, no fakes: a command with input, check=True, a timeout that
kills what the command started, a cancelled command, a TCP stream to a local server (what the
health probe uses), and a spawned process as the host lock holds one."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from reconciler.errors import CommandError
from reconciler.frames import HostProgram, Records
from reconciler.host import lock
from reconciler.host.transport import LocalTransport
from tests.host.procs import wait_gone
from tests.host.programs import local_programs


class Script(HostProgram[Records], frozen=True):
    """A program of a test's own text, run as the lock's first program: it reads its token (T)
    from its parameters, the lines after the holder's on stdin."""

    name = "test-script"
    body: str

    def text(self) -> str:     # type: ignore[override]
        return ("#!/bin/sh\nwhile IFS= read -r l && [ -n \"$l\" ]; do case $l in token=*) T=${l#token=} ;; esac; "
                f"done\n{self.body}\n")

    def parse(self, answer: Records) -> Records:
        return answer

pytestmark = pytest.mark.timeout(30)


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_run_with_input_and_exit_status() -> None:
    t = LocalTransport("h1")
    res = run(t.run("read x; echo \"got $x\"; echo err >&2; exit 3", input="hello\n"))
    assert (res.exit_status, res.stdout, res.stderr, res.ok) == (3, "got hello\n", "err\n", False)
    assert run(t.run("echo -n ok")).stdout == "ok"
    assert run(t.run("[[ a == a ]] && echo bash")).stdout == "bash\n"      # bash, as over SSH for root


def test_check_raises_with_host_and_what() -> None:
    with pytest.raises(CommandError) as e:
        run(LocalTransport("h1").run("echo nope >&2; false", check=True, what="observe"))
    assert e.value.host == "h1" and e.value.what == "observe" and e.value.exit_status == 1
    assert "nope" in str(e.value)


def test_a_timeout_kills_the_command_and_what_it_started(tmp_path: Path) -> None:
    pidfile = tmp_path / "child"
    with pytest.raises(CommandError, match=r"timed out after 0\.5s"):     # the timeout, not the command, ended it
        run(LocalTransport().run(f"sleep 100 & echo $! > {pidfile}; wait", timeout=0.5))
    assert wait_gone(int(pidfile.read_text()))       # what it started, too


def test_a_cancelled_command_is_killed(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"          # a FIFO: the command says its PID once it runs
    os.mkfifo(pidfile)

    async def go() -> int:
        task = asyncio.create_task(LocalTransport().run(f"echo $$ > {pidfile}; sleep 100"))
        pid = int(await asyncio.wait_for(asyncio.to_thread(pidfile.read_text), 10))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return pid

    assert wait_gone(run(go()))


def test_open_connection_reaches_a_local_server() -> None:
    async def go() -> bytes:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"hello " + await reader.readline())
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            reader, writer = await LocalTransport().open_connection("127.0.0.1", port)
            writer.write(b"probe\n")
            data = await reader.read()
            writer.close()
            return data

    assert run(go()) == b"hello probe\n"


def test_spawn_lines_in_and_out() -> None:
    async def go() -> list[str]:
        p = await LocalTransport().spawn("while read l; do echo \"<$l>\"; done")
        p.write("a\n")
        first = await p.readline()
        p.write("b\n")
        second = await p.readline()
        await p.close()
        return [first, second, await p.readline()]

    assert run(go()) == ["<a>\n", "<b>\n", ""]


def test_the_host_lock_through_a_local_transport(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs on one host: the second waits, then reports Locked with who holds it; released, it is free."""
    local_programs(monkeypatch, tmp_path)

    async def go() -> str:
        t = LocalTransport("h1")
        held = await lock.acquire(t, wait=1)
        try:
            with pytest.raises(lock.LockedError) as e:
                await lock.acquire(t, wait=0.5)
        finally:
            await held.release()
        again = await lock.acquire(t, wait=5)
        await again.release()
        return str(e.value)

    said = run(go())
    assert "another reconcile holds" in said and "held by reconcile on" in said


def test_the_lock_runs_a_command_under_itself_and_hands_back_its_output(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """lock_and_observe's half: the holder runs the command only once it holds the lock (a
    second run's command never runs while the first holds it), and its output comes back whole."""
    local_programs(monkeypatch, tmp_path)
    marker = tmp_path / "ran"

    async def go() -> tuple[Records | None, bool, Records | None, Records | None]:
        t = LocalTransport("h1")
        held = await lock.acquire(t, wait=1, then=Script("printf '%s S a b\\n\\n%s S c\\n%s END\\nafter\\n' "
                                                         "\"$T\" \"$T\" \"$T\""))
        try:
            with pytest.raises(lock.LockedError):
                await lock.acquire(t, wait=0.5, then=Script(f"touch {marker}; echo \"$T END\""))
            ran_while_held = marker.exists()
        finally:
            await held.release()
        cut = await lock.acquire(t, wait=1, then=Script("echo \"$T S partial\""), then_timeout=0.2)
        await cut.release()
        plain = await lock.acquire(t, wait=1)
        await plain.release()
        return held.answer, ran_while_held, cut.answer, plain.answer

    answer, ran_while_held, cut, plain = run(go())
    assert answer is not None and answer.stdout == f"{answer.token} S a b\n\n{answer.token} S c\n{answer.token} END\n"
    assert [f.payload for f in answer.whole("cut")] == ["a b", "c"]
    assert not ran_while_held
    assert cut is None and plain is None        # never ended with its END record / nothing asked


@pytest.mark.parametrize("with_bash", [True, False])
def test_the_holder_keeps_the_lock_while_heartbeats_come_and_lets_go_when_they_stop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, with_bash: bool) -> None:
    """A controller gone silent (partitioned away) never blocks the host for long: the holder
    lets go IDLE seconds after the last heartbeat, with bash's `read -t` or, on a host without
    bash, `timeout head`. While heartbeats come, it holds on past IDLE. No wall time is asserted:
    it is alive after each heartbeat, and once they stop it ends by itself (its stdin still open),
    having emptied the owner file."""
    local_programs(monkeypatch, tmp_path, idle=1)
    asyncio.run(lock.install(LocalTransport("h1")))       # as an earlier run left the host
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "flock", "head", "mkdir", "cat", "rm", "kill", *(("bash",) if with_bash else ())):
        (bin_dir / tool).symlink_to(shutil.which(tool) or tool)
    marker = tmp_path / "timeout-ran"          # `timeout`, noting that it ran
    (bin_dir / "timeout").write_text(f"#!/bin/sh\n: > {marker}\nexec {shutil.which('timeout')} \"$@\"\n")
    (bin_dir / "timeout").chmod(0o755)
    holder = subprocess.Popen(["/bin/sh", "-c", lock.launch_command()], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={"PATH": str(bin_dir)})
    assert holder.stdin is not None and holder.stdout is not None
    try:
        holder.stdin.write(lock.holder_stdin("T0", 1, "test owner"))
        holder.stdin.flush()
        assert holder.stdout.readline().split() == (["T0", "LOCKED", "bash"] if with_bash else ["T0", "LOCKED"])
        for _ in range(5):                         # 1.25 s of heartbeats: past IDLE, still held
            holder.stdin.write(".\n")
            holder.stdin.flush()
            time.sleep(0.25)                       # the gap between heartbeats (IDLE is 1 s)
            assert holder.poll() is None
        assert (tmp_path / ".lock.owner").read_text() == "test owner\n"
        assert holder.wait(timeout=10) == 0       # silent (stdin still open): it lets go by itself
        assert (tmp_path / ".lock.owner").read_text() == ""     # emptied: no holder
        assert marker.exists() is not with_bash    # with bash: no process per heartbeat
    finally:
        holder.kill()
        holder.wait()


def test_a_look_stands_under_the_lock_until_another_holder_has_had_it(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """lock_and_observe(look=...), as the fleet's survey calls it, with the real observation and
    holder scripts under /bin/sh (systemctl faked, noting each call). While no run held the lock
    as the look was read and none has taken it since (its count has not moved), the holder reads
    nothing and the look comes back as it was. Once another holder has had the lock, or while
    one holds it as the look is read, the host is read again under the lock."""
    from reconciler.desired.spec import HostSpec, ServiceSpec, SSHSpec
    from reconciler.loop.host_run import lock_and_observe, observe
    local_programs(monkeypatch, tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shows = tmp_path / "shows"
    (bin_dir / "systemctl").write_text(f"#!/bin/sh\necho show >> {shows}\n"
                                       "printf 'Id=m.service\\nActiveState=active\\n'\n")
    (bin_dir / "systemctl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    host = HostSpec("h1", SSHSpec("127.0.0.2"), {"m": ServiceSpec("m", "[Service]\nExecStart=/bin/x\n", {})})

    def reads() -> int:
        return len(shows.read_text().splitlines()) if shows.exists() else 0

    async def go() -> None:
        t = LocalTransport("h1")
        look = await observe(t, host)
        assert look.lock_count == "0" and reads() == 1           # never locked yet
        held, facts_ = await lock_and_observe(t, host, 1, look=look)
        assert held.same and facts_ is look and reads() == 1      # nothing read under the lock
        await held.release()

        look = await observe(t, host)
        assert look.lock_count == "1" and reads() == 2
        other = await lock.acquire(t, wait=1)                    # another run has it meanwhile
        await other.release()
        held, facts_ = await lock_and_observe(t, host, 1, look=look)
        assert not held.same and facts_ is not None and facts_ is not look and reads() == 3
        assert facts_.services["m"].props["ActiveState"] == "active"
        await held.release()

        other = await lock.acquire(t, wait=1)
        try:
            look = await observe(t, host)                         # read while a run holds it
        finally:
            await other.release()
        assert look.lock_count is None
        held, facts_ = await lock_and_observe(t, host, 1, look=look)
        assert not held.same and facts_ is not look and reads() == 5
        await held.release()
        held, facts_ = await lock_and_observe(t, host, 1)        # no look: always read under it
        assert not held.same and facts_ is not None and reads() == 6
        await held.release()
        count = tmp_path / ".lock.count"
        assert count.read_text() == "6\n" and (tmp_path / ".lock.owner").read_text() == ""

        # An armed dead-man's switch may fire (and change the host) at any moment: no look stands
        (tmp_path / "confirm").mkdir()
        (tmp_path / "confirm" / "m.sh").write_text("#!/bin/sh\n")
        assert (await observe(t, host)).lock_count is None
        (tmp_path / "confirm" / "m.sh").unlink()
        assert (await observe(t, host)).lock_count == "6"
        # A holder that cannot write the count (a full disk: /dev/full) removes it, so a look
        # that saw it never stands after that holder; the lock taken with no count is unknown too
        count.unlink()
        count.symlink_to("/dev/full")
        other = await lock.acquire(t, wait=1)
        await other.release()
        assert not count.exists() and not count.is_symlink()
        assert (await observe(t, host)).lock_count is None
        (tmp_path / ".lock").unlink()                              # a host never locked: 0
        assert (await observe(t, host)).lock_count == "0"

    run(go())
