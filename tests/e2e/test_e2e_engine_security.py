"""End-to-end: a preview runs nothing of the revision, and the engine check runs with least
privilege and a stamp that cannot lie (issue 39; review 2026-12-03 N1, N2, N3, N8).

On real test hosts (systemd, sshd) where an engine is importable: the real SGLang at
/opt/engines (tests/engines.py) for the break-in tests, and a small stand-in vLLM package
(FAKE_VLLM below: the modules vLLM's `serve` argument checks use, a version that refuses a flag
the other accepts, and a report of how its probe was started) where a test installs, upgrades
or chowns packages itself (/opt/engines is read-only).

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


# ---- least privilege, on a stand-in engine --------------------------------------------------------

# A stand-in vLLM: the modules vllm_probe.py calls, the argument stage (vllm/engine/arg_utils.py)
# where the flags live. VERSION 0.1.0 accepts --old-flag, 0.2.0 does not (nor does 0.1.0 when
# VLLM_FAKE_STRICT=1). Each probe writes how it was started to $VLLM_FAKE_REPORT.<time>.
FAKE_VLLM = {
    "vllm/__init__.py": "from vllm.engine.arg_utils import AsyncEngineArgs\n",
    "vllm/engine/__init__.py": "",
    "vllm/engine/arg_utils.py": '''
import json, os, sys, time, types
VERSION = "@VERSION@"


def report():
    """Each probe that parses arguments writes how it was started to a file of its own,
    $VLLM_FAKE_REPORT.<time> (each probe may be another dynamic user)."""
    path = os.environ.get("VLLM_FAKE_REPORT")
    if not path:
        return

    def writable(p):
        try:
            with open(p, "w"):
                pass
            os.unlink(p)
            return True
        except OSError:
            return False
    with open("/proc/net/dev") as f:
        ifaces = sorted(line.split(":")[0].strip() for line in f.readlines()[2:])
    with open(f"{path}.{time.time_ns()}", "w") as f:
        f.write(json.dumps({"version": VERSION, "uid": os.getuid(), "gid": os.getgid(),
                            "isolated": sys.flags.isolated, "env": sorted(os.environ), "ifaces": ifaces,
                            "etc": writable("/etc/reconciler-probe-test"),
                            "tmp": writable("/tmp/reconciler-probe-test"), "argv": sys.argv[1:]}) + "\\n")


class AsyncEngineArgs:
    def __init__(self, args):
        self.args = args

    @staticmethod
    def add_cli_args(parser):
        report()
        parser.add_argument("model")
        parser.add_argument("--tensor-parallel-size", type=int, default=1)
        if VERSION == "0.1.0" and os.environ.get("VLLM_FAKE_STRICT") != "1":
            parser.add_argument("--old-flag", action="store_true")
        return parser

    @classmethod
    def from_cli_args(cls, args):
        return cls(args)

    def create_engine_config(self, usage_context=None):
        ns = types.SimpleNamespace
        return ns(speculative_config=None, model_config=ns(max_model_len=4096, architecture="Fake"),
                  parallel_config=ns(tensor_parallel_size=self.args.tensor_parallel_size),
                  cache_config=ns(mamba_cache_mode=None))
''',
    "vllm/entrypoints/__init__.py": "",
    "vllm/entrypoints/common/__init__.py": "",
    "vllm/entrypoints/common/cli_args.py": '''
from vllm.engine.arg_utils import AsyncEngineArgs


def make_arg_parser(parser):
    return AsyncEngineArgs.add_cli_args(parser)


def validate_parsed_serve_args(args):
    pass
''',
    "vllm/usage/__init__.py": "",
    "vllm/usage/usage_lib.py": "import enum\n\n\nclass UsageContext(enum.Enum):\n    OPENAI_API_SERVER = 1\n",
    "vllm/utils/__init__.py": "",
    "vllm/utils/argparse_utils.py": "import argparse\n\n\nclass FlexibleArgumentParser(argparse.ArgumentParser):\n"
                                    "    pass\n",
}
REPORTS = "/srv/reports"


def install_fake_vllm(fleet, h: fleetlib.Host, where: str, version: str = "0.1.0", dist_info: str | None = None,
                      owner: str = "root") -> None:
    """The stand-in vLLM in `where` (its dist-info there too, or in `dist_info`), owned by `owner`."""
    info = dist_info or where
    parts = [f"mkdir -p {shlex.quote(where)} {shlex.quote(info)}",
             f"rm -rf {shlex.quote(where)}/vllm {shlex.quote(info)}/vllm-*.dist-info"]
    for rel, text in FAKE_VLLM.items():
        path = f"{where}/{rel}"
        parts.append(f"mkdir -p {shlex.quote(os.path.dirname(path))} && printf %s "
                     f"{shlex.quote(text.replace('@VERSION@', version))} > {shlex.quote(path)}")
    parts.append(f"mkdir -p {info}/vllm-{version}.dist-info && printf 'Metadata-Version: 2.1\\nName: vllm\\n"
                 f"Version: {version}\\n' > {info}/vllm-{version}.dist-info/METADATA")
    parts.append(f"chown -R {owner} {shlex.quote(where)}/vllm {info}/vllm-{version}.dist-info")
    fleet.ssh(h, " && ".join(parts))


def upgrade_stage(fleet, h: fleetlib.Host, where: str, version: str) -> None:
    """An editable install's upgrade: the argument stage edited in place (a git pull)."""
    fleet.ssh(h, f"sed -i 's/^VERSION = .*/VERSION = \"{version}\"/' {where}/vllm/engine/arg_utils.py")


def reports(fleet, h: fleetlib.Host, name: str) -> list[dict]:
    """What each probe of service `name` reported, oldest first."""
    text = fleet.ssh(h, f"for f in $(ls {REPORTS}/{name}.* 2>/dev/null | sort); do cat $f; echo; done")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def vllm_service(python: str, name: str, *service: str, env: dict[str, str] | None = None,
                 args: str = "/models/Qwen3-8B --old-flag") -> tuple[str, dict[str, str]]:
    return (unit(python, f"ReadWritePaths={REPORTS}", *service, args=args, module="vllm.entrypoints.openai.api_server"),
            {"VLLM_FAKE_REPORT": f"{REPORTS}/{name}", **(env or {})})


def dry_run(repo: DesiredRepo, *codes: int) -> dict:
    _, out = run_json("--repo", str(repo.path), "--dry-run", "--engine-check", check_codes=codes or (2, 4))
    return out["hosts"][0]


SYS_SITE = "/usr/local/lib/python3.11/dist-packages"


@pytest.fixture
def fake_vllm_host(fleet):
    h = fleet.hosts[0]
    fleet.ssh(h, f"{SVC_USER} && mkdir -p {REPORTS} && chmod 1777 {REPORTS} && rm -f {REPORTS}/*")
    yield h
    fleet.ssh(h, f"rm -rf {SYS_SITE}/vllm {SYS_SITE}/vllm-*.dist-info {SYS_SITE}/__editable__.vllm.pth "
                 f"/srv/pp /srv/src /srv/venv /home/svc/.local /etc/default/fakevllm {REPORTS}")


@pytest.mark.timeout(300)
def test_the_probe_of_a_unit_without_user_runs_as_a_dynamic_user_isolated_offline_and_read_only(fleet, repo,
                                                                                                 fake_vllm_host):
    h = fake_vllm_host
    install_fake_vllm(fleet, h, SYS_SITE)
    fleet.ssh(h, "printf 'VLLM_FROM_FILE=1\\nLD_PRELOAD=/nonexistent.so\\nPYTHONPATH=/srv\\nHF_TOKEN=hf_x\\n' "
                 "> /etc/default/fakevllm && chmod 600 /etc/default/fakevllm")
    desired(repo, [h], {"probe": vllm_service("/usr/bin/python3", "probe", "EnvironmentFile=/etc/default/fakevllm",
                                              env={"PYTHONWARNINGS": "ignore", "BROWSER": "true",
                                                   "VLLM_FROM_GIT": "1"})})
    r = dry_run(repo, 2)
    assert any(n.startswith("probe: vllm 0.1.0 accepts the command line") for n in r["notes"]), r["notes"]
    [seen] = reports(fleet, h, "probe")
    assert seen["uid"] != 0 and seen["gid"] != 0                        # DynamicUser=yes, not root
    assert seen["isolated"] == 1 and seen["ifaces"] == ["lo"]
    assert (seen["etc"], seen["tmp"]) == (False, True)                  # ProtectSystem=strict, a private /tmp
    assert not fleet.exists(h, "/tmp/reconciler-probe-test")
    systemd_gives = {"LANG", "LC_CTYPE", "PATH", "INVOCATION_ID", "SYSTEMD_EXEC_PID", "USER", "LOGNAME"}
    assert set(seen["env"]) - systemd_gives == {
        "VLLM_FROM_FILE", "VLLM_FROM_GIT", "VLLM_FAKE_REPORT",             # the unit's and the service's, allowed
        "HOME", "HF_HOME", "CUDA_VISIBLE_DEVICES", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",   # the guards
        "VLLM_CACHE_ROOT"}                                                  # the probe's own


@pytest.mark.timeout(300)
def test_a_package_directory_someone_else_may_write_makes_the_check_refuse_naming_it(fleet, repo, fake_vllm_host):
    """N2: a venv the service account may write, with a unit that runs as root (no User=):
    the probe would run that account's code; the check refuses, naming the directory. The same
    venv under a unit that runs as that account is the account's own: checked."""
    h = fake_vllm_host
    fleet.ssh(h, "python3 -m venv --without-pip /srv/venv")
    site = "/srv/venv/lib/python3.11/site-packages"
    install_fake_vllm(fleet, h, site)
    fleet.ssh(h, f"chown svc {site}")
    uid = fleet.ssh(h, "id -u svc").strip()
    desired(repo, [h], {"venv": vllm_service("/srv/venv/bin/python", "venv")})
    r = dry_run(repo, 2)
    refusal = (f"venv: engine check inconclusive (vllm): the engine check did not run: {site} (owner uid {uid}, "
               f"gid 0, mode 755) may be changed by someone other than root, and the probe would run what it holds.")
    assert any(n.startswith(refusal) for n in r["notes"]), r["notes"]
    assert reports(fleet, h, "venv") == []                              # no probe ran

    desired(repo, [h], {"venv": vllm_service("/srv/venv/bin/python", "venv", "User=svc")})
    r = dry_run(repo, 2)
    assert any(n.startswith("venv: vllm 0.1.0 accepts the command line") for n in r["notes"]), r["notes"]
    assert [s["uid"] for s in reports(fleet, h, "venv")] == [int(uid)]

    fleet.ssh(h, f"chown root {site} && chmod o+w {site}")             # anyone may write it: never
    r = dry_run(repo, 2)
    assert any(f"the engine check did not run: {site} (owner uid 0, gid 0, mode 757)" in n for n in r["notes"]), \
        r["notes"]


@pytest.mark.timeout(600)
def test_a_cached_ok_made_stale_by_an_upgrade_anywhere_the_stamp_covers_is_asked_again(fleet, repo, fake_vllm_host):
    """N3: for each place a package can be upgraded (the system's dist-packages, the user's site,
    a PYTHONPATH directory, an editable install's sources, the unit's env file): the first dry
    run asks the engine (ok), the second answers from the cache (no probe), and after the
    upgrade the engine is asked again and refuses (never the cached ok)."""
    h = fake_vllm_host
    py = "/usr/bin/python3"
    user_site = "/home/svc/.local/lib/python3.11/site-packages"

    def sys_site() -> tuple[str, dict[str, str]]:
        install_fake_vllm(fleet, h, SYS_SITE)
        return vllm_service(py, "case"), {}

    def usersite() -> tuple[str, dict[str, str]]:
        install_fake_vllm(fleet, h, user_site, owner="svc")
        fleet.ssh(h, "chown -R svc /home/svc/.local")
        return vllm_service(py, "case", "User=svc"), {}

    def pythonpath() -> tuple[str, dict[str, str]]:
        install_fake_vllm(fleet, h, "/srv/pp")
        return vllm_service(py, "case", env={"PYTHONPATH": "/srv/pp"}), {}

    def editable() -> tuple[str, dict[str, str]]:
        install_fake_vllm(fleet, h, "/srv/src", dist_info=SYS_SITE)
        fleet.ssh(h, f"echo /srv/src > {SYS_SITE}/__editable__.vllm.pth")
        return vllm_service(py, "case"), {}

    def envfile() -> tuple[str, dict[str, str]]:
        install_fake_vllm(fleet, h, SYS_SITE)
        fleet.ssh(h, "echo VLLM_FAKE_STRICT=0 > /etc/default/fakevllm")
        return vllm_service(py, "case", "EnvironmentFile=/etc/default/fakevllm"), {}

    upgrades = {
        "system dist-packages": (sys_site, lambda: install_fake_vllm(fleet, h, SYS_SITE, "0.2.0"), "0.2.0"),
        "user site": (usersite, lambda: install_fake_vllm(fleet, h, user_site, "0.2.0", owner="svc"), "0.2.0"),
        "PYTHONPATH directory": (pythonpath, lambda: install_fake_vllm(fleet, h, "/srv/pp", "0.2.0"), "0.2.0"),
        "editable install": (editable, lambda: upgrade_stage(fleet, h, "/srv/src", "0.2.0"), "0.1.0"),
        "env file": (envfile, lambda: fleet.ssh(h, "echo VLLM_FAKE_STRICT=1 > /etc/default/fakevllm"), "0.1.0"),
    }
    for where, (setup, upgrade, version) in upgrades.items():
        fleet.ssh(h, f"rm -rf {SYS_SITE}/vllm {SYS_SITE}/vllm-*.dist-info {SYS_SITE}/__editable__.vllm.pth /srv/pp "
                     f"/srv/src /home/svc/.local /etc/default/fakevllm {REPORTS}/case.*")
        svc, _ = setup()
        desired(repo, [h], {"case": svc})
        for n in (1, 2):
            r = dry_run(repo, 2)
            assert any(x.startswith("case: vllm 0.1.0 accepts the command line") for x in r["notes"]), (where, r)
            assert len(reports(fleet, h, "case")) == 1, (where, n)          # the second answer: the cache's
        upgrade()
        r = dry_run(repo, 4)
        assert r["reason"] == "EngineRejected", (where, r)
        assert (f"case: the installed vllm {version} refuses this command line: unrecognized arguments: --old-flag"
                in r["message"]), (where, r["message"])
        assert len(reports(fleet, h, "case")) == 2, where                    # asked again
