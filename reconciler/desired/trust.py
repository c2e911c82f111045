"""Revision safety: never deploy an older revision by accident, and only what the trust policy
allows.

- `check_descends(repo, last_applied, target)`: a force-push back to an old commit must not
  silently roll the fleet back; the target must descend from (or equal) the last applied one.
- `verify_signature(repo, commit, allowed_signers)`: SSH-signed commits (`git commit -S` with
  gpg.format=ssh), verified with `ssh-keygen -Y find-principals` + `ssh-keygen -Y verify`
  against an allowed-signers file.
- `TrustPolicy`: the one policy every door reads (where each takes it from: docs/threat-model.md):
  whether a revision must be signed and by whom, and over which URL schemes a repo may be
  fetched. The revision a run opens is verified under it (loop/revision.py), and so is every
  revision a rollback renders.
"""

from __future__ import annotations

import os
import stat
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from ..errors import ReconcilerError
from ..values import replace
from .source import is_url, shown_url

if TYPE_CHECKING:      # pygit2 is imported where a commit is read (a run in sync never needs it)
    import pygit2

    from .spec import DesiredState

RenderAt = Callable[[str], "DesiredState | None"]

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
    signers = Path(allowed_signers)
    try:
        sig, payload = commit.gpg_signature
    except (ValueError, TypeError):
        sig, payload = None, None
    if not sig:
        raise RevisionRefused("Unsigned", f"commit {short} is not signed; only commits signed by a key in {signers} "
                              "may deploy")
    if b"BEGIN SSH SIGNATURE" not in sig:
        raise RevisionRefused("UnknownSignature", f"commit {short} has a non-SSH signature; only SSH signatures "
                              "are verified (ssh-keygen -Y verify)")
    trusted_signers(signers)
    with tempfile.TemporaryDirectory() as d:
        sig_file = Path(d) / "commit.sig"
        sig_file.write_bytes(sig)
        try:
            found = subprocess.run(["ssh-keygen", "-Y", "find-principals", "-s", str(sig_file), "-f", str(signers)],
                                   capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RevisionRefused("NoSshKeygen", f"commit {short}: cannot run ssh-keygen to verify its signature "
                                  f"({e})") from None
        principals = [p for p in found.stdout.split() if p]
        if found.returncode != 0 or not principals:
            raise RevisionRefused("UnknownSigner", f"commit {short} is signed by a key not in {signers}")
        for principal in principals:
            ok = subprocess.run(["ssh-keygen", "-Y", "verify", "-f", str(signers), "-I", principal, "-n", "git",
                                 "-s", str(sig_file)], input=payload, capture_output=True, timeout=30)
            if ok.returncode == 0:
                return principal
    raise RevisionRefused("BadSignature", f"commit {short}: signature does not verify against {signers}")


def trusted_signers(path: Path) -> None:
    """Refuse an allowed-signers file that is missing, not a regular file, or that someone other
    than root or this user could rewrite (group- or world-writable, or another user's): whoever
    writes it chooses who may deploy."""
    try:
        st = path.stat()
    except OSError as e:
        raise RevisionRefused("NoAllowedSigners", f"allowed signers file {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise RevisionRefused("NoAllowedSigners", f"allowed signers file {path} is not a regular file")
    if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
        raise RevisionRefused("UntrustedSigners", f"allowed signers file {path} may be rewritten by others (owner uid "
                              f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}): make it root's, not group- or "
                              f"world-writable (chown root {path} && chmod 0644 {path})")


# URL schemes a repo is fetched over. Plaintext ones (no TLS, no SSH) let whoever is on the path
# choose what deploys; they are refused unless a policy allows them on purpose.
SECURE_SCHEMES = frozenset({"https", "ssh", "git+ssh", "ssh+git", "file"})
PLAINTEXT_SCHEMES = frozenset({"http", "git"})
INSECURE_HOW = "--allow-insecure-transport (reconcile, reconcile pull) or allow_insecure_transport = true (config.toml)"
DEFAULT_SIGNERS = "/etc/reconciler/allowed_signers"


def url_scheme(repo: str) -> str | None:
    """The scheme a repo URL is fetched over: "ssh" for git's scp-like `user@host:path`, None for
    a local path."""
    if not is_url(repo):
        return None
    if "://" not in repo:
        return "ssh"
    return repo.split("://", 1)[0].lower()


def url_credentials(repo: str) -> str | None:
    """What a repo URL carries that is a credential, in words, or None: a password anywhere, and
    any user name in an http(s) URL (forges take a token there: https://TOKEN@host/x.git). An
    ssh user name (git@host) is no secret."""
    scheme = url_scheme(repo)
    if scheme is None or "://" not in repo:
        return None
    try:
        u = urlsplit(repo)
    except ValueError:
        return "an address that cannot be parsed"
    if u.password is not None:
        return "a password"
    if u.username is not None and scheme in ("http", "https"):
        return "a user name in an http(s) URL (forges take a token there)"
    return None


@dataclass(frozen=True)
class TrustPolicy:
    """What may deploy: whether a revision must be signed, by a key in which allowed-signers
    files (each of them, when policies were merged), and whether plaintext URL schemes may be
    fetched. `origin` says where the policy came from, for the log and refusals."""

    require_signed: bool = False
    allowed_signers: tuple[str, ...] = ()
    insecure_transport: bool = False
    origin: str = ""
    # Verified revisions of this policy's lifetime (one run or one command), with the signers
    # files' identity at the time: a rollback renders the same revision many times.
    _verified: dict[tuple[str, tuple[tuple[int, int, int], ...]], str] = field(
        default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, *, require_signed: bool, allowed_signers: str | Path | None = None, insecure_transport: bool = False,
           origin: str = "") -> TrustPolicy:
        """A policy from settings (a config file or flags): with signing required and no file
        named, /etc/reconciler/allowed_signers. Files are kept as absolute paths."""
        files: tuple[str, ...] = ()
        if require_signed:
            files = (str(Path(allowed_signers or DEFAULT_SIGNERS).absolute()),)
        return cls(require_signed, files, insecure_transport, origin)

    def merged(self, other: TrustPolicy) -> TrustPolicy:
        """The stricter of both: signing required if either requires it (every file of both
        verifies), plaintext allowed only if both allow it."""
        files = self.allowed_signers + tuple(f for f in other.allowed_signers if f not in self.allowed_signers)
        origin = " and ".join(o for o in (self.origin, other.origin) if o)
        return replace(self, require_signed=self.require_signed or other.require_signed, allowed_signers=files,
                       insecure_transport=self.insecure_transport and other.insecure_transport, origin=origin,
                       _verified={})

    def describe(self) -> str:
        """The policy in words, for a run's log."""
        if not self.require_signed:
            return "unsigned revisions are accepted"
        return f"only revisions signed by a key in {' and in '.join(self.allowed_signers)} deploy"

    def check_url(self, repo: str) -> None:
        """Refuse to fetch `repo` over a plaintext scheme (unless allowed) or one git cannot
        fetch securely; a local path is always fine."""
        scheme = url_scheme(repo)
        if scheme is None or scheme in SECURE_SCHEMES:
            return
        if scheme in PLAINTEXT_SCHEMES:
            if self.insecure_transport:
                return
            raise RevisionRefused("InsecureTransport", f"{shown_url(repo)}: {scheme}:// is neither encrypted nor "
                                  f"authenticated: whoever is on the path chooses what deploys. Use https:// or "
                                  f"ssh://, or allow it on purpose: {INSECURE_HOW}")
        raise RevisionRefused("UnknownTransport", f"{shown_url(repo)}: {scheme}:// is not a scheme the reconciler "
                              f"fetches (https, ssh, file; http and git only when allowed)")

    def verify(self, repo: pygit2.Repository, rev: str) -> str | None:
        """The signer of `rev` when this policy requires signing (every allowed-signers file
        verifies it), None when it does not; RevisionRefused when it may not deploy."""
        if not self.require_signed:
            return None
        oid = _commit_id(repo, rev)
        key = (oid, tuple(_identity(f) for f in self.allowed_signers))
        if key not in self._verified:
            self._verified[key] = ", ".join(dict.fromkeys(verify_signature(repo, oid, f)
                                                          for f in self.allowed_signers))
        return self._verified[key]

    def render_at(self, repo: pygit2.Repository, render: RenderAt, refused: dict[str, str]) -> RenderAt:
        """`render` (the state at another revision, for a rollback: a revision a host's record
        names) limited to revisions this policy lets deploy; a refused one renders as None (the
        service cannot substitute it, as when it cannot be loaded) and is noted in `refused` with
        why. The commit verified is the commit rendered: the name is resolved once."""
        def at(rev: str) -> DesiredState | None:
            try:
                oid = _commit_id(repo, rev)
                self.verify(repo, oid)
            except RevisionRefused as e:
                refused[rev] = f"{e.reason}: {e}"
                return None
            return render(oid)
        return at


def _commit_id(repo: pygit2.Repository, rev: str) -> str:
    """The full id of the commit `rev` names (RevisionRefused: none)."""
    import pygit2
    try:
        return str(repo.revparse_single(rev).peel(pygit2.Commit).id)
    except (KeyError, ValueError, pygit2.GitError, pygit2.InvalidSpecError):
        raise RevisionRefused("UnknownRevision", f"revision {rev[:40]!r} is not in {repo.path}") from None


def _identity(path: str) -> tuple[int, int, int]:
    """What tells a changed allowed-signers file from the one verified against (0s: missing)."""
    try:
        st = os.stat(path)
    except OSError:
        return (0, 0, 0)
    return (st.st_ino, st.st_size, st.st_mtime_ns)
