"""Revision safety, controller config and hook shims, without hosts."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.controller.config import load_config
from reconciler.controller.hooks import shim
from reconciler.desired.source import open_repo, shown_url
from reconciler.desired.trust import (
    RevisionRefused,
    TrustPolicy,
    check_descends,
    url_credentials,
    verify_signature,
)
from reconciler.errors import ConfigError, SourceError
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


# ---- the trust policy (M6, H3) ------------------------------------------------------------------


@pytest.fixture
def signed(tmp_path):
    """A repo with a signed, an unsigned and a foreign-signed commit, and the signers file."""
    from tests import signing
    r = DesiredRepo(tmp_path / "r")
    key, other = signing.keypair(tmp_path), signing.keypair(tmp_path, "other")
    revs = {}
    for name, k in (("signed", key), ("unsigned", None), ("foreign", other)):
        r.write("a", name)
        revs[name] = signing.commit(r.path, name, k)
    return r, signing.allowed_signers(tmp_path / "allowed_signers", key), revs, other


def test_a_policy_that_requires_signing_verifies_each_revision(signed):
    r, signers, revs, _ = signed
    policy = TrustPolicy.of(require_signed=True, allowed_signers=signers, origin="--allowed-signers")
    assert policy.verify(r.repo, revs["signed"]) == "dev@example.invalid"
    for name, reason in (("unsigned", "Unsigned"), ("foreign", "UnknownSigner")):
        with pytest.raises(RevisionRefused) as e:
            policy.verify(r.repo, revs[name])
        assert e.value.reason == reason and revs[name][:7] in str(e.value)
    with pytest.raises(RevisionRefused) as e:
        policy.verify(r.repo, "f" * 40)
    assert e.value.reason == "UnknownRevision"
    # no signing asked: nothing verified, nothing refused
    assert TrustPolicy().verify(r.repo, revs["unsigned"]) is None
    assert TrustPolicy.of(require_signed=True).allowed_signers == ("/etc/reconciler/allowed_signers",)


def test_a_signers_file_others_could_rewrite_is_refused(signed, tmp_path):
    r, signers, revs, _ = signed
    policy = TrustPolicy.of(require_signed=True, allowed_signers=signers)
    signers.chmod(0o664)                       # a group member could add a key
    with pytest.raises(RevisionRefused) as e:
        policy.verify(r.repo, revs["signed"])
    assert e.value.reason == "UntrustedSigners" and "0664" in str(e.value)
    with pytest.raises(RevisionRefused) as e:
        TrustPolicy.of(require_signed=True, allowed_signers=tmp_path / "missing").verify(r.repo, revs["signed"])
    assert e.value.reason == "NoAllowedSigners"


def test_merged_policies_are_the_stricter_of_both(signed, tmp_path):
    from tests import signing
    r, signers, revs, other = signed
    flags = TrustPolicy.of(require_signed=False, insecure_transport=True, origin="flags")
    config = TrustPolicy.of(require_signed=True, allowed_signers=signers, origin="config.toml")
    both = flags.merged(config)
    assert (both.require_signed, both.insecure_transport, both.origin) == (True, False, "flags and config.toml")
    assert both.verify(r.repo, revs["signed"]) == "dev@example.invalid"
    # two signers files: a revision must verify against each
    only_other = signing.allowed_signers(tmp_path / "only_other", other)
    two = config.merged(TrustPolicy.of(require_signed=True, allowed_signers=only_other))
    assert two.allowed_signers == (str(signers), str(only_other))
    with pytest.raises(RevisionRefused) as e:
        two.verify(r.repo, revs["signed"])
    assert e.value.reason == "UnknownSigner" and "only_other" in str(e.value)


def test_a_rollback_renders_only_what_the_policy_lets_deploy(signed):
    r, signers, revs, _ = signed
    policy = TrustPolicy.of(require_signed=True, allowed_signers=signers)
    asked: list[str] = []
    refused: dict[str, str] = {}
    at = policy.render_at(r.repo, lambda rev: asked.append(rev) or None, refused)   # type: ignore[func-returns-value]
    assert at(revs["unsigned"]) is None and at(revs["foreign"][:12]) is None and at("no-such-ref") is None
    assert asked == []                          # never rendered, never parsed
    assert set(refused) == {revs["unsigned"], revs["foreign"][:12], "no-such-ref"}
    assert refused[revs["unsigned"]].startswith("Unsigned: commit")
    at("HEAD~2")                                # a name is resolved once: the commit verified is the one rendered
    assert asked == [revs["signed"]]


@pytest.mark.parametrize("url", ["http://127.0.0.1/fleet.git", "git://127.0.0.1/fleet.git"])
def test_plaintext_schemes_are_refused_unless_allowed(url):
    with pytest.raises(RevisionRefused) as e:
        TrustPolicy().check_url(url)
    assert e.value.reason == "InsecureTransport" and "--allow-insecure-transport" in str(e.value)
    TrustPolicy(insecure_transport=True).check_url(url)


def test_a_scheme_git_cannot_fetch_securely_is_refused_even_when_plaintext_is_allowed():
    for policy in (TrustPolicy(), TrustPolicy(insecure_transport=True)):
        with pytest.raises(RevisionRefused) as e:
            policy.check_url("ftp://127.0.0.1/fleet.git")
        assert e.value.reason == "UnknownTransport"


@pytest.mark.parametrize("url", ["https://127.0.0.1/fleet.git", "ssh://git@127.0.0.1/fleet.git",
                                 "git@127.0.0.1:fleet.git", "file:///srv/fleet.git", "/srv/fleet.git", "."])
def test_secure_schemes_and_local_paths_pass(url):
    TrustPolicy().check_url(url)


def test_a_credential_in_a_url_is_named_never_shown():
    token = "glpat-AbCdEfGhIjKlMnOpQrSt"
    assert url_credentials(f"https://{token}@127.0.0.1/x.git") == \
        "a user name in an http(s) URL (forges take a token there)"
    assert url_credentials(f"https://oauth2:{token}@127.0.0.1/x.git") == "a password"
    assert url_credentials(f"ssh://git:{token}@127.0.0.1/x.git") == "a password"
    for fine in ("ssh://git@127.0.0.1/x.git", "git@127.0.0.1:x.git", "https://127.0.0.1/x.git", "/srv/x.git"):
        assert url_credentials(fine) is None, fine
    with pytest.raises(RevisionRefused) as e:
        TrustPolicy().check_url(f"http://oauth2:{token}@127.0.0.1/x.git")
    assert token not in str(e.value) and "http://***@127.0.0.1/x.git" in str(e.value)
    assert shown_url(f"https://{token}@127.0.0.1/x.git") == "https://***@127.0.0.1/x.git"


def test_a_fetch_that_fails_names_no_part_of_a_password_that_holds_an_at(tmp_path: Path):
    """git reads a URL's authority up to its last @: a password with an @ of its own is still
    all password. The message of a fetch that fails (nobody listens on port 9) shows none of it;
    before, only what came before its first @ was masked."""
    url = "https://oauth2:s3cret@half@127.0.0.1:9/x.git"
    assert shown_url(url) == "https://***@127.0.0.1:9/x.git"
    with pytest.raises(SourceError) as e:
        open_repo(url, tmp_path / "cache")
    assert "cannot fetch https://***@127.0.0.1:9/x.git: " in str(e.value)
    assert "s3cret" not in str(e.value) and "half" not in str(e.value)
