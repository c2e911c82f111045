"""End-to-end: pull mode follows an ssh:// URL with the host's own deploy key (review N9a), as
docs/pull.md says to set it up, on two real hosts.

  * the git server is the first host's sshd: a `git` account (shell git-shell) holding a bare repo,
    whose authorized_keys has the pull host's deploy key with `restrict` (and this machine's
    pusher key);
  * the pull host makes its own key in /etc/reconciler/pull, pins the server's host key in a
    known_hosts file there, and installs `reconcile pull --install --repo ssh://git@SERVER/...
    --ssh-identity ... --known-hosts ... --allowed-signers ...`; its timer fetches over SSH with
    that key and deploys the signed commits this machine pushes.

A key the server does not know, a host key that is not the server's, and a key file others can
read each fail in one line, exit 1, with nothing changed on the host.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests import fleet as fleetlib
from tests import signing
from tests.conftest import DesiredRepo, Fleet, write_fleet
from tests.e2e.test_e2e_pull import RECONCILE, _ssh_in, hosts, journal, runs, wait_for  # noqa: F401 (fixture)

pytestmark = pytest.mark.fleet

SRV = "/srv/git/fleet.git"
PULL = "/etc/reconciler/pull"
SIGNERS = "/etc/reconciler/allowed_signers"
SETUP_SERVER = f"""
id git >/dev/null 2>&1 || useradd -m -s /usr/bin/git-shell git
install -d -o git -g git -m 0700 ~git/.ssh
rm -rf /srv/git && install -d -o git -g git -m 0755 /srv/git
runuser -u git -- git init -q --bare -b main {SRV}
"""
CLEANUP = f"rm -rf /srv/git {PULL} {SIGNERS}; userdel -r git >/dev/null 2>&1; true"


def authorize(fleet: Fleet, server: fleetlib.Host, *public_keys: str) -> None:
    """The git account's authorized_keys: each key with `restrict` (no terminal, no forwarding)."""
    lines = "".join(f"restrict {k.strip()}\n" for k in public_keys)
    _ssh_in(fleet, server, "cat > ~git/.ssh/authorized_keys && chown git:git ~git/.ssh/authorized_keys && "
                           "chmod 600 ~git/.ssh/authorized_keys", lines.encode())


def push(repo: DesiredRepo, url: str, pusher: Path, known_hosts: Path, message: str, key: Path) -> str:
    """Commit (signed) and push over SSH as the git account, with this machine's pusher key."""
    rev = signing.commit(repo.path, message, key)
    ssh = (f"ssh -i {pusher} -o IdentitiesOnly=yes -o BatchMode=yes -o UserKnownHostsFile={known_hosts} "
           f"-o StrictHostKeyChecking=yes -F /dev/null")
    res = subprocess.run(["git", "-C", str(repo.path), "push", "-q", url, "HEAD:refs/heads/main"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "GIT_SSH_COMMAND": ssh})
    assert res.returncode == 0, res.stderr
    return rev


@pytest.mark.timeout(300)
def test_a_pull_host_follows_an_ssh_url_with_its_own_deploy_key(fleet: Fleet, hosts, repo, tmp_path):  # noqa: F811
    server, puller = hosts
    url = f"ssh://git@{server.address}{SRV}"
    try:
        fleet.ssh(server, SETUP_SERVER)
        # docs/pull.md, "Over SSH: the host's own deploy key", step by step on the pull host
        fleet.ssh(puller, f"install -d -m 0700 {PULL} && ssh-keygen -q -t ed25519 -N '' -C pull@{puller.name} "
                          f"-f {PULL}/deploy_key")
        deploy_pub = fleet.ssh(puller, f"cat {PULL}/deploy_key.pub")
        pusher = signing.keypair(tmp_path, "pusher")
        authorize(fleet, server, deploy_pub, pusher.with_suffix(".pub").read_text())
        fleet.ssh(puller, f"ssh-keyscan -t ed25519 {server.address} > {PULL}/known_hosts 2>/dev/null")
        printed = fleet.ssh(puller, f"ssh-keygen -lf {PULL}/known_hosts").split()
        known = tmp_path / "known_hosts"
        known.write_text(server.known_hosts_line() + "\n")
        expected = subprocess.run(["ssh-keygen", "-lf", str(known)], capture_output=True, text=True,
                                  check=True).stdout.split()
        assert printed[1] == expected[1]                  # the fingerprint compared, as the docs ask

        signer = signing.keypair(tmp_path)
        _ssh_in(fleet, puller, f"install -d -m 0755 /etc/reconciler && umask 022 && cat > {SIGNERS}",
                signing.allowed_signers(tmp_path / "allowed_signers", signer).read_bytes())
        write_fleet(repo, [puller], {"model-a": {"port": 30000, "env": {"V": "1"}, "health": {"stable_for": 1}}})
        c1 = push(repo, url, pusher, known, "first", signer)

        flags = (f"--repo {url} --host {puller.name} --ssh-identity {PULL}/deploy_key --known-hosts {PULL}/known_hosts "
                 f"--allowed-signers {SIGNERS}")
        said = fleet.ssh(puller, f"cd / && {RECONCILE} pull --install {flags} --interval 2s 2>&1")
        assert f"--ssh-identity {PULL}/deploy_key --known-hosts {PULL}/known_hosts" in said, said
        assert f"the head {c1[:7]} is signed by {signing.PRINCIPAL}" in said, said
        wait_for(f"{c1[:7]} on the pull host", lambda: runs(fleet, puller, c1), 60)
        assert f"head {c1[:7]} (signed by {signing.PRINCIPAL})" in journal(fleet, puller)
        # its run was recorded in the unit's state directory, which passes the state-directory checks
        assert fleet.ssh(puller, "stat -c '%a %U' /var/lib/reconciler/pull/state/state.db").split() == ["600", "root"]
        assert "error:" not in journal(fleet, puller)

        # a new commit reaches it by the timer, over SSH again
        write_fleet(repo, [puller], {"model-a": {"port": 30000, "env": {"V": "2"}, "health": {"stable_for": 1}}})
        c2 = push(repo, url, pusher, known, "second", signer)
        wait_for(f"{c2[:7]} on the pull host", lambda: runs(fleet, puller, c2), 60)
        assert "V=2" in fleet.environment(puller, "model-a")
        fleet.ssh(puller, f"{RECONCILE} pull --uninstall")
        mirror = fleet.ssh(puller, "ls /var/lib/reconciler/pull/repos").split()

        def refused(args: str) -> str:
            out = fleet.ssh(puller, f"cd / && {RECONCILE} pull --repo {url} --host {puller.name} "
                                    f"--allowed-signers {SIGNERS} --dry-run {args} 2>&1; echo rc=$?")
            assert out.rstrip().endswith("rc=1") and "Traceback" not in out, out
            assert out.count("\n") == 2, out                 # one line, then rc=1
            return out.splitlines()[0]

        shown = f"ssh://***@{server.address}{SRV}"
        # a key the server does not know
        fleet.ssh(puller, f"ssh-keygen -q -t ed25519 -N '' -f {PULL}/other_key")
        assert refused(f"--ssh-identity {PULL}/other_key --known-hosts {PULL}/known_hosts") == (
            f"error: cannot fetch {shown}: the server refused the SSH key {PULL}/other_key for user git: add its "
            f"public key to git's authorized_keys there (a read-only deploy key), or give the key it knows (reconcile "
            f"pull --ssh-identity)")
        # a server whose host key is not the pinned one: refused before any key is offered
        fleet.ssh(puller, f"echo \"{server.address} $(cut -d' ' -f1,2 {PULL}/other_key.pub)\" > {PULL}/wrong_hosts")
        assert refused(f"--ssh-identity {PULL}/deploy_key --known-hosts {PULL}/wrong_hosts") == (
            f"error: cannot fetch {shown}: the SSH host key of {server.address} is not in {PULL}/wrong_hosts (or "
            f"differs from it): not connecting. Get the key from the server's administrator, or `ssh-keyscan "
            f"{server.address}` and compare its fingerprint with theirs, then add that line to {PULL}/wrong_hosts")
        # and no known_hosts at all (root's ~/.ssh/known_hosts has no such line)
        assert "is not in ~/.ssh/known_hosts (or differs from it)" in refused(f"--ssh-identity {PULL}/deploy_key")
        # a deploy key others can read
        fleet.ssh(puller, f"chmod 0640 {PULL}/deploy_key")
        assert refused(f"--ssh-identity {PULL}/deploy_key --known-hosts {PULL}/known_hosts") == (
            f"error: SSH key {PULL}/deploy_key must be uid 0's alone (owner uid 0, mode 0640): chown 0 "
            f"{PULL}/deploy_key && chmod 600 {PULL}/deploy_key")
        assert runs(fleet, puller, c2) and "V=2" in fleet.environment(puller, "model-a")
        assert fleet.ssh(puller, "ls /var/lib/reconciler/pull/repos").split() == mirror
    finally:
        for h in hosts:
            fleet.ssh(h, f"{RECONCILE} pull --uninstall >/dev/null 2>&1; {CLEANUP}", check=False)
