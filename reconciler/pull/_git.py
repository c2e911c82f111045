"""Pull mode's git edge (pygit2): the host's clone of the desired-state repo, the branch's
history, and the reports hosts leave for later waves as git notes.

A URL is mirrored under the pull directory (/var/lib/reconciler/pull/repos/<hash>, 0700) and
fetched on every run (with network time-outs), its branches and every host's notes ref in one
round trip; a local path (a bare repo or a clone on the host) is read where it is. A host writes
only its own notes ref, refs/notes/reconciler-pull/<host>: into the local repo, or pushed to the
URL's remote, so hosts never race for a ref.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

import pygit2

from ..desired import source
from ..desired.gitauth import Callbacks, GitAuth
from ..errors import ReconcilerError, SourceError
from ..redact import redact
from .schedule import HISTORY, NOTES_PREFIX, Commit, Report


class PublishError(ReconcilerError):
    """A report could not be written or pushed (the run itself is not affected)."""


# libgit2's network time-outs, in milliseconds: a stalled server fails the fetch (the run says
# so, and the timer tries again) instead of holding the run, and the host lock, for ever.
CONNECT_TIMEOUT_MS = 30_000
SERVER_TIMEOUT_MS = 60_000
MIRROR_MODE = 0o700        # the mirror holds every host's desired state: root's alone


def open_clone(repo: str, workdir: Path, auth: GitAuth | None = None) -> pygit2.Repository:
    """The host's clone: a local repo as it is, or a URL mirrored under `workdir` and fetched
    (branches and the hosts' notes), in directories only root can read, with network time-outs,
    authenticated with `auth` (desired/gitauth.py: the deploy key, the server's known host key)."""
    if source.is_url(repo):
        if auth is not None:
            auth.check()                      # a key others can read: refused before a directory is made
        mirrors = workdir / "repos"
        mirrors.mkdir(mode=MIRROR_MODE, parents=True, exist_ok=True)
        os.chmod(mirrors, MIRROR_MODE)        # one made by an older version: 0755
        pygit2.settings.server_connect_timeout = CONNECT_TIMEOUT_MS
        pygit2.settings.server_timeout = SERVER_TIMEOUT_MS
    return source.open_repo(repo, workdir, also_fetch=(f"+{NOTES_PREFIX}*:{NOTES_PREFIX}*",), auth=auth)


def history(commit: pygit2.Commit, limit: int = HISTORY) -> list[Commit]:
    """The first-parent history from `commit`, newest first, at most `limit` commits."""
    out: list[Commit] = []
    c: pygit2.Commit | None = commit
    while c is not None and len(out) < limit:
        out.append(Commit(str(c.id), int(c.commit_time)))
        c = c.parents[0] if c.parents else None
    return out


def notes_ref(host: str) -> str | None:
    """The notes ref a host writes; None for a host name git cannot spell as a ref ('a..b')."""
    ref = NOTES_PREFIX + host
    return ref if pygit2.reference_is_valid_name(ref) else None


def read_reports(repo: pygit2.Repository, hosts: Iterable[str], revisions: set[str]) -> dict[str, dict[str, Report]]:
    """The reports of `hosts` on `revisions`: host -> revision -> report. A host without a
    notes ref (it never reported, or cannot push) has none."""
    out: dict[str, dict[str, Report]] = {}
    for host in hosts:
        ref = notes_ref(host)
        if ref is None:
            continue
        try:
            notes = list(repo.notes(ref))       # type: ignore[call-arg]  # the stubs omit the ref
        except (KeyError, pygit2.GitError):
            continue
        for note in notes:
            rev = str(note.annotated_id)
            if rev not in revisions:
                continue
            rep = Report.parse(note.message, host=host, revision=rev)
            if rep is not None:
                out.setdefault(host, {})[rev] = rep
    return out


def published(repo: pygit2.Repository, host: str, revision: str) -> Report | None:
    """What this host's notes ref says about a revision now (as fetched)."""
    ref = notes_ref(host)
    if ref is None:
        return None
    try:
        note = repo.lookup_note(revision, ref)
    except (KeyError, pygit2.GitError):
        return None
    return Report.parse(note.message, host=host, revision=revision)


def _check_owner(path: str) -> None:
    """A repo on this machine is written (a note, or a push through libgit2's local transport)
    only by its owner: another user who pushes to it could not write the object directories we
    would leave there. Report nothing rather than break the repo."""
    try:
        owner = os.stat(path).st_uid
    except OSError:
        return            # gone or unreadable: writing fails with its own error
    if owner != os.geteuid():
        raise PublishError(f"{path} belongs to uid {owner}, not this run's: not writing reports into it (run "
                           f"`reconcile pull` as its owner, or serve it as its owner and pull it by URL)")


class _Pushed(Callbacks):
    """The push's callbacks: the fetch's authentication (gitauth.Callbacks), and what the remote
    refused."""

    def __init__(self, url: str, auth: GitAuth | None) -> None:
        super().__init__(url, auth)
        self.refused: str | None = None

    def push_update_reference(self, refname: str, message: str | None) -> None:
        if message:
            self.refused = f"{refname}: {message}"


def publish(repo: pygit2.Repository, report: Report, *, push: bool, auth: GitAuth | None = None) -> str | None:
    """Write a report as this host's note on its revision and, for a mirrored URL, push the notes
    ref. Returns what it did, in words, or None when the note already says the same (nothing
    written: a steady host adds no notes commits); raises PublishError when the note cannot be
    written or the push fails."""
    ref = notes_ref(report.host)
    if ref is None:
        raise PublishError(f"host name {report.host!r} cannot name a git ref; its reports are not published")
    if report.same_as(published(repo, report.host, report.revision)):
        return None
    _check_owner(repo.path)
    url = (repo.remotes["origin"].url or "") if push else ""
    if push and url.startswith("file://"):
        _check_owner(url.removeprefix("file://"))
    sig = pygit2.Signature(f"reconcile pull on {report.host}", f"reconciler@{report.host}")
    try:
        repo.create_note(redact(report.dumps()), sig, sig, report.revision, ref, True)
    except (pygit2.GitError, OSError, ValueError) as e:
        raise PublishError(f"cannot write {ref} in {repo.path}: {e}") from None
    if push:
        cb = _Pushed(url, auth)
        try:
            with source.known_hosts(auth.known_hosts if auth is not None else None):
                repo.remotes["origin"].push([f"+{ref}:{ref}"], callbacks=cb)
        except (pygit2.GitError, KeyError, OSError, SourceError) as e:
            raise PublishError(f"cannot push {ref}: {redact(cb.problem or str(e))} (a later wave does not see this "
                               f"host's verdicts; give the host push access, or run with --no-publish)") from None
        cb.succeeded()
        if cb.refused:
            raise PublishError(f"the remote refused {redact(cb.refused)}")
    return f"{report.standing} at {report.revision[:7]} -> {ref}{' (pushed)' if push else ''}"


def branch_dir(repo: pygit2.Repository, rev: str | None) -> str | None:
    """The directory holding the ref a run follows (HEAD's branch, or the branch `rev` names),
    for a path unit that starts a run when it moves; None for a detached HEAD or a fixed revision."""
    try:
        if rev is None:
            if repo.head_is_detached:
                return None
            name = repo.lookup_reference("HEAD").target
        else:
            name = repo.lookup_reference_dwim(rev).name
    except (KeyError, pygit2.GitError, pygit2.InvalidSpecError):
        return None
    if not isinstance(name, str) or not name.startswith("refs/heads/"):
        return None
    return str(Path(repo.path) / PurePosixPath(name).parent)
