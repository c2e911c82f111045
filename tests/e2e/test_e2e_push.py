"""End-to-end: git push to deploy (issue 4). A bare repo made by `reconcile init-repo`, a clone,
the `reconcile watch` daemon, and real hosts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests import fleet as fleetlib
from tests.conftest import ROOT, SPEC_FLAGS, DesiredRepo, run_cli, write_fleet

pytestmark = pytest.mark.fleet

GIT_ENV = {"GIT_AUTHOR_NAME": "Dev", "GIT_AUTHOR_EMAIL": "dev@example.invalid",
           "GIT_COMMITTER_NAME": "Dev", "GIT_COMMITTER_EMAIL": "dev@example.invalid"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def git(cwd: Path, *args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                         env={**os.environ, **GIT_ENV, **(env or {})})
    if check and res.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed: {res.stdout}{res.stderr}")
    return res


class Deploy:
    """A deploy repo (bare, hooks installed), a clone to push from, and the daemon."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.bare = tmp / "deploy.git"
        self.state = tmp / "controller"
        self.clone = tmp / "work"
        self.metrics_port = free_port()
        self.proc: subprocess.Popen | None = None
        self.env = {**os.environ, "RECONCILER_IDENTITY": str(fleetlib.client_key_path()),
                    "RECONCILER_STATE_DIR": str(self.state), "RECONCILER_CONFIG": str(tmp / "config.toml")}
        subprocess.run([sys.executable, "-m", "reconciler", "init-repo", str(self.bare), "--state-dir",
                        str(self.state)], check=True, env=self.env, cwd=ROOT, capture_output=True)
        git(tmp, "clone", "-q", str(self.bare), str(self.clone))
        git(self.clone, "checkout", "-q", "-b", "main")
        self.repo = DesiredRepo.__new__(DesiredRepo)
        self.repo.path = self.clone

    def write(self, hosts, services=None, **kw) -> None:
        write_fleet(self.repo, hosts, services, **kw)

    def commit(self, msg: str = "change", *extra: str) -> str:
        git(self.clone, "add", "-A")
        git(self.clone, "commit", "-q", *extra, "-m", msg)
        return git(self.clone, "rev-parse", "HEAD").stdout.strip()

    def push(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return git(self.clone, "push", *args, "origin", "HEAD:main", env=self.env, check=check)

    def start(self, interval: int = 300) -> None:
        with open(self.tmp / "daemon.log", "ab") as log:   # the daemon keeps its own copy of the fd
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "reconciler", "watch", "--repo", str(self.bare), "--interval", str(interval),
                 "--metrics", f"127.0.0.1:{self.metrics_port}"],
                env={**self.env, "PYTHONUNBUFFERED": "1"}, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=1)
                return
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"daemon did not start: {self.daemon_log()}")

    def daemon_log(self) -> str:
        return (self.tmp / "daemon.log").read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.returncode if self.proc else None

    def wait_exit_file(self, rev: str, timeout: float = 30) -> int:
        f = self.state / "runs" / f"{rev}.exit"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if f.exists() and f.read_text().strip():
                return int(f.read_text())
            time.sleep(0.1)
        raise AssertionError(f"no run for {rev[:7]} within {timeout}s:\n{self.daemon_log()[-3000:]}")

    def metrics(self) -> dict[str, float]:
        """The daemon's unlabelled series and those labelled by result, name -> value."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        return {k: float(v) for k, _, v in (line.rpartition(" ") for line in text.splitlines())
                if k and not k.startswith("#")}

    def status(self) -> list[dict]:
        out = subprocess.run([sys.executable, "-m", "reconciler", "status", "--json"], env=self.env, cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out)


@pytest.fixture
def deploy(tmp_path):
    d = Deploy(tmp_path)
    yield d
    d.stop()


@pytest.mark.timeout(90)
def test_push_goes_live_and_streams_the_outcome(fleet, deploy):
    h = fleet.hosts[0]
    deploy.write([h])
    deploy.start()
    rev = deploy.commit("first deploy")
    res = deploy.push("-o", "reconcile.wait")
    out = res.stdout + res.stderr
    assert f"{rev[:7]} valid" in out                       # pre-receive ran
    assert "Healthy" in out and f"{rev[:7]} finished with exit 0" in out, out   # streamed from the daemon
    assert fleet.show(h, "model-a", "ActiveState")["ActiveState"] == "active"
    # an env change pushed without waiting goes live within seconds
    deploy.write([h], {"model-a": {"port": 30000, "env": {"LOG_LEVEL": "debug"}}})
    rev2 = deploy.commit("debug")
    deploy.push()
    assert deploy.wait_exit_file(rev2) == 0
    assert "LOG_LEVEL=debug" in fleet.environment(h, "model-a")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["toml-syntax", "unknown-key", "preflight-rule"])
def test_invalid_push_is_rejected_with_file_key_reason(fleet, deploy, case):
    h = fleet.hosts[0]
    deploy.write([h], extra={})
    good = deploy.commit()
    deploy.push()
    if case == "preflight-rule":      # the incident's flags, with the full rule pack
        deploy.write([h], {"model-a": {"port": 30000, "model": "Qwen3.5-122B-A10B", "args": SPEC_FLAGS}}, extra={})
    else:
        bad_text = {"toml-syntax": f'address = "{h.address}"\n[services.model-a\n',
                    "unknown-key": f'address = "{h.address}"\nadress = "x"\n'}[case]
        (deploy.clone / f"hosts/{h.name}.toml").write_text(bad_text)
    deploy.commit("broken")
    res = deploy.push(check=False)
    assert res.returncode != 0
    assert f"hosts/{h.name}.toml" in res.stderr and "rejected" in res.stderr
    expect = {"toml-syntax": "line 2", "unknown-key": "adress",
              "preflight-rule": "services.model-a: sglang-spec-hybrid-extra-buffer"}[case]
    assert expect in res.stderr
    if case == "preflight-rule":
        assert "Fix:" in res.stderr
    assert git(deploy.bare, "rev-parse", "main").stdout.strip() == good    # nothing landed
    assert not fleet.exists(h, "/etc/systemd/system/model-a.service")       # nothing deployed (no daemon)


@pytest.mark.timeout(90)
def test_pushed_crash_loop_is_rolled_back_and_in_status(fleet, deploy):
    h = fleet.hosts[0]
    svc = {"port": 30000, "model": "Qwen3.5-122B-A10B", "env": {"STANDIN_LOAD_SECONDS": "1"}}
    deploy.write([h], {"sglang": svc})
    deploy.start()
    c1 = deploy.commit()
    deploy.push()
    assert deploy.wait_exit_file(c1) == 0
    deploy.write([h], {"sglang": {**svc, "args": SPEC_FLAGS}})
    c2 = deploy.commit("speculative decoding")
    deploy.push()
    assert deploy.wait_exit_file(c2) == 3
    row = next(r for r in deploy.status() if r["host"] == h.name and r["service"] == "sglang")
    assert row["running_rev"] == c1 and row["desired_rev"] == c2
    assert "extra_buffer" in (row["quote"] or "")
    assert "rolled-back" in row["last_event"] or "quarantined" in row["last_event"]


@pytest.mark.timeout(60)
def test_force_push_back_is_refused(fleet, deploy):
    h = fleet.hosts[0]
    deploy.write([h])
    c1 = deploy.commit()
    deploy.write([h], {"model-a": {"port": 30000, "env": {"V": "2"}}})
    c2 = deploy.commit("v2")
    deploy.push()
    git(deploy.clone, "reset", "-q", "--hard", c1)
    res = deploy.push("--force", check=False)
    assert res.returncode != 0 and "does not descend" in res.stderr
    assert git(deploy.bare, "rev-parse", "main").stdout.strip() == c2


@pytest.mark.timeout(120)
def test_an_unsigned_commit_is_refused_at_every_door_of_the_controller(fleet, deploy, tmp_path, monkeypatch):
    """require_signed in config.toml: an unsigned commit is refused by pre-receive, by the daemon
    when it lands past the hook (a ref written by a group member with a shell, M5), and by
    `reconcile` run as root without a flag (M6); the host is never touched. Signed, it deploys."""
    from tests import signing
    assert os.geteuid() == 0          # the test hosts need root: so does "as root" here
    h = fleet.hosts[0]
    key = signing.keypair(tmp_path)
    signers = signing.allowed_signers(tmp_path / "allowed_signers", key)
    (tmp_path / "config.toml").write_text(f'require_signed = true\nallowed_signers = "{signers}"\n')
    deploy.write([h])
    deploy.start()
    unsigned = signing.commit(deploy.clone, "unsigned")
    # 1. pre-receive
    res = deploy.push(check=False)
    assert res.returncode != 0 and f"rejected {unsigned[:7]}: Unsigned" in res.stderr, res.stderr
    # 2. the daemon: the ref written straight into the deploy repo (no hook runs), then the trigger
    git(deploy.bare, "fetch", "-q", str(deploy.clone), "main:main")
    (deploy.bare / "reconciler.trigger").touch()
    assert deploy.wait_exit_file(unsigned) == 1
    log = (deploy.state / "runs" / f"{unsigned}.log").read_text()
    assert f"refused: Unsigned: commit {unsigned[:7]} is not signed" in log, log
    # 3. reconcile as root, no flag: the controller's config applies
    monkeypatch.setenv("RECONCILER_CONFIG", str(tmp_path / "config.toml"))
    res = run_cli("--repo", str(deploy.bare), check_codes=(1,))
    assert f"refused (Unsigned): commit {unsigned[:7]} is not signed" in res.stderr, res.stderr
    assert fleet.no_records(h) and not fleet.exists(h, "/etc/systemd/system/model-a.service")
    # a signed commit on top (the tip is what deploys): accepted by the hook, deployed by the
    # daemon, in sync for reconcile as root
    signed = signing.commit(deploy.clone, "signed", key)
    res = deploy.push("-o", "reconcile.wait", check=False)
    assert res.returncode == 0 and f"{signed[:7]} signed by {signing.PRINCIPAL}" in res.stderr, res.stderr
    assert deploy.wait_exit_file(signed) == 0
    assert fleet.show(h, "model-a", "ActiveState")["ActiveState"] == "active"
    res = run_cli("--repo", str(deploy.bare), check_codes=(0,))
    assert f"{signed[:7]}: signed by {signing.PRINCIPAL}" in res.stderr


@pytest.mark.timeout(90)
def test_daemon_killed_mid_deploy_converges_after_restart(fleet, deploy):
    h = fleet.hosts[0]
    deploy.write([h], {"model-a": {"port": 30000, "env": {"STANDIN_LOAD_SECONDS": "1"}}})
    deploy.start()
    c1 = deploy.commit()
    deploy.push()
    assert deploy.wait_exit_file(c1) == 0
    deploy.write([h], {"model-a": {"port": 30000, "env": {"STANDIN_LOAD_SECONDS": "4", "V": "2"}}})
    c2 = deploy.commit("slow load")
    deploy.push()
    # wait until the new env is on the host (applied), then SIGKILL during the health wait
    deadline = time.monotonic() + 20
    while "V=2" not in fleet.environment(h, "model-a"):
        assert time.monotonic() < deadline, deploy.daemon_log()
        time.sleep(0.1)
    deploy.stop(signal.SIGKILL)
    assert not (deploy.state / "runs" / f"{c2}.exit").exists()
    leftovers = fleet.ssh(h, "find /etc/systemd/system /var/lib/reconciler -name '.reconciler-tmp*'")
    assert leftovers.strip() == ""
    deploy.start()
    assert deploy.wait_exit_file(c2) == 0
    rec = json.loads(fleet.ssh(h, "cat /var/lib/reconciler/services/model-a.json"))
    assert rec["last_good_revision"] == c2
    unit = fleet.ssh(h, "cat /etc/systemd/system/model-a.service")
    assert unit.startswith("# Managed by reconciler") and unit.rstrip().endswith("WantedBy=multi-user.target")


@pytest.mark.timeout(60)
def test_metrics_endpoint(fleet, deploy):
    h = fleet.hosts[0]
    deploy.write([h])
    deploy.start()
    rev = deploy.commit()
    deploy.push()
    assert deploy.wait_exit_file(rev) == 0
    text = urllib.request.urlopen(f"http://127.0.0.1:{deploy.metrics_port}/metrics", timeout=5).read().decode()
    for series in ("reconciler_runs_total", "reconciler_run_duration_seconds_bucket",
                   f'reconciler_service_healthy{{host="{h.name}",service="model-a"}} 1.0',
                   f'reconciler_last_applied_revision_info{{revision="{rev}"}} 1.0',
                   f'reconciler_host_reachable{{host="{h.name}"}} 1.0',
                   "reconciler_rollbacks_total", "reconciler_drift_found_total"):
        assert series in text, series


@pytest.mark.timeout(90)
def test_warm_daemon_reuses_its_connections_and_replaces_one_closed_on_the_host(fleet, deploy):
    """`watch` keeps one SSH connection per host between runs (reconciler/host/pool.py): interval runs
    reuse it, and its standing session (session.py); when the host ends it (here: its sshd session
    is killed, as a host's sshd restart or reboot would), the next run connects afresh and still
    converges."""
    hosts = fleet.hosts[:2]
    deploy.write(hosts)
    rev = deploy.commit("v1")
    deploy.start(interval=1)
    deploy.push()
    assert deploy.wait_exit_file(rev) == 0

    def runs() -> float:
        return deploy.metrics().get('reconciler_runs_total{result="ok"}', 0.0)

    start = runs()
    locked = [fleet.ssh(h, "cat /var/lib/reconciler/.lock.count") for h in hosts]
    deadline = time.monotonic() + 30
    while runs() < start + 3:                       # three more interval runs, no change
        assert time.monotonic() < deadline, deploy.daemon_log()[-3000:]
        time.sleep(0.2)
    # each read the hosts in sync, and so took no host's lock
    assert [fleet.ssh(h, "cat /var/lib/reconciler/.lock.count") for h in hosts] == locked
    m = deploy.metrics()
    assert m["reconciler_ssh_connections_opened_total"] == 2, m       # one per host, ever
    assert m["reconciler_ssh_connections_reused_total"] >= 6, m
    assert m["reconciler_ssh_connections_open"] == 2, m
    for h in hosts:          # and on each, one standing session that the rounds observed through
        assert fleet.ssh(h, "pgrep -fc '[r]econciler-session'").strip() == "1"
    # The rounds read the hosts' same answers as they read them before (host/programs.Seen): a
    # hand edit between two rounds is still seen at the next one, and reverted.
    unit = "/etc/systemd/system/model-a.service"
    good = fleet.ssh(hosts[1], f"cat {unit}")
    fleet.ssh(hosts[1], f"sed -i 's/--port 30000/--port 30000 --speculative-algo NEXTN/' {unit}")
    deadline = time.monotonic() + 30
    while fleet.ssh(hosts[1], f"cat {unit}") != good:
        assert time.monotonic() < deadline, deploy.daemon_log()[-3000:]
        time.sleep(0.2)
    # End the daemon's session on the first host from the host's side (not this look's own).
    fleet.ssh(hosts[0], "for p in $(pgrep -f '^sshd: root@notty'); do [ $p = $PPID ] || kill $p; done")
    deploy.write(hosts, {"model-a": {"port": 30000, "env": {"LOG_LEVEL": "debug"}}})
    rev = deploy.commit("v2: a change after the kill")
    deploy.push()
    assert deploy.wait_exit_file(rev) == 0
    assert "LOG_LEVEL=debug" in fleet.environment(hosts[0], "model-a")
    m = deploy.metrics()
    assert m["reconciler_ssh_connections_opened_total"] == 3, m       # the one replaced, only
    assert m.get('reconciler_runs_total{result="host_failed"}', 0.0) == 0, deploy.daemon_log()[-3000:]
    assert m[f'reconciler_host_reachable{{host="{hosts[0].name}"}}'] == 1.0
