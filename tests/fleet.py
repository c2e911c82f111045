"""A fleet of real test hosts: systemd + sshd in systemd-nspawn containers on loopback.

Follows ../shared/TESTHOSTS.md. Each host is a container booted from one cached Debian root
filesystem with ``--volatile=overlay`` (writes land in a tmpfs, the cache stays clean), real
PID 1 systemd, journald and sshd listening on its own loopback address 127.0.0.N:22.

Besides the base system, every host gets (read-only bind mounts):
  /usr/local/bin/sglang-standin   the project's stand-in for an SGLang server (tests/standin.py)
  /usr/local/lib/python3.11/dist-packages/sglang
                                  a stand-in `sglang` package (tests/hostpkg): units run the
                                  stand-in as `python3 -m sglang.launch_server`, as in production
  /opt/standin/vllm               a stand-in `vllm` package, off python's path: `python3
                                  /opt/standin/vllm/entrypoints/openai/api_server.py` runs the
                                  stand-in playing vLLM (VLLM_STANDIN below)
  /models                         small fake model directories (tests/models)
  /opt/engines                    the real SGLang and vLLM environments of the engine-probe
                                  tests, and /usr/lib/x86_64-linux-gnu/libcuda.so.1, the
                                  project's stand-in for the NVIDIA driver library, once
                                  `python -m tests.engines build` has built them (tests/engines.py)

Used by the pytest fixtures (tests/conftest.py), the sandbox demo (.ci/sandbox) and the
benchmarks. Command line::

    python -m tests.fleet build                 # rootfs + client key (idempotent, cached)
    python -m tests.fleet up N [--first K]      # boot N hosts, print them, stay in background
    python -m tests.fleet down                  # stop every host this module started

Nothing here ever addresses anything outside 127.0.0.0/8.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests import engines

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("RECONCILER_FLEET_CACHE", "/var/cache/reconciler-testfleet"))
RUN_DIR = Path(os.environ.get("RECONCILER_FLEET_RUN", "/run/reconciler-testfleet"))
# git and python3-venv: what a control host needs (the install test follows the runbook in one).
# haproxy: the load balancer of the drain tests (tests/balancer.py), off at boot.
PACKAGES = "systemd,systemd-sysv,dbus,openssh-server,iproute2,procps,python3,git,python3-venv,haproxy"
# Bump when the build steps below change, so cached root filesystems are rebuilt.
BUILD_VERSION = "2"
STANDIN = HERE / "standin.py"
HOSTPKG = HERE / "hostpkg"
SITE = "/usr/local/lib/python3.11/dist-packages"
STANDIN_VLLM = "/opt/standin/vllm"
# The command that runs the stand-in as vLLM's OpenAI server (the reconciler reads it as vLLM).
VLLM_STANDIN = f"/usr/bin/python3 {STANDIN_VLLM}/entrypoints/openai/api_server.py"
MODELS = HERE / "models"


class FleetError(RuntimeError):
    """The test fleet could not be built or booted; the message says why."""


def _rootfs_key() -> str:
    return hashlib.sha256(f"{PACKAGES}|{BUILD_VERSION}".encode()).hexdigest()[:12]


def rootfs_path() -> Path:
    """Where the cached root filesystem for the current package list lives."""
    return CACHE / f"rootfs-{_rootfs_key()}"


def client_key_path() -> Path:
    """The private key the test client logs in with (trusted by root on every test host)."""
    return CACHE / "client_ed25519"


def debian_mirror() -> str:
    """The plain Debian archive URI that this machine's own apt sources name."""
    for src in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
        for block in Path(src).read_text().split("\n\n"):
            uris = re.search(r"^URIs:\s*(\S+)", block, re.M)
            suites = re.search(r"^Suites:\s*(.+)$", block, re.M)
            if uris and suites and "security" not in uris.group(1) and "bookworm" in suites.group(1).split():
                return uris.group(1)
    lst = Path("/etc/apt/sources.list")
    if lst.exists():
        for line in lst.read_text().splitlines():
            m = re.match(r"deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+bookworm\s", line)
            if m:
                return m.group(1)
    raise FleetError("no Debian bookworm archive found in /etc/apt/sources.list(.d)")


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if res.returncode != 0:
        raise FleetError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
    return res


def build() -> Path:
    """Build (once) the root filesystem and the client key; return the rootfs path."""
    for tool in ("systemd-nspawn", "debootstrap", "ssh-keygen"):
        if shutil.which(tool) is None:
            raise FleetError(f"{tool} not found: run .ci/setup (it installs the Debian packages)")
    CACHE.mkdir(parents=True, exist_ok=True)
    key = client_key_path()
    if not key.exists():
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "reconciler-test-client", "-f", str(key)])
    root = rootfs_path()
    if not (root / ".complete").exists():
        tmp = root.with_name(root.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"fleet: building test-host rootfs with debootstrap (about a minute) into {root}", file=sys.stderr)
        _run(["debootstrap", "--variant=minbase", f"--include={PACKAGES}", "bookworm", str(tmp), debian_mirror()])
        # Keep boots quick and quiet: nothing in the container needs these.
        for unit in ("apt-daily.timer", "apt-daily-upgrade.timer", "e2scrub_all.timer", "fstrim.timer"):
            (tmp / "etc/systemd/system" / unit).unlink(missing_ok=True)
            link = tmp / "etc/systemd/system/timers.target.wants" / unit
            link.unlink(missing_ok=True)
        # HAProxy runs only where a test starts it (tests/balancer.py), with that test's config.
        (tmp / "etc/systemd/system/multi-user.target.wants/haproxy.service").unlink(missing_ok=True)
        (tmp / ".complete").write_text(_rootfs_key())
        tmp.rename(root)
    ssh_dir = root / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    os.chmod(ssh_dir, 0o700)
    auth = ssh_dir / "authorized_keys"
    auth.write_text(Path(str(key) + ".pub").read_text())
    os.chmod(auth, 0o600)
    return root


def host_public_key() -> str:
    """'<type> <base64>' of the ed25519 host key all test hosts share."""
    parts = (rootfs_path() / "etc/ssh/ssh_host_ed25519_key.pub").read_text().split()
    return f"{parts[0]} {parts[1]}"


@dataclass
class Host:
    """One booted test host."""

    name: str
    address: str
    pid: int

    def known_hosts_line(self) -> str:
        return f"{self.address} {host_public_key()}"


def _pidfile(name: str) -> Path:
    return RUN_DIR / f"{name}.pid"


def boot(name: str, address: str, binds: list[str] | None = None) -> Host:
    """Start one container with sshd on address:22 (returns at once; see wait_ready).

    binds: more systemd-nspawn --bind / --bind-ro arguments (e.g. the install test's wheels)."""
    root = rootfs_path()
    if not (root / ".complete").exists():
        raise FleetError("test-host rootfs missing: run `python -m tests.fleet build` (or .ci/setup)")
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    stop(name)
    conf = RUN_DIR / f"{name}.sshd.conf"
    conf.write_text(f"ListenAddress {address}:22\nPermitRootLogin prohibit-password\nUseDNS no\n")
    cmd = [
        "systemd-nspawn", "-q", "-b", "-D", str(root), "--volatile=overlay", "-M", name,
        "--register=no", "--keep-unit",
        f"--bind-ro={conf}:/etc/ssh/sshd_config.d/test.conf",
        f"--bind-ro={STANDIN}:/usr/local/bin/sglang-standin",
        f"--bind-ro={HOSTPKG / 'sglang'}:{SITE}/sglang",
        # off python's path: the engine tests expect no vllm there (a unit names the file)
        f"--bind-ro={HOSTPKG / 'vllm'}:{STANDIN_VLLM}",
        # A stand-in nvidia-smi, off PATH: a test makes a host a "GPU host" with `gpu_host()`.
        f"--bind-ro={HOSTPKG / 'nvidia-smi'}:/usr/local/lib/fake-nvidia-smi",
        f"--bind-ro={MODELS}:/models",
        *engines.host_binds(),
        *(binds or []),
    ]
    groups = _own_cgroups(name)
    with open(RUN_DIR / f"{name}.log", "wb") as log:   # the container keeps its own copy of the fd
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=lambda: _enter(groups))
    _pidfile(name).write_text(str(proc.pid))
    return Host(name=name, address=address, pid=proc.pid)


# The cgroup hierarchies systemd uses on this machine: the named v1 one and the unified (v2) one
# of a hybrid layout, or the v2 root of a unified layout.
_HIERARCHIES = ("/sys/fs/cgroup/systemd", "/sys/fs/cgroup/unified", "/sys/fs/cgroup")


def _own_cgroups(name: str) -> list[Path]:
    """A cgroup of its own for container `name` in every hierarchy systemd uses here (made now).

    The machine does not run systemd, so systemd-nspawn (--keep-unit --register=no) puts each
    container's processes under the cgroup nspawn itself runs in: started from the same one,
    every container's `m.service` is the same cgroup, `/payload/system.slice/m.service`. Then
    hosts are not apart as real hosts are: when two of them restart the same service at the
    same moment, one host's systemd removes the cgroup the other's new process is being put
    into, and that start fails with status 219/CGROUP before the service runs (seen on the
    test fleet, issue 32). Each container in its own cgroup gets its own tree, as a real host."""
    out = []
    for h in map(Path, _HIERARCHIES):
        if not (h / "cgroup.procs").exists() or (h == Path("/sys/fs/cgroup") and out):
            continue
        if h == Path("/sys/fs/cgroup") and not (h / "cgroup.controllers").exists():
            continue      # a v1 layout's tmpfs, not a hierarchy
        d = h / "reconciler-testfleet" / name
        d.mkdir(parents=True, exist_ok=True)
        out.append(d)
    return out


def _enter(groups: list[Path]) -> None:
    """In the child, before exec: move this process into each of its cgroups."""
    for d in groups:
        with open(d / "cgroup.procs", "w") as f:
            f.write("0")


def ssh_base(address: str, known_hosts: Path) -> list[str]:
    return ["ssh", "-q", "-i", str(client_key_path()), "-o", "BatchMode=yes", "-o", "ConnectTimeout=2",
            "-o", f"UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=yes",
            "-o", "ForwardAgent=no", "-F", "/dev/null", f"root@{address}"]


def write_known_hosts(hosts: list[Host], path: Path) -> Path:
    path.write_text("".join(h.known_hosts_line() + "\n" for h in hosts))
    return path


def wait_ready(hosts: list[Host], timeout: float = 60.0) -> None:
    """Block until every host answers over SSH and systemd finished booting."""
    kh = write_known_hosts(hosts, RUN_DIR / f"known_hosts.{hosts[0].name if hosts else 'none'}")
    deadline = time.monotonic() + timeout
    pending = list(hosts)
    while pending:
        still = []
        procs = [(h, subprocess.Popen([*ssh_base(h.address, kh), "systemctl is-system-running --wait"],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
                 for h in pending]
        for h, p in procs:
            out, _ = p.communicate()
            state = out.strip()
            if p.returncode is None or state not in ("running", "degraded"):
                still.append(h)
        pending = still
        if pending:
            if time.monotonic() > deadline:
                logs = {h.name: (RUN_DIR / f"{h.name}.log").read_text(errors="replace")[-800:] for h in pending}
                raise FleetError(f"test hosts did not come up within {timeout:.0f}s: "
                                 f"{[h.name for h in pending]}\n{json.dumps(logs, indent=1)}")
            for h in pending:
                try:
                    os.kill(h.pid, 0)
                except ProcessLookupError:
                    log = (RUN_DIR / f"{h.name}.log").read_text(errors="replace")[-2000:]
                    raise FleetError(f"test host {h.name} exited during boot:\n{log}") from None
            time.sleep(0.3)


# Makes a test host a GPU host: the stand-in nvidia-smi on PATH, with `count` fake GPUs.
def gpu_host(count: int = 2) -> str:
    return f"ln -sf /usr/local/lib/fake-nvidia-smi /usr/local/bin/nvidia-smi && echo {count} > /etc/fake-gpus"


STRAY_SECONDS = 100731     # how the reset script tells a test's stray GPU holders apart
KMSG_SECONDS = 100733      # ... and the holder of a test host's kernel log (kernel_log), which it keeps


def gpu_faults(*lines: str) -> str:
    """Shell that gives a GPU host's stand-in nvidia-smi these faults ("0 ecc-uncorrectable 2",
    "1 reset-required", ...: tests/hostpkg/nvidia-smi lists them); none clears them."""
    text = "".join(f"{ln}\n" for ln in lines)
    return f"printf %s {shlex.quote(text)} > /etc/fake-gpu-faults"


def kernel_log(message: str, *, wait: bool = True) -> str:
    """Shell that puts `message` into the test host's kernel log as a driver's printk reaches it:
    a record in /dev/kmsg's format, read by journald, so `journalctl -k` (_TRANSPORT=kernel)
    shows it. A container has no /dev/kmsg (systemd-nspawn leaves it out), so the first call
    makes one: a FIFO that journald, restarted, reads as the kernel's (a process of its own keeps
    it open, so no writer ever blocks). `wait`: until `journalctl -k` shows the line."""
    q = shlex.quote(message)
    setup = ("[ -p /dev/kmsg ] || { rm -f /dev/kmsg && mkfifo -m 600 /dev/kmsg && "
             f"(setsid sleep {KMSG_SECONDS} 3<>/dev/kmsg </dev/null >/dev/null 2>&1 &) && "
             "systemctl restart systemd-journald; }")
    # priority 3 (err, as NVRM logs an Xid), a sequence number above every earlier one (journald
    # skips the ones it has read), the monotonic time in microseconds, the message
    write = ("us=$(awk '{printf \"%.0f\", $1 * 1000000}' /proc/uptime); t0=$(date +%s); "
             f"printf '3,%s,%s,-;%s\\n' \"$us\" \"$us\" {q} > /dev/kmsg")
    check = (f"; for i in $(seq 100); do journalctl -k -q --no-pager -o cat --since @$((t0 - 1)) | grep -qF {q} "
             "&& exit 0; sleep 0.1; done; echo 'journald did not read the line' >&2; exit 1") if wait else ""
    return f"{setup} && {write}{check}"


def stray(gpus: str) -> str:
    """Shell that starts a process holding the given fake GPUs ("0" or "0,1") outside any
    service, as a crashed server's leftover would; prints its PID."""
    return (f"FAKE_GPU_HOLD={gpus} setsid sleep {STRAY_SECONDS} </dev/null >/dev/null 2>&1 & echo $!")


def standin_package(version: str) -> str:
    """Shell that installs a stand-in `sglang` package reporting `version` under
    /opt/sglang-<version> (put it first on PYTHONPATH to run that version); prints the dir."""
    d = f"/opt/sglang-{version}"
    return (f"mkdir -p {d} && cp -r {SITE}/sglang {d}/ && "
            f"sed -i 's/^__version__ = .*/__version__ = \"{version}\"/' {d}/sglang/__init__.py && echo {d}")


def wheelhouse() -> Path:
    """Wheels of the project and everything it needs, for installing it inside a container
    without network access (the install test); built once per pyproject.toml, cached."""
    root = HERE.parent
    key = hashlib.sha256((root / "pyproject.toml").read_bytes()).hexdigest()[:12]
    out = CACHE / f"wheels-{key}"
    if (out / ".complete").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    print(f"fleet: building wheels for the install test into {out}", file=sys.stderr)
    pip = [sys.executable, "-m", "pip", "-q"]
    _run([*pip, "wheel", "--wheel-dir", str(tmp), str(root)])
    # The build backend, for `pip install <source checkout>` with build isolation.
    _run([*pip, "download", "--dest", str(tmp), "setuptools>=68", "wheel"])
    for stale in tmp.glob("reconciler-*.whl"):
        stale.unlink()        # the test installs from the checkout, as the runbook says
    shutil.rmtree(root / "build", ignore_errors=True)     # what building the project's wheel left
    (tmp / ".complete").write_text(key)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def up(count: int, first: int = 2, prefix: str = "rt") -> list[Host]:
    """Boot `count` hosts on 127.0.0.<first>... and wait until all answer."""
    # Many containers (this fleet, and others' booted beside it) need more inotify instances
    # than the default (TESTHOSTS.md): raise the limits whatever the count.
    subprocess.run(["sysctl", "-q", "-w", "fs.inotify.max_user_instances=8192",
                    "fs.inotify.max_user_watches=1048576"], check=False)
    hosts = [boot(f"{prefix}{i}", f"127.0.0.{i}") for i in range(first, first + count)]
    wait_ready(hosts)
    return hosts


def _is_our_container(pid: int, name: str) -> bool:
    """True when pid is the systemd-nspawn that boots container `name`."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(argv) and argv[0].endswith(b"systemd-nspawn") and name.encode() in argv


def stop(name: str) -> None:
    """Stop one container (SIGTERM to its systemd-nspawn, then wait)."""
    pf = _pidfile(name)
    if not pf.exists():
        return
    pid = int(pf.read_text())
    pf.unlink(missing_ok=True)
    if not _is_our_container(pid, name):
        return   # a stale pid file (e.g. after a reboot): the pid may belong to anything now
    try:
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            os.kill(pid, 0)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def down(hosts: list[Host] | None = None, prefix: str | None = None) -> None:
    """Stop the given hosts, else those `up` named with `prefix` (the prefix, then the address's
    last number: `h` is h2 and h3, never the test suite's rt20 or a bench's cmp40), else every
    host this module started on this machine (a test run's too)."""
    names = [h.name for h in hosts] if hosts else [p.stem for p in RUN_DIR.glob("*.pid")]
    for n in names:
        if hosts or prefix is None or re.fullmatch(re.escape(prefix) + r"[0-9]+", n):
            stop(n)


# Brings a host back to its freshly booted state: every unit file placed under
# /etc/systemd/system (by the reconciler or a test) is stopped, disabled and removed, with the
# reconciler's record on the host. The base rootfs has no regular unit files there.
RESET_SCRIPT = r"""
set -u
STRAY_SECONDS=@STRAY@
for t in /etc/systemd/system/reconciler-confirm-*.timer /etc/systemd/system/reconciler-pull.timer \
         /etc/systemd/system/reconciler-pull.path; do
  [ -f "$t" ] || continue
  systemctl disable --now "$(basename "$t")" >/dev/null 2>&1; rm -f "$t"
done
# the dead-man's switches' transient timers (confirm.py)
systemctl stop 'reconciler-confirm-*.timer' 'reconciler-confirm-*.service' >/dev/null 2>&1
for f in /etc/systemd/system/*.service; do
  [ -f "$f" ] && [ ! -L "$f" ] || continue
  u=$(basename "$f")
  systemctl disable --now --no-block "$u" >/dev/null 2>&1
  systemctl kill "$u" >/dev/null 2>&1
  rm -f "$f"; rm -rf "$f.d"
done
pkill -f "sleep $STRAY_SECONDS" >/dev/null 2>&1
rm -f /usr/local/bin/nvidia-smi /etc/fake-gpus /etc/fake-gpu-faults /etc/fake-gpu-trip
# A test's kernel log (kernel_log): its records go too, or the next test's host, which has no
# records and so reads its kernel log since boot, would find an earlier test's Xids there
[ ! -p /dev/kmsg ] || journalctl --rotate --vacuum-time=1s >/dev/null 2>&1
rm -rf /var/lib/reconciler /etc/reconciler/env /etc/credstore /etc/systemd/system/*.service.d \
  /etc/systemd/system/.reconciler-* \
  /tmp/model-* /run/systemd/system/*.service.d /etc/systemd/system.control /run/systemd/system.control
systemctl daemon-reload
systemctl reset-failed
true
""".replace("@STRAY@", str(STRAY_SECONDS))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fleet")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build")
    p_up = sub.add_parser("up")
    p_up.add_argument("count", type=int)
    p_up.add_argument("--first", type=int, default=2)
    p_up.add_argument("--prefix", default="rt")
    p_down = sub.add_parser("down")
    p_down.add_argument("--prefix", help="only the hosts `up --prefix` named so (default: every one)")
    sub.add_parser("hostkey")
    sub.add_parser("wheels")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "build":
            print(build())
        elif args.cmd == "up":
            for h in up(args.count, args.first, args.prefix):
                print(f"{h.name} {h.address} pid={h.pid}")
        elif args.cmd == "down":
            down(prefix=args.prefix)
        elif args.cmd == "hostkey":
            print(host_public_key())
        elif args.cmd == "wheels":
            print(wheelhouse())
    except FleetError as e:
        print(f"fleet: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
