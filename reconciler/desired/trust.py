"""Revision safety: never deploy an older revision by accident, and optionally only signed ones.

- `check_descends(repo, last_applied, target)`: a force-push back to an old commit must not
  silently roll the fleet back; the target must descend from (or equal) the last applied one.
- `verify_signature(repo, commit, allowed_signers)`: SSH-signed commits (`git commit -S` with
  gpg.format=ssh), verified with `ssh-keygen -Y find-principals` + `ssh-keygen -Y verify`
  against an allowed-signers file on the control host.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ReconcilerError

if TYPE_CHECKING:      # pygit2 is imported where a commit is read (a run in sync never needs it)
    import pygit2


class RevisionRefused(ReconcilerError):
    """The revision may not be deployed; `reason` is CamelCase."""

    def __init__(self, reason: str, message: str):
        self.reason = reason
        super().__init__(message)


# How to deploy an older revision on purpose, in words for a refusal.
ALLOW = "pass --allow-rewind (reconcile) or set allow_rewind = true in /etc/reconciler/config.toml (reconcile watch)"


def descends(repo: pygit2.Repository) -> Callable[[str, str], bool | None]:
    """A function telling whether `target` descends from (or is) `applied`: True, False, or None
    when `applied` is not in this repository (another repo, or history rewritten)."""
    def check(target: str, applied: str) -> bool | None:
        if target == applied:
            return True
        try:
            known = repo.get(applied) is not None
        except ValueError:
            known = False
        if not known:
            return None
        return bool(repo.descendant_of(target, applied))
    return check


def rewind_problem(target: str, applied: str, verdict: bool | None, where: str) -> str | None:
    """Why deploying `target` over `applied` (recorded as applied on `where`) is a rewind, or None."""
    if verdict is True:
        return None
    if verdict is None:
        return (f"{where} records revision {applied[:7]} as applied, which is not in this repository "
                f"(another repo, or its history was rewritten); refusing {target[:7]}: {ALLOW}")
    return (f"{target[:7]} does not descend from {applied[:7]}, the revision {where} records as applied "
            f"(a force-push back, or --rev of an older commit); refusing: {ALLOW}")


def check_descends(repo: pygit2.Repository, last_applied: str | None, target: str) -> None:
    """Raise RevisionRefused when target does not descend from last_applied (the controller's
    cache of the last revision it applied from this repo and branch)."""
    if not last_applied:
        return
    problem = rewind_problem(target, last_applied, descends(repo)(target, last_applied), "this controller")
    if problem:
        raise RevisionRefused("NotDescendant", problem)


def verify_signature(repo: pygit2.Repository, rev: str, allowed_signers: str | Path) -> str:
    """Return the signer's principal for an SSH-signed commit, or raise RevisionRefused."""
    import pygit2
    commit = repo.revparse_single(rev).peel(pygit2.Commit)
    short = str(commit.id)[:7]
    try:
        sig, payload = commit.gpg_signature
    except (ValueError, TypeError):
        sig, payload = None, None
    if not sig:
        raise RevisionRefused("Unsigned", f"commit {short} is not signed (require_signed is on)")
    if b"BEGIN SSH SIGNATURE" not in sig:
        raise RevisionRefused("UnknownSignature", f"commit {short} has a non-SSH signature; only SSH signatures "
                              "are verified (ssh-keygen -Y verify)")
    signers = Path(allowed_signers)
    if not signers.exists():
        raise RevisionRefused("NoAllowedSigners", f"allowed_signers file {signers} does not exist")
    with tempfile.TemporaryDirectory() as d:
        sig_file = Path(d) / "commit.sig"
        sig_file.write_bytes(sig)
        found = subprocess.run(["ssh-keygen", "-Y", "find-principals", "-s", str(sig_file), "-f", str(signers)],
                               capture_output=True, text=True)
        principals = [p for p in found.stdout.split() if p]
        if found.returncode != 0 or not principals:
            raise RevisionRefused("UnknownSigner", f"commit {short} is signed by a key not in {signers}")
        for principal in principals:
            ok = subprocess.run(["ssh-keygen", "-Y", "verify", "-f", str(signers), "-I", principal, "-n", "git",
                                 "-s", str(sig_file)], input=payload, capture_output=True)
            if ok.returncode == 0:
                return principal
    raise RevisionRefused("BadSignature", f"commit {short}: signature does not verify against {signers}")
