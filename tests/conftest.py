"""Shared fixtures: the real test fleet (booted once per session), desired-state git repos
built with pygit2, and helpers to run the `reconcile` CLI and commands on hosts.

The fleet tests never skip: when the fleet cannot boot, they fail with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pygit2
import pytest

from reconciler.plan.files import parse_env_file
from reconciler.plan.layout import envfile_path
from tests import fleet as fleetlib

FLEET_SIZE = int(os.environ.get("RECONCILER_TEST_FLEET_SIZE", "10"))
# Test hosts live on 127.0.0.20 and up, apart from the sandbox demo (127.0.0.2-3) and benchmarks.
# Run in parallel (pytest-xdist: `-n 3 --dist worksteal`, as .ci/test does), each worker boots a
# fleet of its own, 40 addresses further on (gw0: .20, gw1: .60, gw2: .100), named apart.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_NTH = int(_WORKER[2:]) if _WORKER.startswith("gw") and _WORKER[2:].isdigit() else 0
FLEET_FIRST = int(os.environ.get("RECONCILER_TEST_FLEET_FIRST", "20")) + 40 * _NTH
FLEET_PREFIX = os.environ.get("RECONCILER_TEST_FLEET_PREFIX", "rt") + (f"w{_NTH}" if _NTH else "")
ROOT = Path(__file__).resolve().parent.parent


class Fleet:
    """The booted hosts plus helpers to look at them over plain ssh (not the reconciler's code)."""

    def __init__(self, hosts: list[fleetlib.Host], known_hosts: Path):
        self.hosts = hosts
        self.known_hosts = known_hosts

    def ssh(self, host: fleetlib.Host, cmd: str, check: bool = True) -> str:
        for attempt in range(3):
            res = subprocess.run([*fleetlib.ssh_base(host.address, self.known_hosts), cmd],
                                 capture_output=True, text=True, timeout=30)
            if res.returncode != 255:
                break
            # ssh itself failed (a handshake slower than ConnectTimeout on a loaded machine):
            # the test's look at the host is retried, never the reconciler's own connections.
            time.sleep(0.5 * (attempt + 1))
        if check and res.returncode != 0:
            raise AssertionError(f"{host.name}: {cmd!r} failed ({res.returncode}): {res.stderr}")
        return res.stdout

    def show(self, host: fleetlib.Host, unit: str, *props: str) -> dict[str, str]:
        out = self.ssh(host, f"systemctl show {unit} -p {','.join(props)}")
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def environment(self, host: fleetlib.Host, service: str) -> str:
        """The environment systemd gives the service at its next start, as NAME=value words:
        its Environment= lines (`systemctl show`) and its env file (the reconciler's, which the
        env drop-in names; systemd reads it at every start)."""
        shown = self.show(host, service, "Environment").get("Environment", "")
        text = self.ssh(host, f"cat {envfile_path(service.removesuffix('.service'))} 2>/dev/null", check=False)
        return " ".join([shown, *(f"{k}={v}" for k, v in parse_env_file(text).items())]).strip()

    def exists(self, host: fleetlib.Host, path: str) -> bool:
        return self.ssh(host, f"test -e {path} && echo yes || echo no").strip() == "yes"

    def no_records(self, host: fleetlib.Host) -> bool:
        """True when the reconciler recorded nothing on the host (its lock file may exist)."""
        return self.ssh(host, "ls /var/lib/reconciler/services /var/lib/reconciler/host.json 2>/dev/null | "
                              "head -1", check=False).strip() == ""

    def reset(self, hosts: list[fleetlib.Host] | None = None) -> None:
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda h: self.ssh(h, fleetlib.RESET_SCRIPT), hosts or self.hosts))


@pytest.fixture(autouse=True)
def _state_dir(tmp_path, monkeypatch):
    """Each test gets its own state store and URL cache."""
    monkeypatch.setenv("RECONCILER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("RECONCILER_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="session")
def fleet_session():
    try:
        fleetlib.build()
        hosts = fleetlib.up(FLEET_SIZE, first=FLEET_FIRST, prefix=FLEET_PREFIX)
    except fleetlib.FleetError as e:
        pytest.fail(f"the test fleet could not boot (run .ci/setup as root): {e}", pytrace=False)
    kh = fleetlib.write_known_hosts(hosts, fleetlib.RUN_DIR / f"{FLEET_PREFIX}_known_hosts")
    yield Fleet(hosts, kh)
    fleetlib.down(hosts)


@pytest.fixture
def fleet(fleet_session: Fleet) -> Fleet:
    """The fleet with every host back in its freshly booted state."""
    fleet_session.reset()
    return fleet_session


class DesiredRepo:
    """A real git repository of desired state, built with pygit2 in a temp dir."""

    def __init__(self, path: Path):
        self.path = path
        self.repo = pygit2.init_repository(str(path), initial_head="main")

    def write(self, rel: str, text: str) -> None:
        p = self.path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text).lstrip("\n"))

    def remove(self, rel: str) -> None:
        (self.path / rel).unlink()
        self.repo.index.remove(rel)
        self.repo.index.write()

    def commit(self, message: str = "change") -> str:
        idx = self.repo.index
        idx.add_all()
        idx.write()
        tree = idx.write_tree()
        sig = pygit2.Signature("Test", "test@example.invalid")
        parents = [] if self.repo.head_is_unborn else [self.repo.head.target]
        return str(self.repo.create_commit("HEAD", sig, sig, message, tree, parents))


@pytest.fixture
def repo(tmp_path: Path) -> DesiredRepo:
    return DesiredRepo(tmp_path / "desired")


def fleet_known_hosts(hosts: list[fleetlib.Host]) -> str:
    return "".join(h.known_hosts_line() + "\n" for h in hosts)


# The incident's flags (speculative decoding on the hybrid Qwen3.5 without the extra buffer).
SPEC_FLAGS = ("--speculative-algo NEXTN --speculative-num-steps 3 --speculative-eagle-topk 1 "
              "--speculative-num-draft-tokens 4")
# A repo rule file that switches off the pre-flight rule for the incident. Tests of crash-loop
# detection and rollback use it to let a bad deploy through to the host, as happens with a flag
# rule the pack does not know yet: the crash loop is then caught on the host (defence in depth).
WITHOUT_INCIDENT_RULE = {"rules/without-incident-rule.toml": 'disable = ["sglang-spec-hybrid-extra-buffer"]\n'}

# The stand-in runs as SGLang does: python3 -m sglang.launch_server (tests/hostpkg).
STANDIN_UNIT = (
    "\n[Unit]\nDescription=stand-in model server {service.name}\n\n[Service]\nType=simple\n"
    "ExecStart=/usr/bin/python3 -m sglang.launch_server --model-path {model.path} --host {host.address} "
    "--port {vars.port} {vars.args}\n"
    "Restart=always\nRestartSec=1\n\n[Install]\nWantedBy=multi-user.target\n")


def write_fleet(repo: DesiredRepo, hosts: list[fleetlib.Host], services: dict[str, dict] | None = None,
                extra: dict[str, str] | None = None) -> None:
    """A standard desired state: fleet.toml, known_hosts, units/standin.service, one host file each.

    services: name -> {"port": 30000, "env": {...}, "args": "--flag x", "model": "Qwen3-8B",
    "health": {...}} put on every host. Health defaults are short (tests wait seconds, not minutes).
    extra: more repo files; by default the rule file WITHOUT_INCIDENT_RULE (pass {} for the full
    rule pack).
    """
    services = services if services is not None else {"model-a": {"port": 30000, "env": {"LOG_LEVEL": "info"}}}
    repo.write("fleet.toml", """
        [ssh]
        user = "root"
        known_hosts = "known_hosts"
    """)
    repo.write("known_hosts", fleet_known_hosts(hosts))
    repo.write("units/standin.service", STANDIN_UNIT)
    for h in hosts:
        body = [f'address = "{h.address}"', ""]
        for name, s in services.items():
            body.append(f"[services.{name}]")
            body.append('unit_file = "units/standin.service"')
            body.append(f'vars = {{ port = "{s.get("port", 30000)}", args = "{s.get("args", "")}" }}')
            model = s.get("model", "Qwen3-8B")
            if model is not None:      # None: no [model] table (the unit names its model itself)
                body.append(f'model = {{ id = "Qwen/{model}", path = "/models/{model}" }}')
            health = {"http": "http://{host.address}:{vars.port}/health", "startup_timeout": 10,
                      "stable_for": 1, "interval": 0.5, **s.get("health", {})}
            body.append("health = { " + ", ".join(
                f"{k} = {json.dumps(v)}" for k, v in health.items() if v is not None) + " }")
            env = s.get("env", {})
            if env:
                body.append("env = { " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items()) + " }")
            body.append("")
        repo.write(f"hosts/{h.name}.toml", "\n".join(body))
    for rel, text in (extra if extra is not None else WITHOUT_INCIDENT_RULE).items():
        repo.write(rel, text)


def run_cli(*args: str, check_codes: tuple[int, ...] | None = None) -> subprocess.CompletedProcess:
    """Run the real `reconcile` command as a user would, with the test client key."""
    env = {**os.environ, "RECONCILER_IDENTITY": str(fleetlib.client_key_path()),
           "COLUMNS": "200", "NO_COLOR": "1"}
    res = subprocess.run([sys.executable, "-m", "reconciler", *args], capture_output=True, text=True,
                         env=env, timeout=120, cwd=ROOT)
    if check_codes is not None and res.returncode not in check_codes:
        raise AssertionError(f"reconcile {' '.join(args)} exited {res.returncode}, wanted {check_codes}\n"
                             f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}")
    return res


def run_json(*args: str, check_codes: tuple[int, ...] | None = None) -> tuple[int, dict]:
    res = run_cli(*args, "--json", check_codes=check_codes)
    return res.returncode, json.loads(res.stdout)


def wait_for(what: str, check: Callable[[], Any], timeout: float, every: float = 0.1) -> Any:
    """Poll `check` until it returns something truthy (returned), or fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)
