"""The warm daemon's connection pool (reconciler/host/pool.py), with transports that only count.

The real-host side (a daemon's rounds reuse their connections, and a connection killed on the
host is replaced) is in tests/e2e/test_e2e_push.py."""

from __future__ import annotations

import asyncio

import pytest

from reconciler.desired.spec import HostSpec, SSHSpec
from reconciler.errors import CommandError, ConnectError
from reconciler.host.pool import Pool
from reconciler.host.transport import Completed
from tests.host.procs import Piped


class FakeConn:
    def __init__(self) -> None:
        self.closed = False

    def is_closed(self) -> bool:
        return self.closed


class FakeTransport:
    """Counts commands; `dead` makes every command fail as a lost connection would."""

    def __init__(self, host: str, n: int):
        self.host, self.n = host, n
        self._conn = FakeConn()
        self.dead = False
        self.commands: list[str] = []

    async def run(self, cmd: str, **kw: object) -> Completed:
        if self.dead:
            raise ConnectError(self.host, f"connection lost during {kw.get('what', 'command')}")
        self.commands.append(cmd)
        return Completed(0, f"{cmd} on connection {self.n}", "")

    async def spawn(self, cmd: str) -> object:
        if self.dead:
            raise ConnectError(self.host, "connection lost starting flock")
        self.commands.append(cmd)
        return object()

    async def open_connection(self, host: str, port: int):  # pragma: no cover - not used here
        raise NotImplementedError

    async def close(self) -> None:
        self._conn.closed = True


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def host(name: str = "gpu-1", address: str = "127.0.0.20", **ssh: object) -> HostSpec:
    return HostSpec(name, SSHSpec(address, **ssh))  # type: ignore[arg-type]


@pytest.fixture
def made() -> list[FakeTransport]:
    return []


def _pool(made: list[FakeTransport], kind: type[FakeTransport] = FakeTransport, **kw: object) -> Pool:
    """A pool whose connections are `kind`, each kept in `made` in the order made."""
    async def connect(h: HostSpec) -> FakeTransport:
        t = kind(h.name, len(made))
        made.append(t)
        return t
    return Pool(connect, clock=Clock(), **kw)  # type: ignore[arg-type]


@pytest.fixture
def pool(made: list[FakeTransport]) -> Pool:
    return _pool(made)


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_a_second_run_reuses_the_connection_and_close_only_gives_it_back(pool, made):
    async def scenario() -> None:
        for _ in range(3):
            t = await pool.connector()(host())
            assert (await t.run("observe")).stdout == "observe on connection 0"
            await t.close()
            await t.close()                       # closing twice gives back once
    run(scenario())
    assert len(made) == 1 and not made[0]._conn.closed
    assert (pool.opened, pool.reused, len(pool)) == (1, 2, 1)


def test_a_changed_address_port_or_key_connects_afresh_and_closes_the_old(pool, made):
    async def scenario() -> None:
        for h in (host(), host(address="127.0.0.21"), host(address="127.0.0.21", port=2222),
                  host(address="127.0.0.21", port=2222, host_key="ssh-ed25519 AAAA"),
                  host(address="127.0.0.21", port=2222, host_key="ssh-ed25519 AAAA")):
            await (await pool.lease(h)).close()
    run(scenario())
    assert len(made) == 4 and [t._conn.closed for t in made] == [True, True, True, False]
    assert pool.reused == 1


def test_a_connection_known_to_be_closed_is_replaced_at_the_next_lease(pool, made):
    async def scenario() -> None:
        await (await pool.lease(host())).close()
        made[0]._conn.closed = True              # keepalive found the peer gone, between runs
        t = await pool.lease(host())
        assert (await t.run("observe")).stdout == "observe on connection 1"
        await t.close()
    run(scenario())
    assert (pool.opened, pool.reused) == (2, 0)


def test_a_kept_connection_found_dead_at_its_first_command_is_retried_once_on_a_fresh_one(pool, made):
    async def scenario() -> None:
        await (await pool.lease(host())).close()
        made[0].dead = True                      # dead, though asyncssh has not noticed yet
        t = await pool.lease(host())
        await t.spawn("flock ...")               # the host lock: first command of the lease
        assert (await t.run("observe")).stdout == "observe on connection 1"
        await t.close()
        t = await pool.lease(host())             # the fresh one is the pool's now
        assert (await t.run("observe")).stdout == "observe on connection 1"
        await t.close()
    run(scenario())
    assert made[0]._conn.closed and len(made) == 2 and made[1].commands == ["flock ...", "observe", "observe"]


def test_only_the_first_command_is_retried_and_a_broken_lease_is_dropped(pool, made):
    async def scenario() -> None:
        t = await pool.lease(host())
        await t.run("observe")
        made[0].dead = True
        with pytest.raises(ConnectError):        # mid-run: the run's failure (Unreachable), no retry
            await t.run("apply")
        await t.close()
        assert len(pool) == 0 and made[0]._conn.closed
        t = await pool.lease(host())
        assert (await t.run("observe")).stdout == "observe on connection 1"
        await t.close()
    run(scenario())
    assert made[0].commands == ["observe"] and len(made) == 2


def test_a_fresh_connection_that_fails_is_not_retried(pool, made):
    async def scenario() -> None:
        t = await pool.lease(host())
        made[0].dead = True
        with pytest.raises(ConnectError):
            await t.spawn("flock ...")
        await t.close()
    run(scenario())
    assert len(made) == 1 and len(pool) == 0


def test_a_host_leased_twice_at_once_gets_a_second_connection_that_is_really_closed(pool, made):
    async def scenario() -> None:
        a = await pool.lease(host())
        b = await pool.lease(host())
        await b.close()
        await a.close()
    run(scenario())
    assert len(made) == 2 and made[1]._conn.closed and not made[0]._conn.closed and len(pool) == 1


def test_retain_closes_hosts_that_left_the_fleet_and_idle_ones_never_a_leased_one(pool, made):
    clock: Clock = pool.clock  # type: ignore[assignment]

    async def scenario() -> None:
        for name in ("gpu-1", "gpu-2", "gpu-3"):
            await (await pool.lease(host(name))).close()
        busy = await pool.lease(host("gpu-3"))
        clock.now += 10
        await (await pool.lease(host("gpu-2"))).close()
        await pool.retain(["gpu-2", "gpu-3"])        # gpu-1 left the fleet
        assert sorted(pool._entries) == ["gpu-2", "gpu-3"]
        clock.now += pool.idle + 1
        await pool.retain(["gpu-2", "gpu-3"])        # gpu-2 idle too long; gpu-3 is leased
        assert sorted(pool._entries) == ["gpu-3"]
        await busy.close()
        await pool.close()
    run(scenario())
    assert all(t._conn.closed for t in made) and len(pool) == 0


class LocalHost(FakeTransport):
    """A connection whose spawned commands run here in sh, over pipes read as the SSH channel's
    are (the standing session's loop is the real session.sh in bash); `run` is a channel of its
    own, counted."""

    async def run(self, cmd: str, **kw: object) -> Completed:
        self.commands.append(str(kw.get("what", cmd)))
        p = await asyncio.create_subprocess_exec("sh", "-c", cmd, stdin=asyncio.subprocess.PIPE,
                                                 stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await p.communicate()
        return Completed(p.returncode, out.decode(), err.decode())

    async def spawn(self, cmd: str) -> Piped:
        self.commands.append("spawn")
        return Piped(await asyncio.create_subprocess_exec(
            "sh", "-c", cmd.replace("command -v bash >/dev/null", "[ -z \"$NO_BASH\" ] && command -v bash >/dev/null"),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE))


@pytest.fixture
def standing(made: list[FakeTransport]) -> Pool:
    return _pool(made, LocalHost, standing=True)


def test_a_standing_pool_runs_a_reused_connections_commands_through_its_standing_session(standing, made):
    """The daemon's pool: the first lease of a connection runs its commands on channels of their
    own; from the second on, one standing session (started once) runs them, each a frame; one
    that broke (a command timed out: killed) is started again at the next lease."""
    async def scenario() -> None:
        t = await standing.lease(host())
        assert (await t.run("echo cold", what="observe")).stdout == "cold\n"
        await t.close()
        for i in range(3):
            t = await standing.lease(host())
            r = await t.run(f"echo warm {i}; echo err >&2; exit 3", what="observe")
            assert (r.exit_status, r.stdout, r.stderr) == (3, f"warm {i}\n", "err\n")
            await t.close()
        assert made[0].commands == ["observe", "spawn"]
        t = await standing.lease(host())
        with pytest.raises(CommandError, match="timed out"):
            await t.run("sleep 30", timeout=0.3, what="slow")
        assert (await t.run("echo own", what="after")).stdout == "own\n"      # left: its own channel
        await t.close()
        t = await standing.lease(host())
        assert (await t.run("echo back", what="observe")).stdout == "back\n"
        await t.close()
        assert made[0].commands == ["observe", "spawn", "after", "spawn"]
        await standing.close()
    run(scenario())


def test_a_standing_session_that_never_came_up_is_not_started_again_on_that_connection(
        standing, made, monkeypatch):
    monkeypatch.setenv("NO_BASH", "1")

    async def scenario() -> None:
        for i in range(3):
            t = await standing.lease(host())
            assert (await t.run(f"echo {i}", what="observe")).stdout == f"{i}\n"
            await t.close()
        await standing.close()
    run(scenario())
    assert made[0].commands == ["observe", "spawn", "observe", "observe"]
