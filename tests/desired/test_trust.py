"""Revision safety, controller config and hook shims, without hosts."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.controller.config import load_config
from reconciler.controller.hooks import shim
from reconciler.desired.trust import RevisionRefused, check_descends, verify_signature
from reconciler.errors import ConfigError
from tests.conftest import DesiredRepo

ROOT = Path(__file__).resolve().parents[2]


def test_descendant_check(tmp_path):
    r = DesiredRepo(tmp_path / "r")
    r.write("a", "1")
    c1 = r.commit()
    r.write("a", "2")
    c2 = r.commit()
    check_descends(r.repo, None, c1)
    check_descends(r.repo, c1, c2)
    check_descends(r.repo, c2, c2)
    with pytest.raises(RevisionRefused) as e:
        check_descends(r.repo, c2, c1)
    assert e.value.reason == "NotDescendant" and c1[:7] in str(e.value)
    with pytest.raises(RevisionRefused):
        check_descends(r.repo, "f" * 40, c2)        # last applied no longer in the repo


def test_unsigned_commit_refused(tmp_path):
    r = DesiredRepo(tmp_path / "r")
    r.write("a", "1")
    c1 = r.commit()
    (tmp_path / "signers").write_text("")
    with pytest.raises(RevisionRefused) as e:
        verify_signature(r.repo, c1, tmp_path / "signers")
    assert e.value.reason == "Unsigned"


def test_config_file_and_env_overrides(tmp_path, monkeypatch):
    p = tmp_path / "config.toml"
    p.write_text('repo = "/srv/git/fleet.git"\ninterval = 30\nrequire_signed = true\n')
    monkeypatch.setenv("RECONCILER_BRANCH", "prod")
    cfg = load_config(p)
    assert (cfg.repo, cfg.interval, cfg.require_signed, cfg.branch) == ("/srv/git/fleet.git", 30, True, "prod")
    p.write_text('repo = "x"\nintervall = 30\n')
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "intervall" in str(e.value) and str(p) in str(e.value)


def test_hook_files_in_repo_match_what_init_repo_installs():
    for name in ("pre-receive", "post-receive"):
        f = ROOT / "hooks" / name
        assert f.read_text() == shim(name)
        assert f.stat().st_mode & 0o111
