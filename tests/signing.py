"""SSH-signed commits for the tests of the trust policy: a key, an allowed_signers file that
names it, and commits signed with it by git itself (`git commit -S`, gpg.format=ssh), as a
developer signs them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

PRINCIPAL = "dev@example.invalid"
_GIT_ENV = {"GIT_AUTHOR_NAME": "Dev", "GIT_AUTHOR_EMAIL": PRINCIPAL, "GIT_COMMITTER_NAME": "Dev",
            "GIT_COMMITTER_EMAIL": PRINCIPAL}


def keypair(where: Path, name: str = "signer") -> Path:
    """A new ed25519 key (no passphrase) at where/name; returns the private key's path."""
    key = where / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)], check=True)
    return key


def allowed_signers(path: Path, *keys: Path, principal: str = PRINCIPAL) -> Path:
    """An allowed_signers file (0644) naming each key's public half for `principal`."""
    path.write_text("".join(f"{principal} {k.with_suffix('.pub').read_text()}" for k in keys))
    path.chmod(0o644)
    return path


def git(repo: Path, *args: str, key: Path | None = None, when: int | None = None) -> str:
    """Run git in `repo` as the developer; with `key`, commits are signed with it; with `when`
    (epoch seconds), that is their author and committer time."""
    env = {**os.environ, **_GIT_ENV}
    if when is not None:
        env.update({"GIT_AUTHOR_DATE": f"@{when} +0000", "GIT_COMMITTER_DATE": f"@{when} +0000"})
    if key is not None:
        env.update({"GIT_CONFIG_COUNT": "2", "GIT_CONFIG_KEY_0": "gpg.format", "GIT_CONFIG_VALUE_0": "ssh",
                    "GIT_CONFIG_KEY_1": "user.signingkey", "GIT_CONFIG_VALUE_1": str(key)})
    res = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, timeout=60)
    if res.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed: {res.stdout}{res.stderr}")
    return res.stdout


def commit(repo: Path, message: str, key: Path | None = None, *, when: int | None = None) -> str:
    """Commit everything in the work tree (signed with `key`, unsigned without); its id."""
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "--allow-empty", "-m", message, *(["-S"] if key is not None else []), key=key,
        when=when)
    return git(repo, "rev-parse", "HEAD").strip()
