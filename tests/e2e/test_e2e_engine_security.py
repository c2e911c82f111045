"""End-to-end: a preview runs nothing of the revision (issue 39; review 2026-12-03 N1), on real
test hosts (systemd, sshd) where an engine is importable: the real SGLang at /opt/engines
(tests/engines.py). The engine check's box and its stamp, on a stand-in engine, are
tests/e2e/test_e2e_engine_box.py.

A break-in is a revision whose environment would make the unit's python run a payload
(PYTHONWARNINGS + BROWSER, a sitecustomize on PYTHONPATH, PYTHONSTARTUP + PYTHONINSPECT) or
whose unit has no User= (so the probe would have run as root). Each payload writes a marker
file, named with a token of this test, in directories anyone may write: /tmp, /var/tmp and
/srv/markers (which the units may write too, ReadWritePaths=, so the probe's own sandbox
does not hide a payload that ran). Each payload is first shown to fire when python is started
with it directly, so the tests can fail."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests import engines
from tests import fleet as fleetlib
from tests.conftest import DesiredRepo, fleet_known_hosts, run_cli, run_json

pytestmark = pytest.mark.fleet

SGLANG = f"{engines.HOST_ROOT}/sglang-0.5.23/bin/python"
MODEL = "/models/Qwen3.5-122B-A10B"
MARKERS = "/srv/markers"
PAYLOAD = "/srv/payload"
SKIPPED = "the revision is not signed; --engine-check runs it"
SVC_USER = "{ id svc >/dev/null 2>&1 || useradd -m -d /home/svc svc; }"     # a service account


def unit(python: str, *service: str, args: str = f"--model-path {MODEL} --tp-size 4",
         module: str = "sglang.launch_server") -> str:
    return ("[Unit]\nDescription=an engine's unit\n\n[Service]\nType=simple\n" + "".join(f"{s}\n" for s in service)
            + f"ExecStart={python} -m {module} {args}\nRestart=always\nRestartSec=1\n\n"
            "[Install]\nWantedBy=multi-user.target\n")


def desired(repo: DesiredRepo, hosts: list[fleetlib.Host], services: dict[str, tuple[str, dict[str, str]]]) -> str:
    """A desired state with one unit file per service (name -> (unit text, env)) on every host;
    committed, its revision returned."""
    repo.write("fleet.toml", '[ssh]\nuser = "root"\nknown_hosts = "known_hosts"\n')
    repo.write("known_hosts", fleet_known_hosts(hosts))
    body = []
    for name, (text, env) in services.items():
        repo.write(f"units/{name}.service", text)
        body += [f"[services.{name}]", f'unit_file = "units/{name}.service"']
        if env:
            body.append("env = { " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items()) + " }")
        body.append("")
    for h in hosts:
        repo.write(f"hosts/{h.name}.toml", f'address = "{h.address}"\n\n' + "\n".join(body))
    return repo.commit("services")


# ---- a preview runs nothing of the revision ---------------------------------------------------------


def payloads(token: str) -> dict[str, tuple[str, dict[str, str]]]:
    """The break-in services: name -> (unit, env). Each marker is named `token-name`."""
    def touch(name: str) -> str:
        return " ".join(f"{d}/{token}-{name}" for d in (MARKERS, "/tmp", "/var/tmp"))
    warn = {"PYTHONWARNINGS": "all:0:antigravity.x:0:0", "BROWSER": f"/bin/sh -c 'touch {touch('warn')}' %s"}
    site = {"PYTHONPATH": PAYLOAD}
    startup = {"PYTHONSTARTUP": f"{PAYLOAD}/startup.py", "PYTHONINSPECT": "1"}
    root = {"PYTHONWARNINGS": "all:0:antigravity.x:0:0", "BROWSER": f"/bin/sh -c 'touch {touch('root')}' %s",
            "PYTHONPATH": PAYLOAD, "PYTHONSTARTUP": f"{PAYLOAD}/startup.py", "PYTHONINSPECT": "1"}
    sandbox = f"ReadWritePaths={MARKERS}"

    def args(gpu: int) -> str:                # each its own port and GPU: no other rule stands in the way
        return f"--model-path {MODEL} --tp-size 1 --port {30000 + gpu}"
    return {"warn": (unit(SGLANG, "User=svc", sandbox, args=args(0)), {**warn, "CUDA_VISIBLE_DEVICES": "0"}),
            "site": (unit(SGLANG, "User=svc", sandbox, args=args(1)), {**site, "CUDA_VISIBLE_DEVICES": "1"}),
            "startup": (unit(SGLANG, "User=svc", sandbox, args=args(2)), {**startup, "CUDA_VISIBLE_DEVICES": "2"}),
            "rootunit": (unit(SGLANG, sandbox, args=args(3)), {**root, "CUDA_VISIBLE_DEVICES": "3"})}


def plant(fleet, h: fleetlib.Host, token: str) -> None:
    """The payload files on the host (root's, as a file the revision names could be), and the
    world-writable marker directory."""
    write = ("import os\nfor d in ('/srv/markers', '/tmp', '/var/tmp'):\n"
             "    try:\n        open(f'{d}/%s-%s-' + str(os.getuid()), 'w').close()\n"
             "    except OSError:\n        pass\n")
    fleet.ssh(h, f"{SVC_USER} && mkdir -p {MARKERS} {PAYLOAD} && chmod 1777 {MARKERS} && chmod 755 {PAYLOAD} && "
                 f"printf %s {shlex.quote(write % (token, 'site'))} > {PAYLOAD}/sitecustomize.py && "
                 f"printf %s {shlex.quote(write % (token, 'startup'))} > {PAYLOAD}/startup.py")


def markers(fleet, h: fleetlib.Host, token: str) -> tuple[list[str], list[str]]:
    """The markers of this test's token on the host and on this machine (where validate and the
    pre-receive hook run)."""
    there = fleet.ssh(h, f"ls -d {MARKERS}/{token}-* /tmp/{token}-* /var/tmp/{token}-* 2>/dev/null; true").split()
    here = [str(p) for d in (MARKERS, "/tmp", "/var/tmp") for p in Path(d).glob(f"{token}-*")]
    return there, here


def test_each_payload_fires_when_python_is_started_with_it(fleet):
    """The markers work: each payload, given to the engine's python directly (as the engine check
    gave it before), writes its marker. PYTHONSTARTUP runs only in an interactive interpreter
    (a terminal, no script: `script` gives it one); the probe is a script with stdin from
    /dev/null, so it never ran it, and `-I` would ignore it besides."""
    _require_engines()
    h = fleet.hosts[0]
    token = "m" + secrets.token_hex(6)
    plant(fleet, h, token)
    env = payloads(token)
    try:
        for name in ("warn", "site"):
            fleet.ssh(h, "env " + " ".join(shlex.quote(f"{k}={v}") for k, v in env[name][1].items())
                         + f" {SGLANG} -c pass")
        startup = " ".join(f"{k}={v}" for k, v in env["startup"][1].items())
        fleet.ssh(h, f"printf 'exit()\\n' | timeout 60 script -qec {shlex.quote(f'env {startup} {SGLANG}')} /dev/null"
                     " >/dev/null")
        there, _ = markers(fleet, h, token)
        assert sorted(Path(p).name for p in there if p.startswith(MARKERS)) == [
            f"{token}-site-0", f"{token}-startup-0", f"{token}-warn"], there
    finally:
        fleet.ssh(h, f"rm -f {MARKERS}/{token}-* /tmp/{token}-* /var/tmp/{token}-*")


def _require_engines() -> None:
    if engines.built() is None:
        pytest.fail(f"the engine environments are not built ({engines.root()}): run .ci/setup", pytrace=False)


@pytest.mark.timeout(600)
def test_a_preview_runs_no_payload_and_the_engine_check_runs_them_isolated(fleet, repo, tmp_path):
    """`--dry-run`, `--dry-run --json`, `validate` and the pre-receive hook of a revision that
    carries every payload: no marker anywhere, and the dry run says the engine check was
    skipped. With --engine-check the probe does run (each service gets the engine's verdict),
    isolated: still no marker."""
    _require_engines()
    h = fleet.hosts[0]
    token = "m" + secrets.token_hex(6)
    plant(fleet, h, token)
    services = payloads(token)
    desired(repo, [h], services)
    try:
        res = run_cli("--repo", str(repo.path), "--dry-run", check_codes=(2,))
        assert markers(fleet, h, token) == ([], [])
        assert f"engine check skipped: {SKIPPED}" in res.stdout, res.stdout

        code, out = run_json("--repo", str(repo.path), "--dry-run", check_codes=(2,))
        assert markers(fleet, h, token) == ([], [])
        assert out["engine_check"] == {"ran": False, "why": SKIPPED, "services": 4,
                                       "line": f"engine check skipped: {SKIPPED}"}
        notes = out["hosts"][0]["notes"]
        for name in services:
            assert f"{name}: engine check skipped ({SKIPPED}); the static rules decide" in notes, notes

        run_cli("validate", "--repo", str(repo.path), check_codes=(0,))
        assert markers(fleet, h, token) == ([], [])

        bare = tmp_path / "deploy.git"
        env = {**os.environ, "RECONCILER_STATE_DIR": str(tmp_path / "controller")}
        subprocess.run([sys.executable, "-m", "reconciler", "init-repo", str(bare), "--state-dir",
                        str(tmp_path / "controller")], check=True, env=env, capture_output=True)
        push = subprocess.run(["git", "-C", str(repo.path), "push", str(bare), "HEAD:main"], capture_output=True,
                              text=True, env=env, timeout=120)
        assert push.returncode == 0, push.stderr          # pre-receive validated it (and accepted it)
        assert markers(fleet, h, token) == ([], [])

        # Four real probes at once on a 2-core machine: longer than run_cli's 120 s may take.
        res = subprocess.run([sys.executable, "-m", "reconciler", "--repo", str(repo.path), "--dry-run",
                              "--engine-check", "--json"], capture_output=True, text=True, timeout=500,
                             env={**os.environ, "RECONCILER_IDENTITY": str(fleetlib.client_key_path())})
        assert markers(fleet, h, token) == ([], [])
        assert res.returncode == 2, res.stderr
        out = json.loads(res.stdout)
        assert (out["engine_check"]["ran"], out["engine_check"]["why"]) == (True, "--engine-check")
        notes = out["hosts"][0]["notes"]
        for name in services:
            said = [n for n in notes if n.startswith(f"{name}: ") and ("engine check" in n or "accepts" in n)]
            assert len(said) == 1 and "skipped" not in said[0], notes
    finally:
        fleet.ssh(h, f"rm -rf {MARKERS}/{token}-* /tmp/{token}-* /var/tmp/{token}-* {PAYLOAD}")
