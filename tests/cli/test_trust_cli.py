"""`reconcile` under the trust policy (M6): the flags, and as root the controller's config, which
the flags cannot loosen; a refused revision or URL exits 1 before any host is contacted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reconciler.cli.run import trust_policy
from tests import signing
from tests.conftest import ROOT, DesiredRepo

# No host listens there: a run that got past the policy would report it Unreachable (exit 4).
HOST = 'address = "127.0.0.9"\n[services.m]\nunit_file = "units/m.service"\n'


def reconcile(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reconciler", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env={**os.environ, "NO_COLOR": "1", **(env or {})})


@pytest.fixture
def unsigned_repo(tmp_path: Path) -> tuple[DesiredRepo, Path, Path]:
    r = DesiredRepo(tmp_path / "r")
    r.write("fleet.toml", "")
    r.write("units/m.service", "[Service]\nExecStart=/usr/bin/server\n")
    r.write("hosts/a.toml", HOST)
    signing.commit(r.path, "unsigned")
    key = signing.keypair(tmp_path)
    return r, key, signing.allowed_signers(tmp_path / "allowed_signers", key)


def test_flags_make_the_policy(tmp_path, monkeypatch):
    monkeypatch.setenv("RECONCILER_CONFIG", str(tmp_path / "absent.toml"))
    assert trust_policy(False, None, False, euid=0).require_signed is False
    p = trust_policy(False, str(tmp_path / "signers"), True, euid=0)      # --allowed-signers implies signing
    assert (p.require_signed, p.allowed_signers, p.insecure_transport) == (True, (str(tmp_path / "signers"),), True)
    assert trust_policy(True, None, False).allowed_signers == ("/etc/reconciler/allowed_signers",)


def test_as_root_the_controllers_config_applies_and_flags_cannot_loosen_it(tmp_path, monkeypatch):
    config = tmp_path / "config.toml"
    config.write_text(f'require_signed = true\nallowed_signers = "{tmp_path / "fleet_signers"}"\n')
    monkeypatch.setenv("RECONCILER_CONFIG", str(config))
    as_root = trust_policy(False, None, True, euid=0)
    assert as_root.require_signed and as_root.allowed_signers == (str(tmp_path / "fleet_signers"),)
    assert as_root.insecure_transport is False          # the config does not allow plaintext
    assert str(config) in as_root.origin
    # another user's run is its own flags' (it cannot use the controller's key either)
    assert trust_policy(False, None, True, euid=1000).require_signed is False
    mine = trust_policy(False, str(tmp_path / "mine"), False, euid=0)   # both files must verify
    assert mine.allowed_signers == (str(tmp_path / "mine"), str(tmp_path / "fleet_signers"))


def test_an_invalid_config_as_root_names_file_and_key(tmp_path, monkeypatch, capsys):
    config = tmp_path / "config.toml"
    config.write_text("require_signed = maybe\n")
    monkeypatch.setenv("RECONCILER_CONFIG", str(config))
    with pytest.raises(SystemExit) as e:
        trust_policy(False, None, False, euid=0)
    assert e.value.code == 1
    assert str(config) in capsys.readouterr().err


def test_an_unsigned_head_is_refused_before_any_host(unsigned_repo):
    r, key, signers = unsigned_repo
    res = reconcile("--repo", str(r.path), "--allowed-signers", str(signers))
    assert res.returncode == 1, res.stdout + res.stderr
    assert "refused (Unsigned)" in res.stderr and "127.0.0.9" not in res.stdout + res.stderr
    res = reconcile("--repo", str(r.path), "--require-signed", "--allowed-signers", str(signers), "--json")
    assert res.returncode == 1 and json.loads(res.stdout)["reason"] == "Unsigned"
    # signed, the same run gets to the host (which is not there): the policy was what stopped it
    signing.git(r.path, "commit", "-q", "--amend", "--no-edit", "-S", key=key)
    res = reconcile("--repo", str(r.path), "--allowed-signers", str(signers))
    assert res.returncode == 4, res.stdout + res.stderr
    assert f"signed by {signing.PRINCIPAL}" in res.stderr


def test_a_plaintext_url_is_refused_before_it_is_fetched(tmp_path):
    cache = tmp_path / "cache"
    for url in ("http://127.0.0.1:9/fleet.git", "git://127.0.0.1:9/fleet.git"):
        res = reconcile("--repo", url, "--cache-dir", str(cache))
        assert res.returncode == 1 and "refused (InsecureTransport)" in res.stderr, res.stderr
    assert not cache.exists()                          # nothing mirrored, nothing fetched
    res = reconcile("--repo", "http://127.0.0.1:9/fleet.git", "--cache-dir", str(cache), "--allow-insecure-transport")
    assert res.returncode == 1 and "cannot fetch" in res.stderr     # allowed: then fetched (nobody listens there)
