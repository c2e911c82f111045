"""Pull mode trusts what the host was told to trust (H3, L9), without a host: the flags, the
repo's URL, the head's signature (an unsigned head: nothing is touched), an unsigned candidate
of a wave passed over, the mirror's mode and network time-outs, and the units: root-only,
sandboxed, run by an interpreter only root can change."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pygit2
import pytest

from reconciler.desired.load import load_desired
from reconciler.desired.source import snapshot
from reconciler.desired.trust import RevisionRefused, TrustPolicy
from reconciler.pull import _git
from reconciler.pull._run import PullOptions, _choose, pull_once, signed_head
from reconciler.pull._units import SANDBOX, SERVICE, TIMER, install, render_units, untrusted_paths
from tests import signing
from tests.conftest import ROOT, DesiredRepo
from tests.pull.test_pull_git import Systemctl

TOKEN = "glpat-AbCdEfGhIjKlMnOpQrSt"


def pull(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reconciler", "pull", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env={**os.environ, "NO_COLOR": "1"})


def test_a_run_must_say_whom_it_trusts(tmp_path):
    res = pull("--repo", str(tmp_path))
    assert res.returncode == 1 and "--allowed-signers FILE is required" in res.stderr and "--allow-unsigned" in \
        res.stderr
    res = pull("--repo", str(tmp_path), "--allowed-signers", str(tmp_path / "s"), "--allow-unsigned")
    assert res.returncode == 1 and "--allowed-signers and --allow-unsigned: choose one" in res.stderr


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/fleet.git", "git://127.0.0.1:9/fleet.git"])
def test_a_plaintext_url_is_refused_before_anything_is_fetched(tmp_path, url):
    res = pull("--repo", url, "--allow-unsigned", "--dir", str(tmp_path / "pull"))
    assert res.returncode == 1 and "refused (InsecureTransport)" in res.stderr, res.stderr
    assert not (tmp_path / "pull").exists()
    res = pull("--repo", url, "--allow-unsigned", "--dir", str(tmp_path / "pull"), "--allow-insecure-transport")
    assert res.returncode == 1 and "cannot fetch" in res.stderr          # allowed: fetched (nobody listens)


@pytest.mark.parametrize("url", [f"https://{TOKEN}@127.0.0.1:9/fleet.git", f"https://oauth2:{TOKEN}@127.0.0.1:9/x.git"])
def test_a_token_in_the_url_is_refused_and_never_shown(tmp_path, url):
    for args in ((), ("--install",)):
        res = pull("--repo", url, "--allow-unsigned", "--dir", str(tmp_path / "pull"), *args)
        assert res.returncode == 1 and "refused (CredentialsInUrl)" in res.stderr, res.stderr
        assert TOKEN not in res.stdout + res.stderr
    assert not (tmp_path / "pull").exists()


def valid_state(r: DesiredRepo, env: str, waves: str = "") -> None:
    r.write("fleet.toml", waves)
    r.write("units/m.service", "[Service]\nExecStart=/usr/bin/server\n")
    r.write("hosts/a.toml", 'address = "127.0.0.9"\nlabels = { wave = "canary" }\n'
                            f'[services.m]\nunit_file = "units/m.service"\nenv = {{ V = "{env}" }}\n')
    r.write("hosts/b.toml", 'address = "127.0.0.10"\n')


def test_an_unsigned_head_with_no_signed_ancestor_is_refused_and_the_host_never_touched(tmp_path):
    r = DesiredRepo(tmp_path / "r")
    key = signing.keypair(tmp_path)
    signers = signing.allowed_signers(tmp_path / "allowed_signers", key)
    valid_state(r, "1")
    signing.commit(r.path, "unsigned too")
    valid_state(r, "2")
    head = signing.commit(r.path, "unsigned")
    touched: list[str] = []

    async def connect(host):        # the host: recorded, never reached
        touched.append(host.name)
        raise AssertionError("the run contacted the host")

    opts = PullOptions(repo=str(r.path), host="a", trust=TrustPolicy.of(require_signed=True, allowed_signers=signers))
    with pytest.raises(RevisionRefused) as e:
        asyncio.run(pull_once(opts, connect=connect))
    assert e.value.reason == "Unsigned" and touched == []
    assert str(e.value) == (f"commit {head[:7]} is not signed; only commits signed by a key in {signers} may deploy; "
                            f"nor is any of its 100 newest first-parent ancestors signed by a trusted key")


def test_an_unsigned_head_is_followed_by_its_newest_signed_first_parent_ancestor_and_said(tmp_path):
    """Review N9 (c): a forge's unsigned merge on top no longer halts every pulling host."""
    r = DesiredRepo(tmp_path / "r")
    key, stranger = signing.keypair(tmp_path), signing.keypair(tmp_path, "stranger")
    signers = signing.allowed_signers(tmp_path / "allowed_signers", key)
    revs = {}
    for name, k in (("old", key), ("signed", key), ("by a stranger", stranger), ("unsigned", None)):
        valid_state(r, name)
        revs[name] = signing.commit(r.path, name, k)
    opts = PullOptions(repo=str(r.path), host="a", trust=TrustPolicy.of(require_signed=True, allowed_signers=signers))
    head = snapshot(r.repo, None)
    snap, signer, why = signed_head(r.repo, head, opts)
    assert (snap.revision, signer) == (revs["signed"], signing.PRINCIPAL)
    assert why == (f"the branch head {revs['unsigned'][:7]} is refused (Unsigned: commit {revs['unsigned'][:7]} is not "
                   f"signed; only commits signed by a key in {signers} may deploy); following {revs['signed'][:7]}, "
                   f"its newest first-parent ancestor signed by a trusted key")
    assert load_desired(snap).hosts["a"].services["m"].env == {"V": "signed"}
    # a signed head is followed as it is; a revision asked for by name is that one or nothing
    assert signed_head(r.repo, snapshot(r.repo, revs["signed"]), opts)[2] is None
    with pytest.raises(RevisionRefused) as e:
        signed_head(r.repo, snapshot(r.repo, "main"), PullOptions(repo=str(r.path), rev="main", trust=opts.trust))
    assert e.value.reason == "Unsigned"
    # unsigned revisions accepted: the head, whatever it is
    assert signed_head(r.repo, head, PullOptions(repo=str(r.path)))[0].revision == revs["unsigned"]


def test_a_wave_passes_over_an_unsigned_commit(tmp_path):
    r = DesiredRepo(tmp_path / "r")
    key = signing.keypair(tmp_path)
    signers = signing.allowed_signers(tmp_path / "allowed_signers", key)
    waves = ('[pull]\nwaves = [ { name = "canary", labels = { wave = "canary" } }, '
             '{ name = "rest", after = "1h" } ]\n')
    now = int(time.time())
    revs = {}
    for name, k, age in (("old", key, 4 * 3600), ("unsigned", None, 3 * 3600), ("head", key, 60)):
        valid_state(r, name, waves)
        revs[name] = signing.commit(r.path, name, k, when=now - age)
    opts = PullOptions(repo=str(r.path), trust=TrustPolicy.of(require_signed=True, allowed_signers=signers))
    snap = snapshot(r.repo, None)
    choice, _, loaded = _choose(r.repo, snap, load_desired(snap), "b", None, opts, now=now)
    assert choice.revision == revs["old"], choice         # the unsigned one, old enough, is passed over
    assert [s.revision for s in choice.skipped] == [revs["head"], revs["unsigned"]]
    assert choice.skipped[1].why.startswith(f"refused (Unsigned: commit {revs['unsigned'][:7]} is not signed")
    assert revs["unsigned"] not in loaded
    # a host that applied the unsigned revision (before signing was required) stays put: nothing runs
    choice, _, _ = _choose(r.repo, snap, load_desired(snap), "b", revs["unsigned"], opts, now=now)
    assert choice.revision is None and choice.why.startswith(f"staying put: the applied revision "
                                                             f"{revs['unsigned'][:7]} is refused (Unsigned")
    # the same history with --allow-unsigned: the newest old enough commit, unsigned or not
    choice, _, _ = _choose(r.repo, snap, load_desired(snap), "b", None, PullOptions(repo=str(r.path)), now=now)
    assert choice.revision == revs["unsigned"]


def test_the_mirror_is_roots_alone_and_fetched_with_time_outs(tmp_path, monkeypatch):
    server = pygit2.init_repository(str(tmp_path / "server.git"), bare=True, initial_head="main")
    sig = pygit2.Signature("Test", "test@example.invalid")
    server.create_commit("refs/heads/main", sig, sig, "c", server.TreeBuilder().write(), [])
    work = tmp_path / "pull"
    (work / "repos").mkdir(parents=True, mode=0o755)           # as an older version made it
    (work / "repos").chmod(0o755)
    monkeypatch.setattr(pygit2.settings, "server_timeout", 0)
    clone = _git.open_clone(f"file://{server.path}", work)
    assert Path(clone.path).is_relative_to(work / "repos")
    assert (work / "repos").stat().st_mode & 0o777 == 0o700
    assert (pygit2.settings.server_timeout, pygit2.settings.server_connect_timeout) == (60_000, 30_000)


def test_the_service_is_sandboxed_and_the_units_root_only(tmp_path):
    argv = ["/opt/venv/bin/python3", "-m", "reconciler", "pull", "--repo", "/srv/fleet.git", "--allowed-signers",
            "/etc/reconciler/allowed_signers"]
    units = render_units(argv, interval=60, splay=0, watch=None)
    svc = units[SERVICE]
    assert svc.endswith(SANDBOX)
    for line in ("NoNewPrivileges=yes", "ProtectHome=read-only", "PrivateTmp=yes", "ProtectKernelTunables=yes",
                 "RestrictSUIDSGID=yes", "SystemCallArchitectures=native",
                 "Environment=RECONCILER_STATE_DIR=/var/lib/reconciler/pull/state "
                 "RECONCILER_CACHE_DIR=/var/cache/reconciler-pull"):
        assert line + "\n" in svc
    # an older version's unit, same text but 0644: made root-only without a rewrite
    sc = Systemctl()
    (tmp_path / TIMER).write_text(units[TIMER])
    (tmp_path / TIMER).chmod(0o644)
    said = install(units, unit_dir=tmp_path, run=sc)
    assert f"{tmp_path / TIMER}: unchanged, made root-only (0600)" in said
    assert f"{tmp_path / SERVICE}: written" in said
    for name in units:
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o600
    assert not list(tmp_path.glob(".*.tmp"))


def fake_lstat(owners: dict[str, tuple[int, int]]):
    """An lstat over made-up paths: path -> (uid, mode); anything else is root's 0755 directory."""
    def lstat(path: str) -> os.stat_result:
        uid, mode = owners.get(path, (0, 0o40755))
        return SimpleNamespace(st_uid=uid, st_mode=mode)     # type: ignore[return-value]
    return lstat


def test_only_an_interpreter_root_alone_can_change_runs_as_root():
    code = ("/opt/rp/bin/python3", "/opt/rp", "/opt/rp/lib/python3.11/site-packages/reconciler")
    assert untrusted_paths(code, lstat=fake_lstat({})) is None
    # a venv a user owns, a group-writable package directory, a world-writable /opt
    assert untrusted_paths(code, lstat=fake_lstat({"/opt/rp": (1000, 0o40755)})) == \
        "/opt/rp (owner uid 1000, mode 0755)"
    assert untrusted_paths(code, lstat=fake_lstat({"/opt/rp/lib/python3.11/site-packages": (0, 0o42775)})) == \
        "/opt/rp/lib/python3.11/site-packages (owner uid 0, mode 2775)"
    assert untrusted_paths(code, lstat=fake_lstat({"/opt": (0, 0o41777)})) == "/opt (owner uid 0, mode 1777)"
    # a symlink is judged by who owns it and where it lives, not by its own 0777
    assert untrusted_paths(code, lstat=fake_lstat({"/opt/rp/bin/python3": (0, 0o120777)})) is None


def test_the_units_command_line_carries_the_deploy_key_and_the_pinned_host_key(tmp_path):
    from reconciler.cli.pull import _unit_argv
    opts = PullOptions(repo="ssh://git@127.0.0.5/srv/git/fleet.git", trust=TrustPolicy.of(require_signed=False),
                       ssh_key="/etc/reconciler/pull/deploy_key", known_hosts="/etc/reconciler/pull/known_hosts")
    argv = _unit_argv(opts, opts.repo, "gpu-1", None)
    assert argv[argv.index("--ssh-identity") + 1] == "/etc/reconciler/pull/deploy_key"
    assert argv[argv.index("--known-hosts") + 1] == "/etc/reconciler/pull/known_hosts"
    assert "--ssh-identity" not in _unit_argv(PullOptions(repo=opts.repo), opts.repo, "gpu-1", None)


def test_a_deploy_key_others_can_read_is_refused_before_anything_is_made(tmp_path):
    from reconciler.desired.gitauth import GitAuth
    from reconciler.errors import SourceError
    from reconciler.pull._git import open_clone
    key = tmp_path / "deploy_key"
    key.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    key.chmod(0o644)
    with pytest.raises(SourceError) as e:
        open_clone("ssh://git@127.0.0.9/srv/git/fleet.git", tmp_path / "pull", GitAuth(str(key)))
    assert str(e.value).startswith(f"SSH key {key} must be uid 0's alone (owner uid 0, mode 0644)")
    assert not (tmp_path / "pull").exists()
