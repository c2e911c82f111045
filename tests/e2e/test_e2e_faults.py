"""End-to-end fault injection on the real fleet (issue 12, item 6): the network cut or partitioned,
the controller killed, two controllers at once, a host rebooted inside the dead-man's switch
window, a full disk, the git remote gone.

Every fault is real: a TCP proxy (tests/proxy.py) between the controller and the host's sshd
resets (`cut`) or silently stops (`blackhole`) the connection; the controller is a `reconcile`
subprocess killed with SIGKILL; the host is a systemd-nspawn container that reboots; the disk is a
64 KiB tmpfs. The apply script on the host is held at the named points of its file writes with
RECONCILER_FAULT=pause-after-temp / pause-after-rename / pause-before-reload
(reconciler/faults.py), so the test acts exactly there; "health wait" acts once the host's record
says `pending.started`, before the verdict.

What must hold everywhere (checked by `check_converged` and the per-case checks):

    no half-written file   the unit and the env drop-in are always byte-identical to v1's or
                           v2's rendering (during the fault, after it, at the end); no
                           `.reconciler-tmp.*` is left once the next run is done
    the host runnable      the service is active/running at the end, on the version its record says
    one restart a run      each run causes at most one start of the service (systemd's "Started"
                           journal entries, counted per run); v1 -> v2 is exactly one in all
    nothing lost           the record is consistent at the end: pending None, quarantine None,
                           hash = last_good = v2; the dead-man's switch is disarmed

Each case's time to recover (from the fault to the end of the run that converges) is printed in
a table at the end of the session.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from reconciler.desired import load, source
from reconciler.plan.files import desired_files
from tests import fleet as fleetlib
from tests.conftest import FLEET_FIRST, FLEET_PREFIX, FLEET_SIZE, ROOT, DesiredRepo, Fleet, run_cli, run_json, wait_for
from tests.proxy import Proxy

pytestmark = pytest.mark.fleet

SVC = "m"
UNIT = f"/etc/systemd/system/{SVC}.service"
ENV_DIR = "/etc/reconciler/env"
ENV = f"{ENV_DIR}/{SVC}.env"            # the env file (its drop-in names it)
RECORD = f"/var/lib/reconciler/services/{SVC}.json"
LOCK = "/var/lib/reconciler/.lock"
SWITCH = f"/var/lib/reconciler/confirm/{SVC}.sh"      # an armed dead-man's switch's script
PAUSE = 4                   # seconds the apply script sleeps at a fault point
STARTED = "39f53479d3a045ac8e11786248231fbf"     # systemd's "Started <unit>" journal MESSAGE_ID

# The stand-in binds the host's own address (the hosts share the machine's network namespace),
# even when the controller reaches the host through the proxy on 127.0.0.1.
STANDIN_UNIT = """
[Unit]
Description=stand-in model server {service.name}@NOTE@

[Service]
Type=simple
ExecStart=/usr/bin/python3 -m sglang.launch_server --model-path {model.path} --host {vars.bind} --port {vars.port}
Restart=always
RestartSec=1

[Install]
WantedBy=multi-user.target
"""


# ---- the table of times to recover ------------------------------------------------------------


@dataclass
class Row:
    case: str
    outcome: str
    seconds: float


@pytest.fixture(scope="session")
def recovery_table(request) -> list[Row]:
    """Rows of (case, outcome, seconds to recover); printed after pytest's summary line."""
    rows: list[Row] = []

    def show() -> None:
        if not rows:
            return
        width = max(len(r.case) for r in rows)
        lines = ["", "fault-injection suite: time to recover (from the fault to the end of the converging run)",
                 f"{'case':<{width}}  {'seconds':>7}  outcome"]
        lines += [f"{r.case:<{width}}  {r.seconds:7.1f}  {r.outcome}" for r in rows]
        capman = request.config.pluginmanager.getplugin("capturemanager")
        with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
            print("\n".join(lines), flush=True)

    request.config.add_cleanup(show)
    return rows


# ---- desired state, controllers, host helpers --------------------------------------------------


def write_state(repo: DesiredRepo, h: fleetlib.Host, *, release: str, load_s: float = 1.0,
                via: int | None = None, startup_timeout: float = 12, note: str = "") -> None:
    """One service `m` on host h; `via`: the port of a proxy on 127.0.0.1 the controller goes through;
    `note`: added to the unit's Description (a change of the unit file, not only of the env)."""
    address, port = ("127.0.0.1", via) if via else (h.address, 22)
    pattern = f"[{address}]:{port}" if port != 22 else address
    repo.write("fleet.toml", '[ssh]\nuser = "root"\nknown_hosts = "known_hosts"\n')
    repo.write("known_hosts", f"{pattern} {fleetlib.host_public_key()}\n")
    repo.write("units/standin.service", STANDIN_UNIT.replace("@NOTE@", note))
    repo.write(f"hosts/{h.name}.toml", "\n".join([
        f'address = "{address}"', "", "[ssh]", f"port = {port}", "",
        f"[services.{SVC}]", 'unit_file = "units/standin.service"',
        f'vars = {{ port = "30000", bind = "{h.address}" }}',
        'model = { id = "Qwen/Qwen3-8B", path = "/models/Qwen3-8B" }',
        'health = { http = "http://{vars.bind}:{vars.port}/health", '
        f"startup_timeout = {startup_timeout}, stable_for = 1, interval = 0.5 }}",
        f'env = {{ STANDIN_LOAD_SECONDS = "{load_s}", RELEASE = "{release}" }}', ""]))


@dataclass(frozen=True)
class Rendering:
    """What a revision renders for service m on one host: its files and content hash."""

    revision: str
    unit: str
    env: str
    hash: str

    @property
    def shas(self) -> tuple[str, str]:
        return _sha(self.unit), _sha(self.env)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def rendering(repo: DesiredRepo, rev: str, host: str) -> Rendering:
    """The reconciler's own rendering of a revision (its loader, not the host's copy)."""
    state = load.load_desired(source.snapshot(source.open_repo(str(repo.path)), rev))
    svc = state.hosts[host].services[SVC]
    files = desired_files(svc)
    unit, env = files[UNIT], files[ENV]
    assert unit is not None and env is not None
    return Rendering(rev, unit, env, svc.content_hash())


def controller(repo: str, log: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A `reconcile --json` run in the background (stdout and stderr to files, never a full pipe)."""
    full = {**os.environ, "RECONCILER_IDENTITY": str(fleetlib.client_key_path()), "COLUMNS": "200",
            "NO_COLOR": "1", **(env or {})}
    with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
        return subprocess.Popen([sys.executable, "-m", "reconciler", "--repo", repo, "--json", *args],
                                stdout=out, stderr=err, env=full, cwd=ROOT, start_new_session=True)


def finished(p: subprocess.Popen, log: Path, timeout: float) -> tuple[int, dict]:
    """Wait for a controller; its exit status and JSON report ({} when it printed none)."""
    try:
        rc = p.wait(timeout)
    except subprocess.TimeoutExpired:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        raise AssertionError(f"the controller did not end within {timeout}s; stderr:\n"
                             f"{Path(f'{log}.err').read_text()[-3000:]}") from None
    out = Path(f"{log}.out").read_text()
    try:
        return rc, json.loads(out) if out.strip() else {}
    except json.JSONDecodeError:
        raise AssertionError(f"exit {rc}, not JSON:\n{out[-2000:]}\n{Path(f'{log}.err').read_text()[-2000:]}") \
            from None


def host_report(out: dict, name: str) -> dict:
    return next((r for r in out.get("hosts", []) if r["host"] == name), {})


def record(fleet: Fleet, h: fleetlib.Host) -> dict:
    text = fleet.ssh(h, f"cat {RECORD} 2>/dev/null", check=False)
    return json.loads(text) if text.strip() else {}


def file_shas(fleet: Fleet, h: fleetlib.Host) -> tuple[str, str]:
    out = fleet.ssh(h, f"for f in {UNIT} {ENV}; do if [ -e $f ]; then sha256sum < $f | cut -d' ' -f1; "
                       "else echo none; fi; done")
    unit, env = out.split()
    return unit, env


def temp_files(fleet: Fleet, h: fleetlib.Host) -> str:
    return fleet.ssh(h, "find /etc/systemd/system /etc/reconciler /var/lib/reconciler -name '.reconciler-tmp.*' "
                        "2>/dev/null",
                     check=False).strip()


def starts(fleet: Fleet, h: fleetlib.Host, since: float) -> list[float]:
    """When systemd started the service (every start or restart, automatic ones included)."""
    out = fleet.ssh(h, f"journalctl --since @{int(since) - 1} -o json --no-pager UNIT={SVC}.service "
                       f"MESSAGE_ID={STARTED}", check=False)
    stamps = [int(json.loads(line)["__REALTIME_TIMESTAMP"]) / 1e6 for line in out.splitlines() if line.strip()]
    return sorted(t for t in stamps if t >= since)


def between(stamps: list[float], a: float, b: float) -> int:
    return sum(1 for t in stamps if a <= t < b)


def process_release(fleet: Fleet, h: fleetlib.Host) -> str:
    """RELEASE in the environment of the service's running process (what really runs)."""
    pid = fleet.show(h, SVC, "MainPID")["MainPID"]
    env = fleet.ssh(h, f"tr '\\0' '\\n' < /proc/{pid}/environ", check=False)
    return next((line.split("=", 1)[1] for line in env.splitlines() if line.startswith("RELEASE=")), "")


def settled(fleet: Fleet, h: fleetlib.Host) -> bool:
    """No apply script left on the host and its lock free."""
    out = fleet.ssh(h, f"pgrep -fx 'sh -s' >/dev/null && echo busy; flock -n {LOCK} true || echo locked",
                    check=False)
    return not out.strip()


def deploy_v1(fleet: Fleet, repo: DesiredRepo, h: fleetlib.Host, **kw: object) -> Rendering:
    write_state(repo, h, release="v1", **kw)  # type: ignore[arg-type]
    c1 = repo.commit("v1")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    v1 = rendering(repo, c1, h.name)
    assert file_shas(fleet, h) == v1.shas
    assert fleet.show(h, SVC, "ActiveState")["ActiveState"] == "active"
    return v1


def switch_timer(fleet: Fleet, h: fleetlib.Host) -> str:
    """The ActiveState of the switch's transient timer ("inactive" once it is gone)."""
    return fleet.show(h, f"reconciler-confirm-{SVC}.timer", "ActiveState")["ActiveState"]


def check_converged(fleet: Fleet, h: fleetlib.Host, v2: Rendering) -> None:
    """The end state every case must reach: v2 written, running, verified, nothing pending or armed."""
    assert file_shas(fleet, h) == v2.shas
    assert not temp_files(fleet, h), temp_files(fleet, h)
    p = fleet.show(h, SVC, "ActiveState", "SubState")
    assert (p["ActiveState"], p["SubState"]) == ("active", "running"), p
    assert process_release(fleet, h) == "v2"
    rec = record(fleet, h)
    assert rec["pending"] is None and rec["quarantine"] is None, rec
    assert rec["hash"] == rec["last_good_hash"] == v2.hash and rec["last_good_revision"] == v2.revision, rec
    assert not fleet.exists(h, SWITCH), "the dead-man's switch is still armed"
    assert switch_timer(fleet, h) == "inactive", "the dead-man's switch's timer is still there"


# ---- 0. the proxy itself ----------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_the_proxy_cuts_with_an_rst_blackholes_without_closing_and_heals():
    """The tool the cases rely on: cut() resets both sides (ECONNRESET, never a clean EOF) and
    refuses new connections until heal(); blackhole() forwards nothing yet closes nothing, and what
    was sent meanwhile arrives, in order, after heal()."""
    upstream_saw: list[str] = []
    srv = socket.create_server(("127.0.0.1", 0))

    def echo(conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
                upstream_saw.append("eof")
            except ConnectionResetError:
                upstream_saw.append("reset")

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                threading.Thread(target=echo, args=(srv.accept()[0],), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        with Proxy(("127.0.0.1", srv.getsockname()[1])) as p:
            c = socket.create_connection(("127.0.0.1", p.port), timeout=5)
            c.sendall(b"ping")
            assert c.recv(16) == b"ping"
            p.blackhole()
            c.sendall(b"held")
            c.settimeout(1)
            with pytest.raises(TimeoutError):
                c.recv(16)
            assert p.open_connections() == 1 and not upstream_saw     # nothing closed
            p.heal()
            c.settimeout(5)
            assert c.recv(16) == b"held"
            p.cut()
            with pytest.raises(ConnectionResetError):
                c.recv(16)
            wait_for("the upstream side to be reset", lambda: upstream_saw == ["reset"], timeout=5)
            # accepted, then reset at once: the RST can land before create_connection's own
            # connect check (SO_ERROR after a non-blocking connect) or at the first recv
            opened = [c]
            with pytest.raises(ConnectionResetError):
                opened.append(socket.create_connection(("127.0.0.1", p.port), timeout=5))
                opened[-1].recv(16)
            p.heal()
            again = socket.create_connection(("127.0.0.1", p.port), timeout=5)
            opened.append(again)
            again.sendall(b"back")
            assert again.recv(16) == b"back"
            for s_ in opened:
                s_.close()
    finally:
        srv.close()


# ---- 1. cut, blackhole, SIGKILL at four points of a change -------------------------------------

# How the test knows the host is at the point (a plain ssh command that prints "yes").
_PAUSED = f"pgrep -fx 'sleep {PAUSE}' >/dev/null"
POINTS = {
    "after-temp": ("pause-after-temp", f"{_PAUSED} && ls -A {ENV_DIR} | grep -q '^[.]reconciler-tmp[.]' "
                                       "&& echo yes"),
    "after-rename": ("pause-after-rename", f"{_PAUSED} && grep -q 'RELEASE=\"v2\"' {ENV} && echo yes"),
    # (v2 changes the unit too at this point: an env change alone takes no daemon-reload)
    "before-reload": ("pause-before-reload", f"{_PAUSED} && grep -q 'RELEASE=\"v2\"' {ENV} && test -f {SWITCH} "
                                             "&& echo yes"),
    "health-wait": ("", None),
}
FAULTS = ("cut", "blackhole", "sigkill")

# What the interrupted run must end with: its exit status, and (where one is printed) its reason.
# A connection lost anywhere (the apply script, the health wait) is Unreachable: see the test after
# this one.
OUTCOME = {
    "cut": 4,
    "blackhole": 4,                 # found by SSH keepalives (5 s x 3) within 60 s, never a hang
    "sigkill": -9,
}


def at_point(fleet: Fleet, h: fleetlib.Host, point: str) -> bool:
    cmd = POINTS[point][1]
    if cmd is not None:
        return fleet.ssh(h, cmd, check=False).strip() == "yes"
    pending = record(fleet, h).get("pending") or {}
    return bool(pending.get("started")) and process_release(fleet, h) == "v2"


@dataclass
class Interrupted:
    """A run interrupted by a fault: its exit status and report, and when things happened."""

    rc: int
    report: dict
    t_run: float        # the run started
    t_fault: float      # the fault hit
    ended: float        # seconds from the fault to the run's end


def interrupt(fleet: Fleet, h: fleetlib.Host, proxy: Proxy, repo: DesiredRepo, log: Path, fault: str,
              point: str, allowed: set[tuple[str, str]]) -> Interrupted:
    """Start a run of the committed change, hit it with `fault` at `point`, wait for it to end."""
    t_run = time.time()
    env = {"RECONCILER_FAULT": POINTS[point][0], "RECONCILER_FAULT_PAUSE": str(PAUSE)} if POINTS[point][0] else {}
    ctl = controller(str(repo.path), log, env=env)

    def reached() -> bool:
        if ctl.poll() is not None:
            raise AssertionError(f"the run ended (exit {ctl.returncode}) before the host reached {point}:\n"
                                 f"{Path(f'{log}.err').read_text()[-3000:]}")
        return at_point(fleet, h, point)

    wait_for(f"the host at {point}", reached, timeout=40, every=0.05)
    t_fault = time.time()
    if fault == "cut":
        proxy.cut()
    elif fault == "blackhole":
        proxy.blackhole()
    else:
        os.kill(ctl.pid, signal.SIGKILL)
    assert file_shas(fleet, h) in allowed          # during the fault
    rc, out = finished(ctl, log, timeout=75)
    return Interrupted(rc, host_report(out, h.name), t_run, t_fault, time.time() - t_fault)


def heal_and_settle(fleet: Fleet, h: fleetlib.Host, proxy: Proxy) -> None:
    """Heal the network; the interrupted run's script on the host then ends at its next output
    (its connection is gone: trap, clean-up of its temp files) and the host lock is free."""
    proxy.heal()
    wait_for("the host to settle", lambda: settled(fleet, h), timeout=PAUSE + 20, every=0.3)


def change(fleet: Fleet, repo: DesiredRepo, h: fleetlib.Host, proxy: Proxy, load_s: float,
           unit_too: bool = False) -> tuple[Rendering, Rendering]:
    """v1 deployed and healthy through the proxy; v2 (an env change, and a unit change with
    `unit_too`) committed."""
    v1 = deploy_v1(fleet, repo, h, via=proxy.port, load_s=load_s)
    write_state(repo, h, release="v2", via=proxy.port, load_s=load_s, note=" (v2)" if unit_too else "")
    return v1, rendering(repo, repo.commit("v2: an env change"), h.name)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("point", list(POINTS))
@pytest.mark.parametrize("fault", FAULTS)
def test_a_change_interrupted_by_a_fault_is_never_half_applied_and_the_next_run_converges(
        fleet, repo, tmp_path, recovery_table, fault, point):
    """v1 healthy; v2 (an env change) deploys through the proxy and is interrupted at `point` by
    `fault`. The interrupted run ends by itself (cut, blackhole: exit 4, a blackhole within 60 s
    through keepalives, Unreachable when it hit the health wait; SIGKILL: -9); the host is on v1's
    or v2's files, never anything else, during and after the fault, and the service stays active;
    after heal(), the next run exits 0 with v2 healthy (re-applying a cut-short deploy, or
    re-verifying one that had started); the service started exactly once over both runs (at most
    once per run); the record ends consistent and the switch disarmed."""
    h = fleet.hosts[0]
    load_s = 4.0 if point == "health-wait" else 1.5
    with Proxy((h.address, 22)) as proxy:
        v1, v2 = change(fleet, repo, h, proxy, load_s, unit_too=point == "before-reload")
        allowed = {v1.shas, v2.shas}
        try:
            it = interrupt(fleet, h, proxy, repo, tmp_path / "interrupted", fault, point, allowed)
        except BaseException:
            with contextlib.suppress(AssertionError):     # leave the host quiet for the next test
                heal_and_settle(fleet, h, proxy)
            raise
        assert it.rc == OUTCOME[fault], it
        reason = it.report.get("reason")
        if fault != "sigkill":
            assert reason == "Unreachable", it.report      # wherever the connection was lost
        if fault == "blackhole":
            assert it.ended < 60, f"a blackholed run took {it.ended:.0f}s to give up"
        heal_and_settle(fleet, h, proxy)
        assert file_shas(fleet, h) in allowed          # after the fault, before any repair
        assert fleet.show(h, SVC, "ActiveState")["ActiveState"] == "active"

        t_next = time.time()
        code, nxt = run_json("--repo", str(repo.path), check_codes=(0,))
        t_end = time.time()
        check_converged(fleet, h, v2)
        stamps = starts(fleet, h, it.t_run)
        by_fault, by_next = between(stamps, it.t_run, t_next), between(stamps, t_next, t_end + 1)
        assert by_fault <= 1 and by_next <= 1 and by_fault + by_next == 1, (by_fault, by_next, stamps)

    action = next((e["action"] for e in host_report(nxt, h.name)["events"] if e["service"] == SVC), "-")
    first = f"exit {it.rc}" + (f" {reason}" if reason else "") + (f" after {it.ended:.0f}s" if fault == "blackhole"
                                                                   else "")
    recovery_table.append(Row(f"1 {fault} @ {point}", f"{first}; next run exit 0 ({action}); "
                                                      f"starts {by_fault}+{by_next}", t_end - it.t_fault))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["cut", "blackhole"])
def test_a_connection_lost_during_the_apply_is_reported_unreachable(fleet, repo, tmp_path, fault):
    """The run cut off from its host in the middle of the apply script says so: Unreachable, and
    no internal protocol text in its message."""
    h = fleet.hosts[0]
    with Proxy((h.address, 22)) as proxy:
        v1, v2 = change(fleet, repo, h, proxy, 1.5)
        try:
            it = interrupt(fleet, h, proxy, repo, tmp_path / "interrupted", fault, "after-temp", {v1.shas, v2.shas})
        finally:
            heal_and_settle(fleet, h, proxy)
    assert it.rc == 4, it
    assert it.report["reason"] == "Unreachable" and "@@" not in it.report["message"], it.report


# ---- 2. two controllers at once ----------------------------------------------------------------


@pytest.mark.timeout(120)
def test_two_controllers_at_once_one_deploys_the_other_is_locked_out(fleet, repo, tmp_path, recovery_table):
    """Two `reconcile --lock-wait 2` start together on a change: exactly one deploys (exit 0); the
    other reports Locked (exit 4) or, had it got the lock after the first finished, finds the host
    in sync (exit 0, nothing done). The service started exactly once."""
    h = fleet.hosts[0]
    deploy_v1(fleet, repo, h, load_s=4.0)
    write_state(repo, h, release="v2", load_s=4.0)
    v2 = rendering(repo, repo.commit("v2"), h.name)
    t0 = time.time()
    ctls = [controller(str(repo.path), tmp_path / f"c{i}", "--lock-wait", "2") for i in (1, 2)]
    results = [finished(c, tmp_path / f"c{i}", timeout=60) for i, c in zip((1, 2), ctls, strict=True)]
    t_end = time.time()
    reports = [(rc, host_report(out, h.name)) for rc, out in results]
    deployed = [(rc, r) for rc, r in reports if any(e["action"] == "deploy" for e in r.get("events", []))]
    others = [(rc, r) for rc, r in reports if (rc, r) not in deployed]
    assert len(deployed) == 1 and deployed[0][0] == 0, reports
    (orc, other), = others
    assert (orc, other["reason"]) == (4, "Locked") or (orc == 0 and other["states"] == {SVC: "InSync"}), other
    if orc == 4:
        assert "another reconcile holds" in other["message"] and "changed nothing" in other["message"]
    check_converged(fleet, h, v2)
    assert len(starts(fleet, h, t0)) == 1
    how = "Locked (exit 4)" if orc == 4 else "in sync (exit 0)"
    recovery_table.append(Row("2 two controllers", f"one deployed (exit 0), the other {how}; 1 start",
                              t_end - t0))


# ---- 3. the host reboots inside the dead-man's switch window -----------------------------------


class RebootableHost:
    """A test host whose files survive a reboot: a container booted from a plain copy of the
    rootfs (not --volatile=overlay, whose writes live in a tmpfs, nor --ephemeral, whose copy
    systemd-nspawn deletes when it exits). When the container reboots, systemd-nspawn exits with
    status 133 and this supervisor boots it again on the same directory, as systemd-nspawn@.service
    does (RestartForceExitStatus=133)."""

    def __init__(self, name: str, address: str, workdir: Path):
        self.host = fleetlib.Host(name, address, 0)
        self.dir = workdir / "rootfs"
        self.conf = workdir / "sshd.conf"
        self.log = workdir / "console.log"
        self.exits: list[int] = []
        self.boots = 0
        self._lock = threading.Lock()
        self._stopping = False
        self._proc: subprocess.Popen | None = None
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        subprocess.run(["cp", "-a", "--reflink=auto", str(fleetlib.rootfs_path()), str(self.dir)], check=True)
        self.conf.write_text(f"ListenAddress {self.host.address}:22\nPermitRootLogin prohibit-password\n"
                             "UseDNS no\n")
        self._boot()
        self._watcher = threading.Thread(target=self._supervise, daemon=True)
        self._watcher.start()
        self.wait_ready()

    def _boot(self) -> None:
        cmd = ["systemd-nspawn", "-q", "-b", "-D", str(self.dir), "-M", self.host.name,
               "--register=no", "--keep-unit",
               f"--bind-ro={self.conf}:/etc/ssh/sshd_config.d/test.conf",
               f"--bind-ro={fleetlib.STANDIN}:/usr/local/bin/sglang-standin",
               f"--bind-ro={fleetlib.HOSTPKG / 'sglang'}:{fleetlib.SITE}/sglang",
               f"--bind-ro={fleetlib.MODELS}:/models"]
        with open(self.log, "ab") as log:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        self.host.pid = self._proc.pid
        self.boots += 1

    def _supervise(self) -> None:
        while True:
            proc = self._proc
            assert proc is not None
            rc = proc.wait()
            with self._lock:
                self.exits.append(rc)
                if rc != 133 or self._stopping:
                    return
                self._boot()

    def wait_ready(self, timeout: float = 60) -> None:
        fleetlib.wait_ready([self.host], timeout)

    def wait_rebooted(self, boots_before: int, timeout: float = 60) -> None:
        wait_for("the container to reboot", lambda: self.boots > boots_before, timeout, every=0.1)
        self.wait_ready(timeout)

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            proc = self._proc
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        if self._watcher is not None:
            self._watcher.join(5)


@pytest.fixture
def rebootable(fleet_session) -> Iterator[tuple[RebootableHost, Fleet]]:
    """An extra host, next to the session's fleet (its address is the first one after it)."""
    n = FLEET_FIRST + FLEET_SIZE
    work = Path(tempfile.mkdtemp(prefix=f"reconciler-{FLEET_PREFIX}{n}-", dir="/var/tmp"))
    box = RebootableHost(f"{FLEET_PREFIX}{n}", f"127.0.0.{n}", work)
    try:
        box.start()
        kh = fleetlib.write_known_hosts([box.host], work / "known_hosts")
        yield box, Fleet([box.host], kh)
    finally:
        box.stop()
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.timeout(180)
def test_a_host_rebooted_inside_the_switch_window_rolls_itself_back_after_boot(
        rebootable, repo, tmp_path, monkeypatch, recovery_table):
    """v1 healthy; v2 deployed by a controller killed in the health watch (RECONCILER_FAULT=in-watch),
    so the dead-man's switch stays armed (window = startup 9 + stable 1 + margin 5 = 15 s); the
    container reboots at once. After boot the switch is armed again (its timer is transient; the
    unit the first arm installed arms it at boot), counts the window again and fires by itself:
    v1's files are back and run, the record says v2 is quarantined (NotConfirmed) with nothing
    pending, the switch is gone. The next `reconcile` exits 3 and restarts nothing."""
    box, fleet = rebootable
    h = box.host
    monkeypatch.setenv("RECONCILER_CONFIRM_MARGIN", "5")
    v1 = deploy_v1(fleet, repo, h, startup_timeout=9)
    write_state(repo, h, release="v2", startup_timeout=9)
    v2 = rendering(repo, repo.commit("v2"), h.name)

    ctl = controller(str(repo.path), tmp_path / "killed", env={"RECONCILER_FAULT": "in-watch"})
    rc, _ = finished(ctl, tmp_path / "killed", timeout=60)
    assert rc == -9
    # the lock's holder armed the switch as the controller went
    wait_for("the holder to arm the switch", lambda: switch_timer(fleet, h) == "active", timeout=5)
    assert (record(fleet, h)["pending"] or {}).get("revision") == v2.revision

    t_fault = time.time()
    boots = box.boots
    fleet.ssh(h, "systemctl reboot", check=False)
    box.wait_rebooted(boots)
    t_up = time.time()
    assert box.exits[-1] == 133
    # Rebooted inside the window: the switch has not fired yet, and it is armed again after boot.
    rec = record(fleet, h)
    assert rec["pending"]["revision"] == v2.revision and rec["quarantine"] is None, rec
    # the timer is transient: reconciler-rearm-switches.service arms it again at boot
    wait_for("the switch armed again at boot", lambda: switch_timer(fleet, h) == "active", timeout=10, every=0.2)
    assert file_shas(fleet, h) == v2.shas

    wait_for("the switch to fire after boot", lambda: (record(fleet, h).get("quarantine") or {}).get("reason")
             == "NotConfirmed", timeout=45, every=0.5)
    t_fired = time.time()
    wait_for("v1 to run", lambda: process_release(fleet, h) == "v1"
             and fleet.show(h, SVC, "ActiveState")["ActiveState"] == "active", timeout=20, every=0.3)
    ran = fleet.ssh(h, f"journalctl -o json --no-pager -u reconciler-confirm-{SVC}.service", check=False)
    assert any(int(json.loads(x)["__REALTIME_TIMESTAMP"]) / 1e6 >= t_up for x in ran.splitlines() if x.strip())
    rec = record(fleet, h)
    assert rec["pending"] is None and rec["hash"] == rec["last_good_hash"] == v1.hash, rec
    q = rec["quarantine"]
    assert (q["hash"], q["revision"], q["reason"]) == (v2.hash, v2.revision, "NotConfirmed"), q
    assert file_shas(fleet, h) == v1.shas and not temp_files(fleet, h)
    assert not fleet.exists(h, SWITCH) and switch_timer(fleet, h) == "inactive"

    inv = fleet.show(h, SVC, "InvocationID")["InvocationID"]
    code, out = run_json("--repo", str(repo.path), check_codes=(3,))
    t_end = time.time()
    r = host_report(out, h.name)
    assert "quarantined (NotConfirmed)" in (r["message"] or ""), r
    assert fleet.show(h, SVC, "InvocationID")["InvocationID"] == inv
    recovery_table.append(Row("3 reboot in switch window",
                              f"rebooted in {t_up - t_fault:.1f}s; switch fired {t_fired - t_up:.0f}s after boot "
                              f"-> v1, NotConfirmed; next run exit 3, no restart", t_end - t_fault))


# ---- 4. a full disk during a write --------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_full_disk_fails_the_write_and_leaves_the_old_version_untouched(fleet, repo, recovery_table):
    """The env file's directory is a full 64 KiB tmpfs (holding v1's env file, byte for byte):
    the run fails (exit 4, ApplyFailed naming the write and ENOSPC), v1 keeps running untouched
    (same process, same files, no temp file left, nothing started, no switch armed), the record
    keeps v1 and says what was attempted (pending v2, not started). Unmounted, the next run
    converges."""
    h = fleet.hosts[0]
    v1 = deploy_v1(fleet, repo, h)
    write_state(repo, h, release="v2")
    v2 = rendering(repo, repo.commit("v2"), h.name)
    inv = fleet.show(h, SVC, "InvocationID")["InvocationID"]
    t_fault = time.time()
    fleet.ssh(h, f"cp -a {ENV} /run/fi-env && mount -t tmpfs -o size=64k,mode=0755 fi-full {ENV_DIR} && "
                 f"cp -a /run/fi-env {ENV} && {{ dd if=/dev/zero of={ENV_DIR}/.fill bs=4k 2>/dev/null; true; }} "
                 f"&& test \"$(df --output=avail {ENV_DIR} | tail -1 | tr -d ' ')\" = 0")
    try:
        code, out = run_json("--repo", str(repo.path), check_codes=(4,))
        r = host_report(out, h.name)
        assert r["reason"] == "ApplyFailed", r
        assert f"write {ENV}" in r["message"] and "No space left on device" in r["message"], r["message"]
        assert file_shas(fleet, h) == v1.shas
        assert fleet.ssh(h, f"ls -A {ENV_DIR}").split() == [".fill", f"{SVC}.env"]
        assert not temp_files(fleet, h)
        p = fleet.show(h, SVC, "InvocationID", "ActiveState", "NeedDaemonReload")
        assert (p["InvocationID"], p["ActiveState"]) == (inv, "active"), p
        assert process_release(fleet, h) == "v1"
        assert not fleet.exists(h, SWITCH) and switch_timer(fleet, h) == "inactive"
        rec = record(fleet, h)
        assert rec["hash"] == rec["last_good_hash"] == v1.hash and rec["quarantine"] is None, rec
        assert rec["pending"]["hash"] == v2.hash and not rec["pending"]["started"], rec
    finally:
        fleet.ssh(h, f"umount {ENV_DIR}; rm -f /run/fi-env", check=False)
    t_next = time.time()
    run_cli("--repo", str(repo.path), check_codes=(0,))
    t_end = time.time()
    check_converged(fleet, h, v2)
    stamps = starts(fleet, h, t_fault)
    assert between(stamps, t_fault, t_next) == 0 and len(stamps) == 1, stamps
    recovery_table.append(Row("4 full disk (env write)", "exit 4 ApplyFailed (ENOSPC), v1 untouched; "
                                                        "unmounted: next run exit 0", t_end - t_fault))


# ---- 5. the git remote gone ---------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_the_git_remote_gone_fails_cleanly_and_changes_nothing(fleet, repo, recovery_table):
    """`--repo file:///...` (mirrored into the cache): once the remote directory is moved away, a
    run exits 1 with a one-line SourceError naming the repo (no traceback) and touches no host;
    with the remote back, the next run converges."""
    h = fleet.hosts[0]
    url = f"file://{repo.path}"
    write_state(repo, h, release="v1")
    c1 = repo.commit("v1")
    run_cli("--repo", url, check_codes=(0,))
    assert file_shas(fleet, h) == rendering(repo, c1, h.name).shas
    write_state(repo, h, release="v2")
    v2 = rendering(repo, repo.commit("v2"), h.name)
    before = fleet.ssh(h, "find /var/lib/reconciler /etc/systemd/system -type f | sort | xargs sha256sum")
    inv = fleet.show(h, SVC, "InvocationID")["InvocationID"]

    gone = repo.path.with_name("remote-moved-away")
    t_fault = time.time()
    repo.path.rename(gone)
    try:
        res = run_cli("--repo", url, check_codes=(1,))
        # One error, no traceback (and on one line: see the test below).
        assert res.stderr.startswith(f"error: cannot fetch {url}: ") and res.stderr.count("error:") == 1, res.stderr
        assert "Traceback" not in res.stderr + res.stdout and not res.stdout.strip()
        code, out = run_json("--repo", url, check_codes=(1,))
        assert out["error"] == "SourceError" and out["message"].startswith(f"cannot fetch {url}: "), out
        assert "\n" not in out["message"].strip(), out
        assert fleet.ssh(h, "find /var/lib/reconciler /etc/systemd/system -type f | sort | xargs sha256sum") == before
        assert fleet.show(h, SVC, "InvocationID")["InvocationID"] == inv
    finally:
        gone.rename(repo.path)
    run_cli("--repo", url, check_codes=(0,))
    t_end = time.time()
    check_converged(fleet, h, v2)
    recovery_table.append(Row("5 git remote gone", "exit 1 SourceError, no traceback, host untouched; "
                                                  "remote back: next run exit 0", t_end - t_fault))


@pytest.mark.timeout(60)
def test_the_source_error_of_a_gone_remote_is_one_line_in_a_pipe(repo):
    """What a log or CI sees of a gone remote: exactly one `error:` line (not wrapped)."""
    url = f"file://{repo.path}"
    write_state(repo, fleetlib.Host("gone", "127.0.0.9", 0), release="v1")
    repo.commit("v1")
    run_cli("validate", "--repo", url, check_codes=(0,))       # mirrored into the cache
    gone = repo.path.with_name("remote-moved-away")
    repo.path.rename(gone)
    try:
        env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
        res = subprocess.run([sys.executable, "-m", "reconciler", "--repo", url], capture_output=True, text=True,
                             env=env, timeout=60, cwd=ROOT)
    finally:
        gone.rename(repo.path)
    assert res.returncode == 1 and res.stderr.startswith(f"error: cannot fetch {url}: "), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


# ---- 7. kills at many offsets, two hosts, a service that cannot fail (issue 32) ----------------

SLEEPER = "rel-kill"
SLEEPER_UNIT = ("[Unit]\nDescription=a service that cannot fail\n\n[Service]\nExecStart=/bin/sleep infinity\n"
                "Restart=always\nRestartSec=1\n\n[Install]\nWantedBy=multi-user.target\n")
# From 0.1 s (the run is still loading and connecting) to 2 s (its health watch): every point
# of a run in between, on a 2-core machine (a whole run here takes 1.5-2.5 s).
KILL_OFFSETS = [round(0.1 * i, 1) for i in range(1, 21)]


def write_sleepers(repo: DesiredRepo, hosts: list[fleetlib.Host], value: str) -> str:
    """Service rel-kill (`sleep infinity`, systemd-only health) on every host, env V=value; commits."""
    repo.write("fleet.toml", '[ssh]\nuser = "root"\nknown_hosts = "known_hosts"\n\n'
                             "[health]\nstartup_timeout = 30\ninterval = 0.5\nstable_for = 1\n")
    repo.write("known_hosts", "".join(h.known_hosts_line() + "\n" for h in hosts))
    repo.write("units/sleeper.service", SLEEPER_UNIT)
    for h in hosts:
        repo.write(f"hosts/{h.name}.toml", f'address = "{h.address}"\n\n[services.{SLEEPER}]\n'
                                           f'unit_file = "units/sleeper.service"\nenv = {{ V = "{value}" }}\n')
    return repo.commit(value)


def sleeper_state(fleet: Fleet, h: fleetlib.Host) -> dict:
    """What runs on the host: the process's V, systemd's state, the record, any temp file."""
    pid = fleet.show(h, SLEEPER, "MainPID")["MainPID"]
    env = fleet.ssh(h, f"tr '\\0' '\\n' < /proc/{pid}/environ 2>/dev/null", check=False)
    rec_text = fleet.ssh(h, f"cat /var/lib/reconciler/services/{SLEEPER}.json 2>/dev/null", check=False)
    return {"V": next((x[2:] for x in env.splitlines() if x.startswith("V=")), None),
            "active": fleet.show(h, SLEEPER, "ActiveState")["ActiveState"],
            "record": json.loads(rec_text) if rec_text.strip() else {}, "temps": temp_files(fleet, h)}


def assert_sleepers_run(fleet: Fleet, hosts: list[fleetlib.Host], value: str, revision: str, what: str) -> None:
    for h in hosts:
        got = sleeper_state(fleet, h)
        rec = got["record"]
        assert (got["V"], got["active"]) == (value, "active"), (what, h.name, got)
        assert rec["pending"] is None and rec["quarantine"] is None, (what, h.name, rec)
        assert rec["hash"] == rec["last_good_hash"] and rec["last_good_revision"] == revision, (what, h.name, rec)
        assert got["temps"] == "", (what, h.name, got["temps"])


@pytest.mark.timeout(600)
def test_a_run_after_a_kill_at_any_offset_deploys_the_new_version_on_both_hosts(fleet, repo, tmp_path,
                                                                                 recovery_table):
    # Issue 32: the run after a killed one rolled a host back and quarantined the new, healthy
    # version as CrashLoop, and a killed run's temp file stayed for good. Here the controller is
    # killed (SIGKILL) at 20 offsets; each time the next run must end with the new version
    # running on both hosts (exit 0), nothing quarantined, and no temp file left anywhere.
    hosts = fleet.hosts[:2]
    write_sleepers(repo, hosts, "k0")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    failures = []
    t0 = time.monotonic()
    for i, offset in enumerate(KILL_OFFSETS, 1):
        value = f"k{i}"
        rev = write_sleepers(repo, hosts, value)
        p = controller(str(repo.path), tmp_path / f"kill{i}")
        time.sleep(offset)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        res = run_cli("--repo", str(repo.path))
        if res.returncode != 0:
            failures.append(f"kill at {offset}s: the next run exited {res.returncode}:\n{res.stdout[-1500:]}")
            run_cli("--repo", str(repo.path), "--retry")
            continue
        assert_sleepers_run(fleet, hosts, value, rev, f"after the kill at {offset}s")
    assert failures == [], "\n\n".join(failures)
    recovery_table.append(Row(f"kill at {len(KILL_OFFSETS)} offsets, two hosts (whole loop)", "converged",
                              time.monotonic() - t0))


@pytest.mark.timeout(300)
def test_plain_changes_after_killed_and_concurrent_runs_all_exit_0(fleet, repo, tmp_path):
    # Issue 32: "once, a plain change run with no kill at all, right after the first deploy,
    # exited 3". After a killed run and two runs at once, 20 plain changes in a row: exit 0 each.
    hosts = fleet.hosts[:2]
    write_sleepers(repo, hosts, "p0")
    p = controller(str(repo.path), tmp_path / "killed")
    time.sleep(0.8)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    write_sleepers(repo, hosts, "p1")
    both = [controller(str(repo.path), tmp_path / f"both{n}") for n in (1, 2)]
    codes = [finished(c, tmp_path / f"both{n}", 120)[0] for n, c in enumerate(both, 1)]
    assert codes == [0, 0], codes             # the second waits for the first's lock, then finds it done
    for i in range(2, 22):
        rev = write_sleepers(repo, hosts, f"p{i}")
        res = run_cli("--repo", str(repo.path))
        assert res.returncode == 0, f"plain change {i - 1} exited {res.returncode}:\n{res.stdout[-2000:]}"
        assert_sleepers_run(fleet, hosts, f"p{i}", rev, f"plain change {i - 1}")


@pytest.mark.timeout(300)
def test_two_runs_at_once_on_the_same_two_hosts_never_wait_for_each_other(fleet, repo, tmp_path):
    # CI of 2026-12-03: two runs started together each took one host's lock at once, then waited
    # for the other's (lock_wait, 30 s) and both ended Locked, exit 4, changing nothing there. A
    # run's first try at a lock never waits; one that meets a held lock lets go of its own and
    # takes them again in the order of the hosts' names. Eight pairs: both exit 0 every time.
    hosts = fleet.hosts[:2]
    write_sleepers(repo, hosts, "c0")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    for i in range(1, 9):
        rev = write_sleepers(repo, hosts, f"c{i}")
        pair = [controller(str(repo.path), tmp_path / f"pair{i}-{n}") for n in (1, 2)]
        ended = [finished(c, tmp_path / f"pair{i}-{n}", 120) for n, c in enumerate(pair, 1)]
        assert [rc for rc, _ in ended] == [0, 0], (i, [[(h["host"], h.get("reason"), h.get("message"))
                                                        for h in out.get("hosts", [])] for _, out in ended])
        assert_sleepers_run(fleet, hosts, f"c{i}", rev, f"pair {i}")


@pytest.mark.timeout(120)
def test_temp_files_a_killed_run_left_are_named_by_the_dry_run_and_removed(fleet, repo):
    # What a run killed mid-write leaves (its script got no chance to clean up): temp files
    # beside the unit, the env file and the records. The dry run names each; the next run
    # removes them under the host lock, whatever else it has to do (here: nothing).
    h = fleet.hosts[0]
    rev = write_sleepers(repo, [h], "t0")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    left = ["/etc/systemd/system/.reconciler-tmp.4242.1", f"/etc/systemd/system/{SLEEPER}.service.d/"
            ".reconciler-tmp.4242.2", "/etc/reconciler/env/.reconciler-tmp.4242.3",
            "/var/lib/reconciler/services/.reconciler-tmp.abc123"]
    fleet.ssh(h, " && ".join(f"echo half > {p}" for p in left))
    dry = run_cli("--repo", str(repo.path), "--dry-run", check_codes=(2,))
    for p in left:
        assert f"remove {p}" in dry.stdout, dry.stdout
    assert "interrupted run" in dry.stdout
    run_cli("--repo", str(repo.path), check_codes=(0,))
    assert temp_files(fleet, h) == ""
    assert_sleepers_run(fleet, [h], "t0", rev, "after the clean-up")
    res = run_cli("--repo", str(repo.path), check_codes=(0,))
    assert "in sync" in res.stdout
