"""End-to-end: the controller installed exactly as systemd/README.md says, on real systemd (issue 10).

The runbook's shell blocks are read from the README itself (`<!-- runbook: WHERE -->` before
each), so the two cannot drift apart, and run as written:

  * control: on a control host container (Debian 12, real systemd and sshd), as root;
  * gpu-host: on a test host of the fleet (the stand-in for a GPU host), as root;
  * workstation: here, in a desired-state repo, pushing over SSH as the `git` user.

Only what the test environment forces is added around them, never inside: the control host
has no network, so pip reads the project's dependencies from a wheelhouse built outside
(PIP_NO_INDEX / PIP_FIND_LINKS, bound read-only at /wheelhouse), the checkout is bound at
/opt/reconciler/src, and the containers share this machine's network namespace, so the
daemon's metrics listen on the control host's own loopback address instead of 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import fleet as fleetlib
from tests.conftest import ROOT, DesiredRepo, write_fleet

pytestmark = pytest.mark.fleet

RUNBOOK = ROOT / "systemd" / "README.md"
CONTROL = os.environ.get("RECONCILER_TEST_CONTROL", "127.0.0.18")
CONTROL_NAME = "ctl" + CONTROL.rsplit(".", 1)[1]
METRICS = f"{CONTROL}:9187"


def runbook(where: str) -> list[str]:
    """The shell blocks of the runbook for one place, in order."""
    blocks = re.findall(r"<!-- runbook: (\S+) -->\n```sh\n(.*?)```", RUNBOOK.read_text(), re.S)
    found = [body for w, body in blocks if w == where]
    assert found, f"no `runbook: {where}` block in {RUNBOOK}"
    return found


def ssh_as(address: str, known_hosts: Path, script: str, *, user: str = "root", check: bool = True,
           timeout: float = 300) -> subprocess.CompletedProcess[str]:
    base = fleetlib.ssh_base(address, known_hosts)
    base[-1] = f"{user}@{address}"
    res = subprocess.run([*base, "bash -s"], input=script, capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f"{user}@{address}: exit {res.returncode}\n--- script\n{script}\n--- stdout\n"
                             f"{res.stdout[-4000:]}\n--- stderr\n{res.stderr[-4000:]}")
    return res


class Control:
    """The control host container and the operator's key for pushing to it."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.src = tmp / "src"
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        for rel in files.decode().split("\0"):
            if rel and (ROOT / rel).is_file():
                (self.src / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, self.src / rel)
        self.host = fleetlib.boot(CONTROL_NAME, CONTROL, binds=[f"--bind={self.src}:/opt/reconciler/src",
                                                                f"--bind-ro={fleetlib.wheelhouse()}:/wheelhouse"])
        fleetlib.wait_ready([self.host])
        self.known_hosts = fleetlib.write_known_hosts([self.host], tmp / "control_known_hosts")
        self.key = tmp / "operator"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "operator@workstation",
                        "-f", str(self.key)], check=True)

    def root(self, script: str, **kw: object) -> subprocess.CompletedProcess[str]:
        return ssh_as(CONTROL, self.known_hosts, script, **kw)  # type: ignore[arg-type]

    def git_ssh(self) -> str:
        return (f"ssh -i {self.key} -o IdentitiesOnly=yes -o BatchMode=yes -o UserKnownHostsFile={self.known_hosts} "
                f"-o StrictHostKeyChecking=yes -F /dev/null")

    def journal(self) -> str:
        return self.root("journalctl -u reconciler -o cat --no-pager").stdout

    def stop(self) -> None:
        fleetlib.stop(CONTROL_NAME)


@pytest.fixture(scope="module")
def control(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Control]:
    c = Control(tmp_path_factory.mktemp("install"))
    yield c
    c.stop()


def metrics() -> str:
    return urllib.request.urlopen(f"http://{METRICS}/metrics", timeout=3).read().decode()


def wait_for(what: str, check, timeout: float = 60) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def forwarded(ssh: list[str], target: str) -> tuple[bytes, str]:
    """Ask for a local port forward to `target` through the control host (ssh -N -L), then ask
    the forwarded port for the metrics: what came back, and what ssh said."""
    port = free_port()
    proc = subprocess.Popen([*ssh, "-N", "-L", f"127.0.0.1:{port}:{target}"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    got = b""
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                conn = socket.create_connection(("127.0.0.1", port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise AssertionError("ssh -L never listened") from None
                time.sleep(0.2)
        with conn, contextlib.suppress(ConnectionResetError):   # a refused forward: ssh closes or resets it
            conn.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            while chunk := conn.recv(65536):
                got += chunk
    finally:
        proc.terminate()                # ssh may sit out a refused channel's close: then it is killed
        try:
            _, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate(timeout=10)
    return got, err.decode(errors="replace")


def try_as_the_pusher(control: Control, ws: Path, env: dict[str, str]) -> None:
    """The `git` user, as a pusher would try it: a port forward through the control host (a
    control first: root's forward works), and, as if it had a shell, a symlink planted where the
    trigger is and the repo's config, hooks and directory changed. Then a pushed deploy status
    note. Every one refused."""
    root_ssh = [*fleetlib.ssh_base(CONTROL, control.known_hosts)[:-1], f"root@{CONTROL}"]
    got, _ = forwarded(root_ssh, METRICS)
    assert got.split(b"\r\n", 1)[0].endswith(b" 200 OK") and b"reconciler_" in got, got[:200]
    git_ssh = [*control.git_ssh().split(), f"git@{CONTROL}"]
    got, said = forwarded(git_ssh, METRICS)
    assert got == b"" and "administratively prohibited" in said, (got[:200], said)

    trigger = "/srv/git/fleet.git/reconciler.trigger"
    assert control.root("runuser -u git -- git config --global --get-all safe.directory").stdout.split() == [
        "/srv/git/fleet.git"]
    tries = {"plant the trigger": (f"ln -sfn /var/lib/reconciler-controller/state.db {trigger}",
                                   "Operation not permitted"),        # the directory is sticky
             "edit config": ("printf '[core]\\n\\tpager = touch /tmp/pwned\\n' >> /srv/git/fleet.git/config",
                             "Permission denied"),
             "replace config": ("t=$(mktemp) && cp /srv/git/fleet.git/config $t && mv -f $t /srv/git/fleet.git/config",
                                "Operation not permitted"),
             "edit a hook": ("echo 'touch /tmp/pwned' >> /srv/git/fleet.git/hooks/post-receive", "Permission denied"),
             "add a hook": ("echo 'touch /tmp/pwned' > /srv/git/fleet.git/hooks/update", "Permission denied"),
             "swap the repo": ("mv /srv/git/fleet.git /srv/git/old.git", "Permission denied")}
    for what, (cmd, error) in tries.items():
        res = control.root(f"runuser -u git -- sh -c {shlex.quote(cmd)}", check=False)
        assert res.returncode != 0 and error in res.stderr, (what, res.stdout, res.stderr)
    after = control.root(f"stat -c '%F %a %U' {trigger}; grep -c pager /srv/git/fleet.git/config; "
                         "ls /srv/git /srv/git/fleet.git/hooks", check=False).stdout.split("\n")
    assert after[:2] == ["regular empty file 660 reconciler", "0"], after
    assert "old.git" not in after and "update" not in after, after

    res = subprocess.run(["git", "push", "deploy", "+HEAD:refs/notes/reconciler"], cwd=ws, env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "rejected refs/notes/reconciler: deploy status notes are written by the " \
        "daemon" in res.stderr, res.stderr


@pytest.mark.timeout(600)
def test_the_runbook_installs_a_working_controller(fleet, control: Control, tmp_path: Path):
    gpu = fleet.hosts[0]
    # The environment around the runbook (see the module docstring), then the runbook itself.
    control.root("mkdir -p /etc/systemd/system/reconciler.service.d && printf '[Service]\\n"
                 f"Environment=RECONCILER_METRICS={METRICS}\\n' > /etc/systemd/system/reconciler.service.d/test.conf")
    control.root(f"cat > ~/operator.pub <<'EOF'\n{Path(str(control.key) + '.pub').read_text()}EOF\n")
    started = time.monotonic()
    for block in runbook("control"):
        control.root("set -ex\ncd ~\nexport PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheelhouse\n" + block)
    installed = time.monotonic() - started
    print(f"runbook on the control host: {installed:.1f}s")

    # The daemon runs, hardened, and waits for the first push (a state, not an error).
    wait_for("the daemon to wait for the first push", lambda: "waiting for the first push" in control.journal())
    j = control.journal()
    assert j.count("waiting for the first push") == 1 and "run failed" not in j and "Traceback" not in j, j
    assert "reconciler_waiting_for_first_push 1.0" in metrics()
    modes = control.root("stat -c '%a %U:%G %n' /etc/reconciler /etc/reconciler/config.toml "
                         "/etc/reconciler/id_ed25519 /srv/git /srv/git/fleet.git /srv/git/fleet.git/config "
                         "/srv/git/fleet.git/hooks /srv/git/fleet.git/hooks/pre-receive "
                         "/srv/git/fleet.git/reconciler.trigger "
                         "/var/lib/reconciler-controller /var/lib/reconciler-controller/runs "
                         "/var/lib/reconciler-controller/state.db").stdout.split("\n")
    assert modes[:12] == [
        "750 root:reconciler /etc/reconciler", "640 root:reconciler /etc/reconciler/config.toml",
        "600 root:root /etc/reconciler/id_ed25519", "755 root:root /srv/git",
        "3775 reconciler:reconciler /srv/git/fleet.git", "644 root:reconciler /srv/git/fleet.git/config",
        "2755 root:reconciler /srv/git/fleet.git/hooks", "755 root:reconciler /srv/git/fleet.git/hooks/pre-receive",
        "660 reconciler:reconciler /srv/git/fleet.git/reconciler.trigger",
        "750 reconciler:reconciler /var/lib/reconciler-controller",
        "750 reconciler:reconciler /var/lib/reconciler-controller/runs",
        "600 reconciler:reconciler /var/lib/reconciler-controller/state.db"], modes
    # The repo is trusted per user: the daemon owns it, the git user says so in its own git config
    # (below); never system-wide, and not by root.
    trusted = control.root("git config --system --get-all safe.directory; echo system=$?; "
                           "git config --global --get-all safe.directory; echo root=$?").stdout.split()
    assert trusted == ["system=1", "root=1"], trusted

    # The GPU host enrolls the controller's key (copied over, as scp would) and shows its fingerprint.
    pub = control.root("cat /etc/reconciler/id_ed25519.pub").stdout
    fleet.ssh(gpu, f"cat > ~/reconciler-controller.pub <<'EOF'\n{pub}EOF")
    printed = ""
    for block in runbook("gpu-host"):
        printed += ssh_as(gpu.address, fleet.known_hosts, "set -e\ncd ~\n" + block).stdout
    fingerprint = printed.split()[1]

    # The workstation: a desired-state repo for the GPU host, without its key yet.
    ws = DesiredRepo(tmp_path / "my-fleet")
    write_fleet(ws, [gpu], {"model-a": {"port": 30000, "env": {"STANDIN_LOAD_SECONDS": "0.5"}}})
    ws.write("known_hosts", "")
    ws.commit("my fleet")
    env = {**os.environ, "CONTROL": CONTROL, "GPU_HOST": gpu.address, "GIT_SSH_COMMAND": control.git_ssh(),
           "GIT_AUTHOR_NAME": "Operator", "GIT_AUTHOR_EMAIL": "op@example.invalid",
           "GIT_COMMITTER_NAME": "Operator", "GIT_COMMITTER_EMAIL": "op@example.invalid"}
    pushed = subprocess.run(["bash", "-c", "set -ex\n" + "\n".join(runbook("workstation"))], cwd=ws.path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    assert fingerprint in pushed.stdout, (fingerprint, pushed.stdout)    # what the operator compares
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ws.path, capture_output=True, text=True).stdout.strip()
    assert f"reconciler: {head[:7]} valid (1 hosts, 1 services)" in pushed.stderr, pushed.stderr

    # Exactly one run for the push, and the change is live on the GPU host.
    runs = "/var/lib/reconciler-controller/runs"
    wait_for("the deploy", lambda: control.root(f"cat {runs}/{head}.exit", check=False).stdout.strip() == "0", 90)
    assert fleet.show(gpu, "model-a", "ActiveState")["ActiveState"] == "active"
    time.sleep(2)                                       # a second run would have started by now
    assert control.journal().count(f"reconcile {head[:7]} (") == 1, control.journal()

    # The outcome is a git note on the commit, written by the hardened daemon (UMask=0077) into the
    # shared repo with group access (the pushing user fetches it; the next push below writes there).
    subprocess.run(["git", "fetch", "-q", "deploy", "refs/notes/reconciler:refs/notes/reconciler"], cwd=ws.path,
                   env=env, check=True, timeout=60)
    shown = subprocess.run(["git", "log", "--notes=reconciler", "-1", "--format=%N"], cwd=ws.path,
                           capture_output=True, text=True, check=True).stdout
    assert shown.startswith(f"{gpu.name}: converged {head[:7]} "), shown
    closed = control.root("find /srv/git/fleet.git/objects /srv/git/fleet.git/refs -type d ! -perm -2070").stdout
    assert closed.strip() == "", closed

    # What a pusher tries beyond pushing (the 2026-12-02 review, M1, M5, H2, L11), all refused.
    try_as_the_pusher(control, ws.path, env)

    # A push that waits streams the deploy into its own output, as the pushing user.
    write_fleet(ws, [gpu], {"model-a": {"port": 30000, "env": {"STANDIN_LOAD_SECONDS": "0.5", "LOG_LEVEL": "debug"}}})
    subprocess.run(["git", "checkout", "HEAD", "--", "known_hosts"], cwd=ws.path, check=True)  # as enrolled
    subprocess.run(["git", "commit", "-qam", "debug logging"], cwd=ws.path, env=env, check=True)
    res = subprocess.run(["git", "push", "-o", "reconcile.wait", "deploy", "main"], cwd=ws.path, env=env,
                         capture_output=True, text=True, timeout=180)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "model-a (deploy" in out and "finished with exit 0" in out, out
    assert "Traceback" not in out and "PermissionError" not in out
    assert "LOG_LEVEL=debug" in fleet.environment(gpu, "model-a")

    # An invalid push is refused, naming the file and key; nothing lands.
    text = (ws.path / f"hosts/{gpu.name}.toml").read_text().replace("[services.model-a]\n",
                                                                    "[services.model-a]\nrestart_policy = 1\n")
    (ws.path / f"hosts/{gpu.name}.toml").write_text(text)
    subprocess.run(["git", "commit", "-qam", "a typo"], cwd=ws.path, env=env, check=True)
    res = subprocess.run(["git", "push", "deploy", "main"], cwd=ws.path, env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode != 0 and f"hosts/{gpu.name}.toml: services.model-a.restart_policy" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr

    # A hook that cannot read its config fails closed, in one line that says what to fix.
    control.root("chmod 0600 /etc/reconciler/config.toml")
    res = subprocess.run(["git", "push", "deploy", "main"], cwd=ws.path, env=env, capture_output=True, text=True,
                         timeout=60)
    control.root("chmod 0640 /etc/reconciler/config.toml")
    lines = [ln for ln in res.stderr.splitlines() if "reconciler:" in ln]
    assert res.returncode != 0 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert ("pre-receive: cannot use /etc/reconciler/config.toml: Permission denied; the push was refused. "
            "Fix: make it readable by the pushing users' group") in lines[0], lines

    # A symlink left where the trigger is (by root here: no group member can) is refused at the
    # daemon's start, and the file it points to keeps its mode and content.
    trigger = "/srv/git/fleet.git/reconciler.trigger"
    victim = "/var/lib/reconciler-controller/victim"
    control.root(f"install -m 0600 -o reconciler -g reconciler /dev/null {victim} && echo kept > {victim} && "
                 f"mv {trigger} {trigger}.saved && ln -s {victim} {trigger} && systemctl restart reconciler")
    wait_for("the daemon to refuse the symlinked trigger", lambda: f"not using the trigger file {trigger}: it is a "
             "symbolic link" in control.journal(), 30)
    assert control.root(f"stat -c '%a %U' {victim}; cat {victim}").stdout.split() == ["600", "reconciler", "kept"]
    control.root(f"rm {trigger} {victim} && mv {trigger}.saved {trigger}")

    # The daemon survives a restart and reports the fleet in sync at once.
    control.root("systemctl restart reconciler")
    wait_for("the fleet in sync after a restart",
             lambda: f'reconciler_service_healthy{{host="{gpu.name}",service="model-a"}} 1.0' in metrics(), 60)
    assert control.root("systemctl is-active reconciler").stdout.strip() == "active"

    # A wedged event loop stops the watchdog pings, and systemd restarts the daemon
    # (RECONCILER_FAULT=block-loop blocks the loop once /run/reconciler-block-loop exists).
    control.root("printf '[Service]\\nWatchdogSec=3\\nEnvironment=RECONCILER_FAULT=block-loop\\n' > "
                 "/etc/systemd/system/reconciler.service.d/watchdog.conf && systemctl daemon-reload && "
                 "systemctl restart reconciler")
    restarts = int(control.root("systemctl show -p NRestarts --value reconciler").stdout)
    control.root("touch /run/reconciler-block-loop")
    wait_for("the watchdog to restart the wedged daemon",
             lambda: int(control.root("systemctl show -p NRestarts --value reconciler").stdout) > restarts, 30)
    control.root("rm -f /run/reconciler-block-loop")
    assert "Watchdog timeout" in control.root("journalctl -u reconciler -o cat --no-pager").stdout
    wait_for("the restarted daemon", lambda: "reconciler_runs_total" in metrics(), 30)
    print(f"install test: runbook {installed:.1f}s, whole test {time.monotonic() - started:.1f}s")
