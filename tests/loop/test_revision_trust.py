"""Opening a revision for a run under the trust policy (loop/revision.py): the tip is verified
before anything is loaded or decrypted, and a rollback renders a revision named by a host's
record only when it verifies too (real repositories, commits signed by git with an ssh key)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.desired.source import snapshot
from reconciler.desired.trust import RevisionRefused, TrustPolicy
from reconciler.loop.options import RunOptions
from reconciler.loop.revision import open_revision
from tests import signing
from tests.conftest import DesiredRepo

UNIT = "[Service]\nExecStart=/usr/bin/server --port {vars.port}\n"


def state_files(repo: DesiredRepo, port: int) -> None:
    repo.write("fleet.toml", "")
    repo.write("units/m.service", UNIT)
    repo.write("hosts/a.toml", f'address = "127.0.0.9"\n[services.m]\nunit_file = "units/m.service"\n'
                               f'vars = {{ port = "{port}" }}\n')


@pytest.fixture
def history(tmp_path: Path) -> tuple[DesiredRepo, Path, dict[str, str]]:
    """unsigned (an old last good), signed, then an unsigned head."""
    r = DesiredRepo(tmp_path / "r")
    key = signing.keypair(tmp_path)
    revs = {}
    for port, (name, k) in enumerate((("old-unsigned", None), ("signed", key), ("head-unsigned", None)), 8000):
        state_files(r, port)
        revs[name] = signing.commit(r.path, name, k)
    return r, signing.allowed_signers(tmp_path / "allowed_signers", key), revs


def test_an_unsigned_tip_is_refused_before_it_is_loaded(history):
    r, signers, revs = history
    opts = RunOptions(repo=str(r.path), trust=TrustPolicy.of(require_signed=True, allowed_signers=signers))
    r.write("hosts/a.toml", "this is not TOML [")           # the head's tree is never read: refused first
    signing.commit(r.path, "broken and unsigned")
    with pytest.raises(RevisionRefused) as e:
        open_revision(snapshot(r.repo, None), opts)
    assert e.value.reason == "Unsigned"
    # the same head without a policy that asks for signatures: loaded (and found broken)
    from reconciler.errors import ConfigError
    with pytest.raises(ConfigError):
        open_revision(snapshot(r.repo, None), RunOptions(repo=str(r.path)))


def test_a_signed_tip_opens_and_names_its_signer(history):
    r, signers, revs = history
    opts = RunOptions(repo=str(r.path), trust=TrustPolicy.of(require_signed=True, allowed_signers=signers))
    rev = open_revision(snapshot(r.repo, revs["signed"]), opts)
    assert rev.signer == signing.PRINCIPAL and rev.revision == revs["signed"]
    assert open_revision(snapshot(r.repo, revs["signed"]), RunOptions(repo=str(r.path))).signer is None


def test_a_rollback_target_is_verified_like_a_tip(history):
    r, signers, revs = history
    opts = RunOptions(repo=str(r.path), trust=TrustPolicy.of(require_signed=True, allowed_signers=signers))
    rev = open_revision(snapshot(r.repo, revs["signed"]), opts)
    assert rev.render_at is not None
    # a host's record names the old unsigned revision as its last good: not rendered, and said why
    assert rev.render_at(revs["old-unsigned"]) is None
    assert rev.refused == {revs["old-unsigned"]: f"Unsigned: commit {revs['old-unsigned'][:7]} is not signed; "
                                                 f"only commits signed by a key in {signers} may deploy"}
    good = rev.render_at(revs["signed"])
    assert good is not None and "--port 8001" in good.hosts["a"].services["m"].unit_text
    # without a signing policy the old revision renders, as before
    plain = open_revision(snapshot(r.repo, revs["signed"]), RunOptions(repo=str(r.path)))
    assert plain.render_at is not None
    old = plain.render_at(revs["old-unsigned"])
    assert old is not None and "--port 8000" in old.hosts["a"].services["m"].unit_text and plain.refused == {}
