"""End-to-end: the engine check with least privilege and a stamp that cannot lie (issue 39;
review 2026-12-03 N2, N3, N8), on real test hosts (systemd, sshd), with a small stand-in vLLM
package (FAKE_VLLM below: the modules vLLM's `serve` argument checks use, a version that
refuses a flag the other accepts, and a report of how each probe was started) that the tests
install, upgrade and chown themselves (/opt/engines is read-only). The real engines' verdicts
are tests/e2e/test_e2e_engine*.py."""

from __future__ import annotations

import json
import os
import shlex

import pytest

from tests import fleet as fleetlib
from tests.conftest import DesiredRepo, run_json
from tests.e2e.test_e2e_engine_security import SVC_USER, desired, unit

pytestmark = pytest.mark.fleet


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
        if os.environ.get("VLLM_FAKE_CHATTY"):
            for i in range(40000):                      # 2 MB on stderr, as a runaway log would
                print(f"chatter {i:06d} " + "x" * 40, file=sys.stderr, flush=True)
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


@pytest.mark.timeout(300)
def test_a_probe_that_prints_more_than_its_cap_is_stopped_and_the_check_is_inconclusive(fleet, repo,
                                                                                        fake_vllm_host):
    """N8: what the probe prints goes to files in /run (memory): past LimitFSIZE=1M a write fails
    (python ignores SIGXFSZ: the write raises EFBIG), so the engine's chatter stops at exactly
    1 MiB (18,724 lines of 56 bytes and 32 bytes of the next), the probe cannot even flush its
    answer, and the check is inconclusive, quoting the last line that was written."""
    h = fake_vllm_host
    install_fake_vllm(fleet, h, SYS_SITE)
    desired(repo, [h], {"chatty": vllm_service("/usr/bin/python3", "chatty", env={"VLLM_FAKE_CHATTY": "1"})})
    r = dry_run(repo, 2)
    [note] = [n for n in r["notes"] if n.startswith("chatty: engine check")]
    assert note == ("chatty: engine check inconclusive (vllm): the probe gave no answer (exit status 120): "
                    "chatter 018724 xxxxxxxxxxxxxxxxx; the static rules decide"), note
    assert len(reports(fleet, h, "chatty")) == 1                         # it ran, and was stopped
