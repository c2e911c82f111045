"""The daemon's loop without hosts: asks coalesce, one run at a time, back-off after failures (on a
virtual clock, tests/clock.py: the back-off is seen, not waited out)."""

from __future__ import annotations

import asyncio

from reconciler.controller.config import ControllerConfig
from reconciler.controller.daemon import BACKOFF_START, Daemon
from tests.clock import FakeClock


def make(tmp_path, clock: FakeClock | None = None, **kw) -> Daemon:
    cfg = ControllerConfig(repo=str(tmp_path / "nope.git"), state_dir=str(tmp_path / "state"), metrics="", **kw)
    return Daemon(cfg, interval=60, clock=clock if clock is not None else FakeClock())


async def stop(d: Daemon, runner: asyncio.Task[None]) -> None:
    d.stopping.set()
    d.wake.set()
    await asyncio.wait_for(runner, 5)


def test_unreadable_repo_is_a_failed_run_not_a_crash(tmp_path, capsys):
    d = make(tmp_path)
    code = asyncio.run(d.run_once())
    assert code == 1
    assert "run failed" in capsys.readouterr().out


def test_asks_during_a_run_coalesce_into_one_more_run(tmp_path):
    clock = FakeClock()
    d = make(tmp_path, clock)
    events: list[str] = []
    active = 0
    overlap = False
    in_flight = asyncio.Event()
    release = asyncio.Event()

    async def fake_run_once() -> int:
        nonlocal active, overlap
        active += 1
        overlap |= active > 1
        events.append(f"run {len(events) + 1} ({len(d.reasons)} asks)")
        d.reasons.clear()                  # as run_once does
        in_flight.set()
        await release.wait()
        active -= 1
        return 0

    async def scenario() -> None:
        d.run_once = fake_run_once  # type: ignore[method-assign]
        runner = asyncio.create_task(d._runner())
        d.ask("push")
        await in_flight.wait()             # the first run is in flight
        for _ in range(5):
            d.ask("push")                  # five pushes during it
        release.set()
        await clock.sleep(3600)            # virtual: returns once the runner has nothing left to do
        await stop(d, runner)

    asyncio.run(scenario())
    assert events == ["run 1 (1 asks)", "run 2 (5 asks)"] and not overlap


def test_failed_runs_retry_with_back_off(tmp_path):
    clock = FakeClock()
    d = make(tmp_path, clock)
    times: list[float] = []

    async def failing() -> int:
        times.append(clock.elapsed())
        return 4                       # a host failed

    async def scenario() -> None:
        d.run_once = failing  # type: ignore[method-assign]
        runner = asyncio.create_task(d._runner())
        d.ask("start")
        await clock.sleep(200)          # virtual seconds
        await stop(d, runner)

    asyncio.run(scenario())
    # retried without any new ask, each wait twice the last (from BACKOFF_START), up to the interval
    assert BACKOFF_START == 2.0 and d.interval == 60
    assert times == [0, 2, 6, 14, 30, 62, 122, 182]
    assert d.backoff == 60


def test_a_hook_failure_is_one_line_with_path_cause_and_fix() -> None:
    from reconciler.controller.hooks import failure_line
    from reconciler.errors import SourceError

    e = PermissionError(13, "Permission denied", "/etc/reconciler/config.toml")
    line = failure_line("pre-receive", e)
    assert line.startswith("reconciler: pre-receive: cannot use /etc/reconciler/config.toml: Permission denied; "
                           "the push was refused. Fix: make it readable by the pushing users' group")
    assert "\n" not in line
    runs = PermissionError(13, "Permission denied", "/var/lib/reconciler-controller/runs/abc.log")
    assert "; the push landed. Fix:" in failure_line("post-receive", runs)
    assert "run logs group-readable" in failure_line("post-receive", runs)
    assert failure_line("pre-receive", SourceError("x: not a git repository")) == (
        "reconciler: pre-receive: x: not a git repository (the push was refused)")
    assert "ZeroDivisionError" in failure_line("pre-receive", ZeroDivisionError("boom"))


def test_an_exception_in_a_run_is_logged_counted_and_retried(tmp_path, capsys):
    """A bug in a run must not end the loop while the process and its metrics stay up."""
    clock = FakeClock()
    d = make(tmp_path, clock)
    calls: list[tuple[float, list[str]]] = []

    async def crashing_then_fine() -> int:
        calls.append((clock.elapsed(), list(d.reasons)))
        d.reasons.clear()                  # as run_once does
        if len(calls) == 1:
            raise KeyError("a bug")
        return 0

    async def scenario() -> None:
        d.run_once = crashing_then_fine  # type: ignore[method-assign]
        runner = asyncio.create_task(d._runner())
        d.ask("start")
        await clock.sleep(3600)        # virtual: the crash, then the retry after the back-off
        await stop(d, runner)

    asyncio.run(scenario())
    out = capsys.readouterr().out
    assert calls == [(0, ["start"]), (BACKOFF_START, ["retry"])]      # retried once, after the back-off
    assert d.backoff == BACKOFF_START                                 # the good run reset it
    assert "run crashed" in out and "KeyError: 'a bug'" in out and "Traceback" in out
    crashes = d.metrics.registry.get_sample_value("reconciler_runs_total", {"result": "crash"})
    assert crashes == 1.0


def test_the_daemon_deploys_only_what_its_signing_policy_allows(tmp_path, capsys):
    """require_signed in the config: an unsigned head (written past the pre-receive hook, as a
    group member with a shell could) is refused before any host; signed, the run goes on to the
    host (none listens there: exit 4). A plaintext URL is refused before it is fetched."""
    from tests import signing
    from tests.conftest import DesiredRepo
    r = DesiredRepo(tmp_path / "r")
    r.write("fleet.toml", "")
    r.write("units/m.service", "[Service]\nExecStart=/usr/bin/server\n")
    r.write("hosts/a.toml", 'address = "127.0.0.9"\n[services.m]\nunit_file = "units/m.service"\n')
    head = signing.commit(r.path, "unsigned")
    key = signing.keypair(tmp_path)
    signers = signing.allowed_signers(tmp_path / "allowed_signers", key)
    d = Daemon(ControllerConfig(repo=str(r.path), state_dir=str(tmp_path / "state"), metrics="", web="",
                                require_signed=True, allowed_signers=str(signers)), interval=60)
    assert asyncio.run(d.run_once()) == 1
    log = (tmp_path / "state" / "runs" / f"{head}.log").read_text()
    assert f"refused: Unsigned: commit {head[:7]} is not signed" in log and "127.0.0.9" not in log
    assert d.pool.opened == 0 and d.store.status() == []
    assert d.metrics.registry.get_sample_value("reconciler_runs_total", {"result": "refused"}) == 1.0
    signing.git(r.path, "commit", "-q", "--amend", "--no-edit", "-S", key=key)
    signed = signing.git(r.path, "rev-parse", "HEAD").strip()
    assert asyncio.run(d.run_once()) == 4
    assert f"{signed[:7]}: signed by {signing.PRINCIPAL}" in (tmp_path / "state" / "runs" / f"{signed}.log").read_text()
    capsys.readouterr()
    plain = Daemon(ControllerConfig(repo="http://127.0.0.1:9/fleet.git", state_dir=str(tmp_path / "s2"), metrics="",
                                    web="", cache_dir=str(tmp_path / "mirrors")), interval=60)
    assert asyncio.run(plain.run_once()) == 1
    assert "refused: InsecureTransport" in capsys.readouterr().out and not (tmp_path / "mirrors").exists()


def test_the_daemons_runs_allow_the_drain_programs_of_its_own_config(tmp_path):
    """A [drain] `controller` call runs only what the controller's config allows (issue 42): the
    daemon's runs carry config.toml's drain_programs (or RECONCILER_DRAIN_PROGRAMS), none by default."""
    from reconciler.controller.config import load_config
    assert make(tmp_path).run_options().drain_programs == ()
    assert make(tmp_path, drain_programs=["socat", "/usr/local/bin/lb"]).run_options().drain_programs == (
        "socat", "/usr/local/bin/lb")
    (tmp_path / "config.toml").write_text('drain_programs = ["socat"]\n')
    assert load_config(tmp_path / "config.toml", environ={}).drain_programs == ["socat"]
    assert load_config(tmp_path / "config.toml", environ={"RECONCILER_DRAIN_PROGRAMS": "socat, lbctl"}
                       ).drain_programs == ["socat", "lbctl"]


def test_a_run_at_the_revision_of_the_last_takes_over_its_plans_and_a_new_revision_starts_afresh(
        tmp_path, monkeypatch):
    """plan_host is pure: the daemon's next run at the same revision (an interval run, no push)
    is handed the plans the last made (Revision.planned), so a host whose facts came back the same
    (host/programs.Seen) is not planned again; a run at another revision starts with none."""
    from reconciler.controller import daemon
    from reconciler.loop.results import FleetResult
    from tests.conftest import DesiredRepo
    r = DesiredRepo(tmp_path / "r")
    r.write("fleet.toml", "")
    r.write("units/m.service", "[Service]\nExecStart=/usr/bin/server\n")
    r.write("hosts/a.toml", 'address = "127.0.0.9"\n[services.m]\nunit_file = "units/m.service"\n')
    r.commit("one")
    handed: list[tuple[str, dict]] = []

    async def run_fleet(rev, opts, io):  # type: ignore[no-untyped-def]
        handed.append((rev.revision, rev.planned))
        rev.planned.setdefault("a", []).append(len(handed))      # as _HostRun._plan records a plan
        return FleetResult(rev.revision, dry_run=False)
    monkeypatch.setattr(daemon, "run_fleet", run_fleet)
    d = Daemon(ControllerConfig(repo=str(r.path), state_dir=str(tmp_path / "state"), metrics="", web="",
                                notes=False), interval=60)
    assert [asyncio.run(d.run_once()) for _ in range(2)] == [0, 0]
    r.write("hosts/a.toml", 'address = "127.0.0.10"\n[services.m]\nunit_file = "units/m.service"\n')
    r.commit("two")
    assert asyncio.run(d.run_once()) == 0
    (one, first), (same, second), (two, third) = handed
    assert one == same != two
    assert second is first and first == {"a": [1, 2]}
    assert third == {"a": [3]} and third is not first


def test_the_secret_warnings_of_a_tree_are_said_every_run_and_made_once(tmp_path, monkeypatch):
    """An env value that looks like a secret is warned about in every run's log (file and key,
    never the value), and worked out once per tree: an interval run at the same tree says the
    warnings it already made; a new tree's are made afresh."""
    from reconciler.controller import daemon
    from reconciler.loop.results import FleetResult
    from tests.conftest import DesiredRepo
    token = "hf_" + "aBcDeFgHiJkLmNoPqRsTuVwXyZ012345"
    r = DesiredRepo(tmp_path / "r")
    r.write("fleet.toml", "")
    r.write("units/m.service", "[Service]\nExecStart=/usr/bin/server\n")
    r.write("hosts/a.toml", f'address = "127.0.0.9"\n[services.m]\nunit_file = "units/m.service"\n'
                            f'env = {{ HF_TOKEN = "{token}" }}\n')
    one = r.commit("one")
    made: list[str] = []
    real = daemon.secret_warnings

    def counted(state, read=None):  # type: ignore[no-untyped-def]
        made.append(state.revision)
        return real(state, read)

    async def run_fleet(rev, opts, io):  # type: ignore[no-untyped-def]
        return FleetResult(rev.revision, dry_run=False)
    monkeypatch.setattr(daemon, "secret_warnings", counted)
    monkeypatch.setattr(daemon, "run_fleet", run_fleet)
    d = Daemon(ControllerConfig(repo=str(r.path), state_dir=str(tmp_path / "state"), metrics="", web="",
                                notes=False), interval=60)
    log = tmp_path / "state" / "runs" / f"{one}.log"
    for _ in range(2):
        log.unlink(missing_ok=True)
        assert asyncio.run(d.run_once()) == 0
        text = log.read_text()
        assert "hosts/a.toml: services.m.env.HF_TOKEN: warning: the value looks like" in text
        assert token not in text
    assert made == [one]
    r.write("hosts/a.toml", f'address = "127.0.0.10"\n[services.m]\nunit_file = "units/m.service"\n'
                            f'env = {{ HF_TOKEN = "{token}" }}\n')
    two = r.commit("two")
    assert asyncio.run(d.run_once()) == 0
    assert made == [one, two]
