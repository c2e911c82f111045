"""End-to-end: pull mode on two real hosts, with no controller running (issue 15, item 5).

Each host runs `reconcile pull` itself, from units that `reconcile pull --install` wrote:

  * the canary (the fleet's first host) holds the repo, a bare repo at /srv/fleet.git, and serves
    it over git's own protocol on its loopback address (git daemon): it pulls from the local
    path, so its path unit starts a run the moment a push lands;
  * the second host pulls from git://<canary>/fleet.git into its mirror on a 2 s timer, in the
    wave after the canary's ([pull] waves in fleet.toml: a commit must be 10 s old there, and the
    canary must not have failed it); it pushes its own verdicts back as git notes.

This machine only pushes commits. A good commit reaches both hosts (the second one later, by its
wave); a bad one (the stand-in crashes right after it turns healthy) rolls back on the canary by
itself and never reaches the second host, whose run names the canary's failure; `reconcile
status --live` (over SSH, from the host records) shows both hosts.

The reconciler is installed on the hosts from the working tree with the project's wheelhouse,
without network access, as the install test does (tests/e2e/test_e2e_install.py).

The test hosts share this machine's cgroup tree, so the two hosts' reconciler-pull.service share
one cgroup path: now and then a start fails there with status 219/CGROUP (never on a real host).
The timers start the next run seconds later; the waits below allow for one lost start.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests import conftest, signing
from tests import fleet as fleetlib
from tests.conftest import ROOT, DesiredRepo, Fleet, run_json, write_fleet

pytestmark = pytest.mark.fleet

VENV = "/opt/reconciler-pull"
RECONCILE = f"{VENV}/bin/reconcile"
REPO = "/srv/fleet.git"
AFTER = 10                   # seconds a commit must be old before the second wave deploys it
DAEMON = "reconciler-test-git-daemon"


def _working_tree() -> bytes:
    """The checkout as it is (tracked files and new ones git does not ignore), as a tar stream."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout
    names = b"\0".join(f for f in files.split(b"\0") if f and (ROOT / f.decode()).is_file())
    return subprocess.run(["tar", "--null", "-T", "-", "-c"], input=names, cwd=ROOT, capture_output=True,
                          check=True).stdout


def _tar(path: str) -> bytes:
    return subprocess.run(["tar", "-C", path, "-c", "."], capture_output=True, check=True).stdout


def _ssh_in(fleet: Fleet, h: fleetlib.Host, cmd: str, data: bytes, timeout: float = 60) -> None:
    res = subprocess.run([*fleetlib.ssh_base(h.address, fleet.known_hosts), cmd], input=data, capture_output=True,
                         timeout=timeout)
    assert res.returncode == 0, f"{h.name}: {cmd}: {res.stderr.decode(errors='replace')}"


@pytest.fixture(scope="module")
def hosts(fleet_session: Fleet) -> list[fleetlib.Host]:
    """Two hosts with the reconciler installed in a venv from the wheelhouse (no network)."""
    src, wheels = _working_tree(), _tar(str(fleetlib.wheelhouse()))
    pair = fleet_session.hosts[:2]

    def setup(h: fleetlib.Host) -> None:
        _ssh_in(fleet_session, h, "rm -rf /tmp/reconciler-src && mkdir -p /tmp/reconciler-src && "
                                  "tar -x -C /tmp/reconciler-src", src)
        _ssh_in(fleet_session, h, "rm -rf /tmp/wheelhouse && mkdir -p /tmp/wheelhouse && tar -x -C /tmp/wheelhouse",
                wheels)
        # a venv and a pip install: tens of seconds on a loaded machine (Fleet.ssh allows 30)
        _ssh_in(fleet_session, h, f"rm -rf {VENV} && python3 -m venv {VENV} && PIP_NO_INDEX=1 "
                                  f"PIP_FIND_LINKS=/tmp/wheelhouse {VENV}/bin/pip install -q /tmp/reconciler-src",
                b"", timeout=600)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(setup, pair))
    return pair


def wait_for(what: str, check: Callable[[], Any], timeout: float = 45) -> Any:
    """conftest.wait_for at pull mode's pace: timers run every few seconds."""
    return conftest.wait_for(what, check, timeout, every=0.5)


def read_json(fleet: Fleet, h: fleetlib.Host, path: str) -> dict[str, Any]:
    text = fleet.ssh(h, f"cat {path} 2>/dev/null || true")
    return json.loads(text) if text.strip() else {}


def runs(fleet: Fleet, h: fleetlib.Host, rev: str) -> bool:
    """model-a on h runs `rev`, healthy (its record says so and systemd agrees)."""
    rec = read_json(fleet, h, "/var/lib/reconciler/services/model-a.json")
    return (rec.get("revision") == rev and rec.get("last_good_revision") == rev and not rec.get("pending")
            and fleet.show(h, "model-a", "ActiveState")["ActiveState"] == "active")


def note(fleet: Fleet, holder: fleetlib.Host, host: fleetlib.Host, rev: str) -> dict[str, Any]:
    """What `host` reported on `rev`, as the repo holds it."""
    text = fleet.ssh(holder, f"git -C {REPO} notes --ref=reconciler-pull/{host.name} show {rev} 2>/dev/null || true")
    return json.loads(text) if text.strip() else {}


def journal(fleet: Fleet, h: fleetlib.Host) -> str:
    return fleet.ssh(h, "journalctl -u reconciler-pull.service -o cat --no-pager | tail -60", check=False)


def with_waves(repo: DesiredRepo, canary: fleetlib.Host, early: fleetlib.Host, env: dict[str, str]) -> None:
    write_fleet(repo, [canary, early], {"model-a": {"port": 30000, "env": env, "health": {"stable_for": 2}}})
    fleet_toml = (repo.path / "fleet.toml").read_text()
    repo.write("fleet.toml", fleet_toml + f"""
[pull]
waves = [
  {{ name = "canary", labels = {{ wave = "canary" }} }},
  {{ name = "early", labels = {{ wave = "early" }}, after = "{AFTER}s" }},
  {{ name = "rest", after = "1h" }},
]
""")
    for h, wave in ((canary, "canary"), (early, "early")):
        path = repo.path / "hosts" / f"{h.name}.toml"
        path.write_text(path.read_text().replace("\n", f'\nlabels = {{ wave = "{wave}" }}\n', 1))


@pytest.fixture
def served(fleet: Fleet, hosts: list[fleetlib.Host]) -> Iterator[str]:
    """The bare repo on the canary, served on its address by git daemon; every unit the test
    makes is gone afterwards, whatever happened."""
    canary = hosts[0]
    fleet.ssh(canary, f"rm -rf {REPO} && git init -q --bare -b main {REPO} && "
                      f"systemd-run --unit={DAEMON} --collect /usr/lib/git-core/git-daemon --listen={canary.address} "
                      f"--port=9418 --base-path=/srv --export-all --enable=receive-pack --reuseaddr")
    url = f"git://{canary.address}/fleet.git"
    wait_for("git daemon", lambda: subprocess.run(["git", "ls-remote", url], capture_output=True).returncode == 0, 15)
    try:
        yield url
    finally:
        for h in hosts:
            fleet.ssh(h, f"{RECONCILE} pull --uninstall; systemctl disable --now reconciler-pull.timer "
                         "reconciler-pull.path 2>/dev/null; rm -f /etc/systemd/system/reconciler-pull.*; "
                         f"systemctl stop {DAEMON} 2>/dev/null; systemctl daemon-reload", check=False)


def push(repo: DesiredRepo, url: str, message: str) -> str:
    rev = repo.commit(message)
    res = subprocess.run(["git", "-C", str(repo.path), "push", "-q", url, "HEAD:refs/heads/main"], capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    return rev


@pytest.mark.timeout(240)
def test_pull_mode_two_hosts_waves_and_a_rollback_with_no_controller(fleet: Fleet, hosts, served: str, repo):
    canary, early = hosts
    with_waves(repo, canary, early, {"LOG_LEVEL": "info"})
    c1 = push(repo, served, "first")

    # Each host installs its own pull units: the canary from the repo on it, the other from the URL.
    # Unsigned commits, and git:// for the second host, on purpose (test_pull_trusts_only_... is
    # the signed path): every run says so.
    said = fleet.ssh(canary, f"cd / && {RECONCILE} pull --install --repo {REPO} --host {canary.name} "
                             f"--interval 5s --allow-unsigned 2>&1")
    assert f"at once when {REPO}/refs/heads changes" in said and "reconciler-pull.path: written" in said, said
    plain = "--allow-unsigned --allow-insecure-transport"
    said = fleet.ssh(early, f"cd / && {RECONCILE} pull --install --repo {served} --host {early.name} "
                            f"--interval 2s {plain} 2>&1")
    assert "reconciler-pull.timer: written" in said and "reconciler-pull.path" not in said, said
    assert "trusts: unsigned revisions are accepted (--allow-unsigned)" in said, said
    again = fleet.ssh(early, f"cd / && {RECONCILE} pull --install --repo {served} --host {early.name} "
                             f"--interval 2s {plain} 2>&1")
    assert "reconciler-pull.timer: unchanged" in again and "reconciler-pull.service: unchanged" in again, again
    for h in hosts:
        assert fleet.ssh(h, "systemctl is-enabled reconciler-pull.timer").strip() == "enabled"

    wait_for(f"{c1[:7]} on both hosts", lambda: runs(fleet, canary, c1) and runs(fleet, early, c1))
    assert f"head {c1[:7]} (unsigned revisions are accepted (--allow-unsigned)" in journal(fleet, early)

    # A good change: live on the canary within seconds of the push (its path unit), on the
    # second host only once the commit is AFTER seconds old and the canary reported it healthy.
    with_waves(repo, canary, early, {"LOG_LEVEL": "debug"})
    c2 = push(repo, served, "debug logging")
    pushed = time.time()
    wait_for(f"{c2[:7]} on the canary", lambda: runs(fleet, canary, c2), 30)
    assert time.time() - pushed < AFTER or not runs(fleet, early, c2)
    wait_for(f"{c2[:7]} on the second host", lambda: runs(fleet, early, c2), 45)
    committed = int(subprocess.run(["git", "-C", str(repo.path), "log", "-1", "--format=%ct", c2],
                                   capture_output=True, text=True, check=True).stdout)
    applied = read_json(fleet, early, "/var/lib/reconciler/host.json")
    assert applied["applied_revision"] == c2 and applied["applied_at"] >= committed + AFTER, applied
    assert note(fleet, canary, canary, c2)["standing"] == "ok"
    # the second host's verdict was pushed back over git:// (a third wave would read it)
    wait_for("the second host's report", lambda: note(fleet, canary, early, c2).get("standing") == "ok", 15)
    assert "LOG_LEVEL=debug" in fleet.environment(early, "model-a")

    # A bad commit: the stand-in crashes right after it turns healthy. The canary deploys it,
    # sees the crash loop and rolls back to c2 by itself; the second host never deploys it.
    with_waves(repo, canary, early, {"LOG_LEVEL": "debug", "STANDIN_CRASH_AFTER": "0.3"})
    c3 = push(repo, served, "crash after start")
    bad = wait_for("the canary's verdict on the bad commit",
                   lambda: (r := note(fleet, canary, canary, c3)).get("standing") == "bad" and r, 45)
    reason = bad["reason"]      # the crash comes right after /health answers: seen either way
    assert reason in ("CrashLoop", "Unstable"), bad
    wait_for(f"the canary back on {c2[:7]}", lambda: runs(fleet, canary, c2), 30)
    rec = read_json(fleet, canary, "/var/lib/reconciler/services/model-a.json")
    assert rec["quarantine"]["revision"] == c3 and rec["quarantine"]["reason"] == reason, rec
    pulled = read_json(fleet, canary, "/var/lib/reconciler/pull.json")
    assert pulled["target"] == c3 and pulled["status"] in ("rolled-back", "quarantined"), pulled
    assert "CUDA error" in journal(fleet, canary)          # the journal line that explains it, in the run's output

    # Past the second wave's age, the second host's runs see the canary's verdict: it stays on c2.
    def holds() -> dict[str, Any] | None:
        p = read_json(fleet, early, "/var/lib/reconciler/pull.json")
        seen = p.get("head") == c3 and p.get("skipped") and "failed it" in p["skipped"][0]["why"]
        return p if seen else None
    held = wait_for("a run of the second host that sees the canary's verdict", holds, 45)
    assert time.time() - pushed > AFTER
    assert held["target"] == c2 and held["skipped"][0]["revision"] == c3, held
    assert held["skipped"][0]["why"] == f"{canary.name} (canary) failed it: {reason}", held
    assert runs(fleet, early, c2)
    assert "STANDIN_CRASH_AFTER" not in fleet.environment(early, "model-a")

    # The fleet as the hosts' records say, read over SSH from this machine: both hosts.
    code, rows = run_json("status", "--live", "--repo", str(repo.path), check_codes=(0,))
    by = {r["host"]: r for r in rows if r["service"] == "model-a"}
    assert set(by) == {canary.name, early.name}, rows
    assert by[canary.name]["running_rev"] == c2 and by[early.name]["running_rev"] == c2, rows
    assert by[canary.name]["last_event"] == f"quarantined: desired {c3[:7]} quarantined ({reason}), running {c2[:7]}"
    assert by[early.name]["last_event"] == f"out-of-sync: runs {c2[:7]}; {c3[:7]} changes it", rows
    print(f"\n--- {early.name}: reconcile pull (journal)\n{journal(fleet, early)[-2500:]}")

    # --uninstall takes the units away again.
    said = fleet.ssh(early, f"{RECONCILE} pull --uninstall 2>&1")
    assert "/etc/systemd/system/reconciler-pull.timer: removed" in said, said
    assert fleet.ssh(early, "ls /etc/systemd/system/reconciler-pull.* 2>/dev/null | wc -l").strip() == "0"
    assert fleet.ssh(early, "systemctl is-active reconciler-pull.timer", check=False).strip() == "inactive"


SIGNERS = "/etc/reconciler/allowed_signers"


def push_as(repo: DesiredRepo, url: str, message: str, key=None) -> str:
    """Commit (signed with `key`, else unsigned) and push it to the served repo."""
    rev = signing.commit(repo.path, message, key)
    res = subprocess.run(["git", "-C", str(repo.path), "push", "-q", url, "HEAD:refs/heads/main"], capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    return rev


def exposure(fleet: Fleet, h: fleetlib.Host, unit: str) -> float:
    """systemd-analyze's overall exposure of a unit file on the host (0 best, 10 worst)."""
    line = fleet.ssh(h, f"systemd-analyze security --offline=yes {unit} 2>&1 | tail -1")
    return float(line.split(":")[1].split()[0])


@pytest.mark.timeout(240)
def test_pull_trusts_only_signed_commits_over_a_secure_transport(fleet: Fleet, hosts, served: str, repo, tmp_path):
    """H3: a host in pull mode deploys only what its allowed_signers file trusts. An unsigned head
    with nothing signed below it (a run, an install) and a plaintext URL are refused, and the host
    is left as it was; a signed head installs sandboxed, root-only units and deploys; an unsigned
    commit pushed on top of it is passed over for the signed one, and the run says so."""
    canary = hosts[0]
    key = signing.keypair(tmp_path)
    _ssh_in(fleet, canary, f"install -d -m 0755 /etc/reconciler && umask 022 && cat > {SIGNERS}",
            signing.allowed_signers(tmp_path / "allowed_signers", key).read_bytes())
    write_fleet(repo, [canary], {"model-a": {"port": 30000, "env": {"V": "1"}, "health": {"stable_for": 1}}})
    unsigned = push_as(repo, served, "unsigned")
    pull = f"cd / && {RECONCILE} pull --host {canary.name}"

    def refused(args: str) -> str:
        out = fleet.ssh(canary, f"{pull} {args} 2>&1; echo rc=$?")
        assert out.rstrip().endswith("rc=1"), out
        return out

    assert f"refused (Unsigned): commit {unsigned[:7]} is not signed" in refused(f"--repo {REPO} "
                                                                               f"--allowed-signers {SIGNERS}")
    assert "--allowed-signers FILE is required" in refused(f"--repo {REPO}")
    assert "refused (InsecureTransport)" in refused(f"--repo {served} --allowed-signers {SIGNERS}")
    assert "refused (Unsigned)" in refused(f"--repo {REPO} --allowed-signers {SIGNERS} --install --interval 5s")
    assert fleet.no_records(canary) and not fleet.exists(canary, "/etc/systemd/system/model-a.service")
    assert not fleet.exists(canary, "/etc/systemd/system/reconciler-pull.service")
    assert not fleet.exists(canary, "/var/lib/reconciler/pull/repos")      # nothing fetched over git://

    write_fleet(repo, [canary], {"model-a": {"port": 30000, "env": {"V": "2"}, "health": {"stable_for": 1}}})
    signed = push_as(repo, served, "signed", key)
    said = fleet.ssh(canary, f"{pull} --repo {REPO} --allowed-signers {SIGNERS} --install --interval 5s 2>&1")
    assert (f"trusts: only revisions signed by a key in {SIGNERS} deploy (the head {signed[:7]} is signed by "
            f"{signing.PRINCIPAL})") in said, said
    wait_for(f"{signed[:7]} on the canary", lambda: runs(fleet, canary, signed), 60)
    assert f"head {signed[:7]} (signed by {signing.PRINCIPAL})" in journal(fleet, canary)
    unit = "/etc/systemd/system/reconciler-pull.service"
    assert fleet.ssh(canary, f"stat -c '%a %U' {unit} /etc/systemd/system/reconciler-pull.timer").split() == \
        ["600", "root", "600", "root"]
    score = exposure(fleet, canary, unit)
    print(f"\n--- systemd-analyze security --offline=yes {unit}: {score}")
    assert score < 4.0

    # an unsigned commit on top (a forge's web merge): the path unit starts a run at once, which
    # follows the newest signed commit and says so (review N9 c); the host stays put
    write_fleet(repo, [canary], {"model-a": {"port": 30000, "env": {"V": "3"}, "health": {"stable_for": 1}}})
    bad = push_as(repo, served, "unsigned on top")
    wait_for("the run that passes it over", lambda: f"the branch head {bad[:7]} is refused (Unsigned: commit "
             f"{bad[:7]} is not signed" in journal(fleet, canary), 30)
    assert f"following {signed[:7]}, its newest first-parent ancestor signed by a trusted key" in journal(fleet, canary)
    recorded = wait_for("the run's record", lambda: (p := read_json(fleet, canary, "/var/lib/reconciler/pull.json"))
                        .get("fallback") and p, 30)
    assert recorded["head"] == recorded["target"] == signed and bad[:7] in recorded["fallback"], recorded
    assert runs(fleet, canary, signed) and "V=2" in fleet.environment(canary, "model-a")
