"""Deploy status on the commit: the outcome of each run as a git note, `refs/notes/reconciler`:
one line per host, `HOST: RESULT REVISION TIME DETAIL`, RESULT a records.Result or `live-again`
(on the last good commit a rollback went to). What the notes look like, and how to fetch and
read them: docs/status.md.

How lines accumulate (`merge`, pure): a later run for the same commit replaces that host's line
and leaves the other hosts' lines alone; a run that changed and judged nothing on a host (a
periodic run finding it in sync, or still on its last good) does not replace the line of the run
that did (`converged`, `rolled-back`), and a line that says the same as before (time aside) is
not rewritten, so periodic runs add no notes commits. Lines that are not ours are kept as they
are.

Writing (`write`, the only I/O here): all the notes of one run go into one notes commit, built by
libgit2's own notes code (fan-out aware) on a scratch ref at the current notes commit, then
compare-and-swapped onto `refs/notes/reconciler` (docs/status.md). Objects and refs are written
with the modes `core.sharedRepository` asks for (libgit2 itself ignores it), so a daemon running
with UMask=0077 never leaves directories in a shared deploy repo that the pushing users cannot
write.

Everything in a note goes through redact.redact first, before it is flattened or cut (one_line).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import re
import secrets
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from ..errors import ReconcilerError
from ..plan.records import SUPERSEDED, Result
from ..plan.rollout import natural_key
from ..redact import redact

if TYPE_CHECKING:
    from ..loop.results import FleetResult, HostResult, ServiceEvent

NOTES_REF = "refs/notes/reconciler"
LIVE_AGAIN = "live-again"
QUOTE_MAX = 300

# A steady run (nothing changed or judged on the host) keeps a line with one of these results.
_KEEPS = {
    str(Result.IN_SYNC): {str(Result.IN_SYNC), str(Result.CONVERGED), LIVE_AGAIN},
    str(Result.QUARANTINED): {str(Result.QUARANTINED), str(Result.ROLLED_BACK)},
    str(Result.FAILED): {str(Result.FAILED)},
}
_LINE = re.compile(r"^(?P<host>[A-Za-z0-9][A-Za-z0-9_.-]*): (?P<result>[a-z][a-z-]*) (?P<rev>[0-9a-f]{7,40}) "
                   r"(?P<at>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)(?: (?P<detail>.*))?$")
# Failures of a host as a whole: their message is not made of the services' events.
_HOST_FAILURES = frozenset({"Unreachable", "HostKeyUnverified", "Locked", "NotDescendant", "ApplyFailed",
                            "ObserveFailed", "CommandFailed", "HostFailed", "Failed"})
_HELD_WORDS = {"quarantined": "quarantined", "held": "held stopped", "blocked": "blocked",
               "foreign": "foreign, left untouched"}


class NotesError(ReconcilerError):
    """The notes could not be written (the deploy itself is not affected)."""


class NoteLine(msgspec.Struct, frozen=True):
    """One host's line in a commit's note."""

    host: str
    result: str                 # a records.Result value, or "live-again"
    revision: str               # the commit the line is about (short SHA)
    at: str                     # UTC, 2026-11-30T12:00:00Z
    detail: str = ""
    steady: bool = False        # not written: the run changed and judged nothing on this host

    def text(self) -> str:
        return f"{self.host}: {self.result} {self.revision} {self.at}" + (f" {self.detail}" if self.detail else "")

    @classmethod
    def parse(cls, line: str) -> NoteLine | None:
        m = _LINE.match(line.strip())
        if m is None:
            return None
        return cls(m["host"], m["result"], m["rev"], m["at"], m["detail"] or "")

    def restates(self, old: NoteLine) -> bool:
        """True when this (newer) line adds nothing to `old`: the same apart from the time, or a
        steady run's word for the state the old line's run left (in-sync after converged)."""
        if (self.result, self.revision, self.detail) == (old.result, old.revision, old.detail):
            return True
        return self.steady and old.revision == self.revision and old.result in _KEEPS.get(self.result, set())


def utc(epoch: float) -> str:
    """2026-11-30T12:00:00Z."""
    return dt.datetime.fromtimestamp(int(epoch), dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def one_line(text: str | None, limit: int = QUOTE_MAX) -> str:
    """A text on one line (a note has one line per host), cut at `limit` characters. Redacted
    first, on the text as it came: a token cut in half, or a secret whose spaces were
    flattened, would no longer be recognized once cut or flattened."""
    flat = " ".join(redact(text or "").split())
    return flat if len(flat) <= limit else flat[:limit - 1] + "…"


def _quoted(text: str | None) -> str:
    return f'"{one_line(text)}"'


def _service_part(service: str, events: Sequence[ServiceEvent]) -> str:
    """What happened to one service in a run, in a few words, with the journal line quoted."""
    judged = [e for e in events if e.outcome is not None]
    if not judged:
        e = events[-1]
        text = f"{service} {_HELD_WORDS.get(str(e.action), str(e.action))}"
        if e.note:
            text += f" ({one_line(e.note)})"
        return text + (f": {_quoted(e.quote)}" if e.quote else "")
    words: list[str] = []
    for e in judged:
        o = e.outcome
        assert o is not None
        failure = f"{o.reason}: {_quoted(o.quote)}" if o.quote else f"{o.reason}: {one_line(o.message)}"
        if o.reason == SUPERSEDED:
            words.append(f"{e.revision[:7]} superseded by a newer revision (no verdict)")
        elif str(e.action) == "rollback":
            words.append(f"rolled back to {e.revision[:7]}" if o.healthy
                         else f"rollback to {e.revision[:7]} failed too: {failure}")
        elif o.healthy:
            words.append("healthy" if str(e.action) == "deploy" else f"{e.revision[:7]} healthy (watched again)")
        else:
            words.append(failure)
    return f"{service} " + ", ".join(words)


def host_detail(r: HostResult) -> str:
    """One host's run in a line: per service that something happened to, what. A failed host
    leads with its reason (FirstDeployFailed, RollbackFailed, PreflightFailed ...); a failure of
    the host itself (unreachable, locked, a refused revision, an apply cut short) adds its message."""
    by_service: dict[str, list[ServiceEvent]] = {}
    for e in r.events:
        by_service.setdefault(e.service, []).append(e)
    text = "; ".join(_service_part(s, evs) for s, evs in by_service.items())
    text = "; ".join(x for x in (text, cost_detail(r)) if x)
    if r.status is Result.FAILED and r.reason:
        if not text or r.plan is None or r.reason in _HOST_FAILURES:
            text = "; ".join(x for x in (text, f"{r.reason}: {one_line(r.message)}") if x)
        elif r.reason not in text:
            text = f"{r.reason}: {text}"
    return redact(text)


def cost_detail(r: HostResult) -> str:
    """What the run's restarts cost the host (issue 42): the seconds each service was unavailable
    (out of rotation, or stopped until judged), and the requests a drain left in flight."""
    parts = []
    for service, steps in sorted(r.costs.items()):
        lost = r.lost.get(service)
        parts.append(f"{service} unavailable {sum(steps.values()):.1f}s"
                     + (f", {lost:g} requests in flight at the drain timeout" if lost else ""))
    return "; ".join(parts)


def steady(r: HostResult) -> bool:
    """The run changed nothing on the host and judged nothing there (it only looked)."""
    return r.plan is not None and not r.plan.changes and not any(e.outcome is not None for e in r.events)


def run_lines(result: FleetResult, now: float) -> dict[str, list[NoteLine]]:
    """PURE: the note lines of one run, by the commit (full SHA) they go on: one per host on the
    deployed revision, and a `live-again` line on each last good revision a rollback went to."""
    at = utc(now)
    rev = result.revision
    out: dict[str, list[NoteLine]] = {}
    for r in result.hosts:
        out.setdefault(rev, []).append(NoteLine(r.host, str(r.status), rev[:7], at, host_detail(r), steady(r)))
        back: dict[str, list[str]] = {}
        for i, e in enumerate(r.events):
            if str(e.action) != "rollback" or e.outcome is None or not e.outcome.healthy or e.revision == rev:
                continue
            failed = next((x.outcome for x in reversed(r.events[:i]) if x.service == e.service
                           and x.outcome is not None and not x.outcome.healthy), None)
            why = f"after {rev[:7]} failed ({failed.reason})" if failed is not None else f"in place of {rev[:7]}"
            back.setdefault(e.revision, []).append(f"{e.service} rolled back here {why}")
        for good, parts in back.items():
            out.setdefault(good, []).append(NoteLine(r.host, LIVE_AGAIN, good[:7], at, redact("; ".join(parts))))
    return out


def merge(old: str | None, new: Iterable[NoteLine]) -> str:
    """PURE: a commit's note with these lines merged in: one line per host (natural order), a
    host's line replaced unless the new one only restates it (NoteLine.restates); lines that are
    not ours kept, after ours."""
    by_host: dict[str, NoteLine] = {}
    others: list[str] = []
    for raw in (old or "").splitlines():
        if not raw.strip():
            continue
        parsed = NoteLine.parse(raw)
        if parsed is None:
            others.append(raw.rstrip())
        else:
            by_host[parsed.host] = parsed
    for line in new:
        have = by_host.get(line.host)
        if have is None or not line.restates(have):
            by_host[line.host] = line
    lines = [by_host[h].text() for h in sorted(by_host, key=natural_key)] + others
    return "\n".join(lines) + "\n" if lines else ""


# ---- writing (pygit2) ------------------------------------------------------------------------


def _shared_umask(value: str, current: int) -> int:
    """The umask that gives new files the group (and other) access core.sharedRepository asks
    for, as git's own adjust_shared_perm does; the current one for a repo that is not shared."""
    v = value.strip().lower()
    if v in ("group", "true", "1"):
        return current & 0o707
    if v in ("all", "world", "everybody", "2"):
        return current & 0o702
    if re.fullmatch(r"0[0-7]{3}", v):
        mode = int(v, 8)
        return ~(mode | (mode & 0o444) >> 2) & 0o777
    return current


@contextlib.contextmanager
def _repo_modes(repo: Any) -> Iterator[None]:
    """While a note is written: the umask core.sharedRepository asks for (the process's own,
    for the moment of the write; only group and other bits are relaxed, and every file the
    daemon keeps to itself is created with an explicit mode)."""
    try:
        shared = str(repo.config["core.sharedRepository"])
    except (KeyError, ValueError):
        yield
        return
    current = os.umask(0o077)
    os.umask(_shared_umask(shared, current))
    try:
        yield
    finally:
        os.umask(current)


def read(repo: Any, commit: str, ref: str = NOTES_REF) -> str | None:
    """A commit's note under `ref`, or None."""
    try:
        return str(repo.lookup_note(commit, ref).message)
    except (KeyError, ValueError):
        return None


def write(repo: Any, lines: Mapping[str, Sequence[NoteLine]], *, ref: str = NOTES_REF,
          attempts: int = 20) -> list[str]:
    """Merge `lines` (commit -> lines) into the notes under `ref` in one notes commit, with a
    compare-and-swap of the ref (retried when another writer got there first). Returns the
    commits whose note changed ([] when every line only restated what was there)."""
    import pygit2
    sig = pygit2.Signature("reconciler", "reconciler@localhost")
    delay = 0.02
    with _repo_modes(repo):
        for _ in range(attempts):
            current = repo.references.get(ref)
            scratch = f"refs/reconciler-scratch/notes-{os.getpid()}-{secrets.token_hex(4)}"
            try:
                if current is not None:
                    repo.references.create(scratch, current.target)
                changed = []
                for commit, new in lines.items():
                    old = read(repo, commit, scratch) if current is not None else None
                    text = redact(merge(old, new))
                    if not text or (old is not None and text == merge(old, ())):
                        continue
                    repo.create_note(text, sig, sig, commit, scratch, True)
                    changed.append(commit)
                if not changed:
                    return []
                made = repo.references[scratch].target
                try:
                    if current is None:
                        repo.references.create(ref, made)           # fails if someone created it meanwhile
                    else:
                        current.set_target(made, "reconciler: deploy status")   # fails if it moved meanwhile
                    return changed
                except (pygit2.GitError, pygit2.AlreadyExistsError, ValueError):
                    pass
            finally:
                with contextlib.suppress(KeyError, pygit2.GitError):
                    repo.references.delete(scratch)
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
    raise NotesError(f"{ref} kept changing under us: gave up after {attempts} attempts")


def record_run(repo: Any, result: FleetResult, now: float | None = None) -> list[str]:
    """Write one run's outcome as notes (never for a dry run). Returns the commits noted."""
    if result.dry_run or not result.hosts:
        return []
    try:
        return write(repo, run_lines(result, time.time() if now is None else now))
    except NotesError:
        raise
    except Exception as e:            # pygit2 errors, a read-only repo: say it in one line
        raise NotesError(f"cannot write {NOTES_REF} in {getattr(repo, 'path', '?')}: "
                         f"{type(e).__name__}: {e}") from None
