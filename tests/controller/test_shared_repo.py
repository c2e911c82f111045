"""M5 of the 2026-12-02 review: `init-repo --shared GROUP --owner USER` lets the group write git's
objects and refs (and create a push's lock files) and nothing else of the repo, makes the
daemon's trigger, and changes no git config (no system-wide safe.directory)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.controller.hooks import init_repo

DAEMON = 1                   # the owner: the system's `daemon` user stands in for `reconciler`
NOBODY, NOGROUP = 65534, 65534   # a group member that is not the owner: stands in for `git`

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to other users (the suite runs as root: .ci/test)")


@pytest.fixture
def srv() -> Iterator[Path]:
    """A /srv/git of our own (root's, 0755) that other users can reach (pytest's tmp dirs are 0700)."""
    d = Path(tempfile.mkdtemp(prefix="reconciler-srv-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


def owner_mode(p: Path) -> tuple[int, int, int]:
    st = os.lstat(p)
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


def as_member(script: str) -> subprocess.CompletedProcess[str]:
    """A shell as a member of the repo's group who does not own it."""
    return subprocess.run(["sh", "-c", script], user=NOBODY, group=NOGROUP, extra_groups=[], capture_output=True,
                          text=True, timeout=30)


def test_the_group_writes_objects_and_refs_and_nothing_else(srv):
    repo = srv / "fleet.git"
    notes = init_repo(repo, group="nogroup", owner="daemon", hook_bin="/usr/bin/true")
    assert owner_mode(repo) == (DAEMON, NOGROUP, 0o3775)
    assert owner_mode(repo / "config") == (0, NOGROUP, 0o644)
    assert owner_mode(repo / "HEAD") == (0, NOGROUP, 0o644)
    assert owner_mode(repo / "hooks") == (0, NOGROUP, 0o2755)
    assert owner_mode(repo / "hooks" / "pre-receive") == (0, NOGROUP, 0o755)
    for data in ("objects", "refs", "refs/heads"):
        assert owner_mode(repo / data) == (DAEMON, NOGROUP, 0o2775), data
    trigger = repo / "reconciler.trigger"
    assert owner_mode(trigger) == (DAEMON, NOGROUP, 0o660) and stat.S_ISREG(os.lstat(trigger).st_mode)
    before = (repo / "config").read_text()

    refused = {"plant the trigger": (f"ln -sfn /etc/shadow {trigger}", "Operation not permitted"),
               "edit config": (f"echo '[core] pager = id' >> {repo}/config", "Permission denied"),
               "replace config": (f"t=$(mktemp) && cp {repo}/config $t && mv -f $t {repo}/config",
                                  "Operation not permitted"),
               "add a hook": (f"echo id > {repo}/hooks/update", "Permission denied"),
               "swap the repo": (f"mv {repo} {srv}/old.git", "Permission denied")}
    for what, (cmd, error) in refused.items():
        res = as_member(cmd)
        assert res.returncode != 0 and error in res.stderr, (what, res.stderr)
    assert (repo / "config").read_text() == before and not trigger.is_symlink()
    assert not (repo / "hooks" / "update").exists() and repo.is_dir()

    # what the group is for: a push's objects, refs and lock files (as git writes them), the trigger
    res = as_member(f"mkdir {repo}/objects/ab && echo x > {repo}/objects/ab/cd && "
                    f"echo {'1' * 40} > {repo}/refs/heads/main.lock && mv {repo}/refs/heads/main.lock "
                    f"{repo}/refs/heads/main && : > {repo}/HEAD.lock && rm {repo}/HEAD.lock && "
                    f"echo bumped >> {trigger}")
    assert res.returncode == 0, res.stderr

    assert notes[1] == ("each pushing user trusts it in their own git config (never the system's): runuser -u USER "
                        f"-- git config --global --add safe.directory {repo}")
    system = subprocess.run(["git", "config", "--system", "--get-all", "safe.directory"], capture_output=True,
                            text=True)
    assert str(repo) not in system.stdout.split()
