"""Git hooks for the deploy repo: pre-receive validates, post-receive triggers the daemon.

The hook files themselves (hooks/pre-receive, hooks/post-receive, written by
`reconcile init-repo`) are two-line shims that call `reconcile-hook <name>`; all logic is here.
`reconcile-hook` is a console script of its own so a push does not pay for importing the SSH
and terminal-UI code.

pre-receive validates a push to the deploy branch (refusing a deletion, a rewind unless the push
option `reconcile.allow-rewind` is given and allow_rewind is on, an unsigned commit under
require_signed, an invalid revision) and refuses an update of refs/notes/reconciler* from a user
not in notes_pushers; post-receive touches the daemon's trigger file and, with the push option
`reconcile.wait` (or git config reconciler.stream=true), streams the daemon's run for the pushed
revision. What each refuses and why: docs/push.md ("pre-receive", "post-receive").

What the hooks print passes through redact. The streamed run log is redacted by the daemon as
it writes it; the stream masks token-like patterns once more, a whole line at a time (the hook
never decrypts anything, so it knows no secret values).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from .. import redact
from ..errors import ConfigError, SourceError
from .trigger import user_name

if TYPE_CHECKING:
    import pygit2

# Imports are where they are used: post-receive (every push) loads pygit2 and nothing of the
# loader, the schema or the rule pack, which only pre-receive needs (tests/cli/test_cold_start.py).

ZERO = "0" * 40
NOTES = "refs/notes/reconciler"     # the prefix of every deploy status notes ref (the daemon's, pull hosts')

SHIM = """#!/bin/sh
# reconciler {name} hook (installed by `reconcile init-repo`): all logic is in `reconcile-hook {name}`.
exec "$(git config --get reconciler.hook || command -v reconcile-hook)" {name}
"""


def shim(name: str) -> str:
    """The text of hooks/<name>."""
    return SHIM.format(name=name)


def _git_config(repo: pygit2.Repository, key: str, default: str = "") -> str:
    try:
        return str(repo.config[key])
    except KeyError:
        return default


def _push_options() -> set[str]:
    n = int(os.environ.get("GIT_PUSH_OPTION_COUNT", "0") or 0)
    return {os.environ.get(f"GIT_PUSH_OPTION_{i}", "") for i in range(n)}


def _updates() -> list[tuple[str, str, str]]:
    """The ref updates on stdin: (old, new, ref) a line."""
    lines = (line.split() for line in sys.stdin.read().splitlines())
    return [(p[0], p[1], p[2]) for p in lines if len(p) == 3]


def _err(line: str) -> None:
    print(redact.redact(line), file=sys.stderr)


def pre_receive() -> int:
    """Validate every push to the deploy branch; print reasons to the pusher; 0 accept, 1 reject."""
    from ..desired import cache, source
    from ..desired.trust import RevisionRefused
    from ..preflight import check_desired, load_rules
    from .config import load_config
    repo = source.open_repo(os.environ.get("GIT_DIR", "."))
    branch = _git_config(repo, "reconciler.branch", "main")
    subdir = _git_config(repo, "reconciler.path", "")
    cfg = load_config()
    trust = cfg.trust_policy()
    options = _push_options()
    updates = _updates()
    rejected = _refuse_notes(updates, cfg.notes_pushers)
    for old, new, ref in updates:
        if ref != f"refs/heads/{branch}":
            continue
        if new == ZERO:
            print(f"reconciler: refusing to delete the deploy branch {branch}", file=sys.stderr)
            rejected = True
            continue
        rewind = old != ZERO and not repo.descendant_of(new, old) and new != old
        if rewind and not (cfg.allow_rewind and "reconcile.allow-rewind" in options):
            print(f"reconciler: rejected {new[:7]}: it does not descend from {old[:7]} (a force-push back "
                  f"to an older commit would silently roll the fleet back). Revert with a new commit instead.",
                  file=sys.stderr)
            rejected = True
            continue
        try:
            who = trust.verify(repo, new)
        except RevisionRefused as e:
            _err(f"reconciler: rejected {new[:7]}: {e.reason}: {e}")
            rejected = True
            continue
        if who is not None:
            _err(f"reconciler: {new[:7]} signed by {who}")
        try:
            snap = source.snapshot(repo, new, subdir)
            state = cache.load_desired(snap)
            problems, warnings = check_desired(state, load_rules(snap), snap.read)
            for w in warnings:
                _err(f"reconciler: {w}")
            if problems:
                raise ConfigError(problems)
        except ConfigError as e:
            print(f"reconciler: rejected {new[:7]}: invalid desired state ({len(e.problems)} problem"
                  f"{'s' * (len(e.problems) != 1)}):", file=sys.stderr)
            for p in e.problems:
                _err(f"  {p}")
            rejected = True
            continue
        except SourceError as e:
            _err(f"reconciler: rejected {new[:7]}: {e}")
            rejected = True
            continue
        n = sum(len(h.services) for h in state.hosts.values())
        print(f"reconciler: {new[:7]} valid ({len(state.hosts)} hosts, {n} services)", file=sys.stderr)
    return 1 if rejected else 0


def _refuse_notes(updates: list[tuple[str, str, str]], allowed: list[str]) -> bool:
    """Say why each update of a deploy status notes ref is refused (a pusher not in
    notes_pushers); True when there was one."""
    pusher = user_name()        # the hook runs as the pushing user
    refused = [ref for _old, _new, ref in updates if ref.startswith(NOTES)] if pusher not in allowed else []
    for ref in refused:
        print(f"reconciler: rejected {ref}: deploy status notes are written by the daemon, and pushed only by "
              f"the users in notes_pushers of the controller's config (pull-mode hosts), not {pusher}",
              file=sys.stderr)
    return bool(refused)


def post_receive() -> int:
    """Ask the daemon to reconcile now; optionally stream its run for the pushed revision."""
    from ..desired import source
    repo = source.open_repo(os.environ.get("GIT_DIR", "."))
    branch = _git_config(repo, "reconciler.branch", "main")
    trigger = Path(_git_config(repo, "reconciler.trigger", str(Path(repo.path) / "reconciler.trigger")))
    stream = "reconcile.wait" in _push_options() or _git_config(repo, "reconciler.stream") == "true"
    state_dir = _git_config(repo, "reconciler.statedir", "")
    timeout = float(_git_config(repo, "reconciler.streamtimeout", "1800"))
    for _old, new, ref in _updates():
        if ref != f"refs/heads/{branch}" or new == ZERO:
            continue
        if not _touch(trigger):
            print(f"reconciler: {new[:7]} landed; the daemon's trigger {trigger} does not exist (the daemon is not "
                  f"running, or has not started yet): it deploys when the daemon sees the branch", flush=True)
            return 0
        print(f"reconciler: deploy of {new[:7]} requested", flush=True)
        if stream and state_dir:
            return _stream(Path(state_dir) / "runs", new, timeout)
    return 0


def _touch(trigger: Path) -> bool:
    """Bump the trigger's time (the daemon watches it); False when it does not exist.

    Never created here (the daemon makes it, its own, at start: one made by a pusher would be
    the pusher's, and the daemon would leave it alone) and never through a symlink (O_NOFOLLOW:
    ELOOP, which failure_line reports); the time is set on the opened descriptor."""
    try:
        fd = os.open(trigger, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        os.utime(fd)
    finally:
        os.close(fd)
    return True


def _stream(runs: Path, rev: str, timeout: float) -> int:
    """Print the daemon's log for rev as it grows, until its exit file appears: whole lines,
    redacted (a pattern cut between two reads would not be recognised), control characters
    shown as escapes (the pusher's terminal is on the other end of git's sideband)."""
    log, done = runs / f"{rev}.log", runs / f"{rev}.exit"
    deadline = time.monotonic() + timeout
    pos = 0
    partial = ""
    while time.monotonic() < deadline:
        if log.exists():
            with open(log) as f:
                f.seek(pos)
                chunk = f.read()
                pos = f.tell()
            lines = (partial + chunk).split("\n")
            partial = lines.pop()
            if lines:
                sys.stdout.write(redact.escape_controls(redact.redact("\n".join(lines) + "\n")))
                sys.stdout.flush()
        if done.exists() and (not log.exists() or log.stat().st_size <= pos):
            if partial:
                sys.stdout.write(redact.escape_controls(redact.redact(partial)) + "\n")
                sys.stdout.flush()
            code = done.read_text().strip()
            print(f"reconciler: {rev[:7]} finished with exit {code}", flush=True)
            return 0
        time.sleep(0.2)
    print(f"reconciler: stopped waiting for {rev[:7]} after {timeout:.0f}s; see `reconcile status`", flush=True)
    return 0


def init_repo(path: Path, *, branch: str = "main", hook_bin: str | None = None,
              state_dir: str | None = None, stream: bool = False, group: str | None = None,
              owner: str | None = None) -> list[str]:
    """Create a bare deploy repo with the hooks installed and configured; returns notes.

    group: share it with that group (the pushing users and the daemon), see _share: the group
    may write git's objects and refs (core.sharedRepository = group, setgid directories) and
    nothing else. owner: the daemon's user (as root): the repo's directory, objects, refs and
    trigger file are its; config and hooks stay root's.
    """
    import pygit2
    mode = pygit2.enums.RepositoryInitMode.SHARED_GROUP if group else pygit2.enums.RepositoryInitMode.SHARED_UMASK
    repo = pygit2.init_repository(str(path), bare=True, initial_head=branch, mode=mode)
    hooks = Path(repo.path) / "hooks"
    hooks.mkdir(exist_ok=True)
    for name in ("pre-receive", "post-receive"):
        p = hooks / name
        p.write_text(shim(name))
        p.chmod(0o755)
    exe = hook_bin or _hook_bin()
    repo.config["reconciler.hook"] = exe
    repo.config["reconciler.branch"] = branch
    repo.config["receive.advertisePushOptions"] = True
    # Rewinds are the pre-receive hook's to refuse (it explains why; allow_rewind can permit one),
    # not git's: a shared init would otherwise turn on git's own blanket refusal.
    repo.config["receive.denyNonFastForwards"] = False
    if state_dir:
        repo.config["reconciler.statedir"] = state_dir
    if stream:
        repo.config["reconciler.stream"] = "true"
    if group:
        # A pusher cannot write the repo's own directory (gc.pid, packed-refs): no gc after a
        # push; the repo's owner runs `git gc` now and then.
        repo.config["receive.autogc"] = False
    return _share(Path(repo.path), group, owner) if group else []


# What the group may write in a shared repo: git's objects and refs (a push, the daemon's notes)
# and, in the repo's own directory, new files (a push's HEAD.lock) but none of another user's.
GROUP_WRITES = ("objects", "refs")
TRIGGER = "reconciler.trigger"


def _share(path: Path, group: str, owner: str | None) -> list[str]:
    """Give a repo to `group` and `owner` (the daemon's user): the pushing users and the daemon
    write its objects and refs (directories 2775, setgid), and nothing of the rest: `config`,
    `HEAD`, `description`, `hooks/` and `info/` are the admin's (who runs this: root), not
    group-writable (0644, 0755, directories 2755), and the repo's own directory is sticky (3775:
    a push must create HEAD.lock there, but no group member can rename or delete a file it does
    not own), so no group member can change what git runs there (a hook, core.pager) or replace
    the daemon's trigger file, made here (`owner`'s, group-writable for the post-receive hook).

    No git config is changed: the daemon owns the directory, so its git trusts it; each pushing
    user trusts it in their own git config (the note says how); nobody's system-wide, and not
    root's: whoever can write the directory (the daemon, a group member with a shell) could
    make the git of a user who trusts it run a command (CVE-2022-24765)."""
    import grp
    import pwd
    gid = grp.getgrnam(group).gr_gid
    admin = os.geteuid()
    uid = pwd.getpwnam(owner).pw_uid if owner else admin
    root = path.resolve()
    for d, _dirs, files in os.walk(root):
        here = Path(d)
        data = here != root and here.relative_to(root).parts[0] in GROUP_WRITES
        os.chown(here, uid if data or here == root else admin, gid, follow_symlinks=False)
        os.chmod(here, 0o3775 if here == root else 0o2775 if data else 0o2755)
        for name in files:
            f = here / name
            os.chown(f, uid if data else admin, gid, follow_symlinks=False)
            os.chmod(f, 0o664 if data else 0o755 if here.name == "hooks" else 0o644)
    fd = os.open(root / TRIGGER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o660)
    try:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, 0o660)
    finally:
        os.close(fd)
    me, them = pwd.getpwuid(admin).pw_name, owner or pwd.getpwuid(admin).pw_name
    safe = f"git config --global --add safe.directory {root.as_posix()}"
    return [f"shared with group {group}: objects/ and refs/ group-writable (setgid); config, HEAD and hooks "
            f"{me}'s and not group-writable; the directory {them}'s, sticky; {TRIGGER} {them}'s, group-writable",
            f"each pushing user trusts it in their own git config (never the system's): runuser -u USER -- {safe}",
            f"other users' git refuses it (\"dubious ownership\"); to look at it: runuser -u {them} -- git -C "
            f"{root.as_posix()} log"]


def _hook_bin() -> str:
    """The `reconcile-hook` executable for the shims: the one next to this Python, else PATH."""
    beside = Path(sys.executable).parent / "reconcile-hook"
    if beside.exists():
        return str(beside)
    found = subprocess.run(["sh", "-c", "command -v reconcile-hook"], capture_output=True, text=True).stdout.strip()
    return found or "reconcile-hook"


def console() -> NoReturn:
    """The `reconcile-hook` console script: main(), then process.leave() (no interpreter
    teardown: a push waits for its hooks)."""
    from ..process import leave
    leave(main())


def main(argv: list[str] | None = None) -> int:
    """`reconcile-hook pre-receive|post-receive`: the entry point of the git hook shims."""
    args = sys.argv[1:] if argv is None else argv
    hooks = {"pre-receive": pre_receive, "post-receive": post_receive}
    if len(args) != 1 or args[0] not in hooks:
        print("usage: reconcile-hook pre-receive|post-receive (ref updates on stdin)", file=sys.stderr)
        return 2
    try:
        return hooks[args[0]]()
    except Exception as e:   # any error is one line for the pusher, never a traceback
        _err(failure_line(args[0], e))
        return 1


# What to do about a path a hook cannot use, by where it lives.
_FIXES = (
    ("/etc/reconciler", "make it readable by the pushing users' group: chgrp reconciler {path} && "
                        "chmod g+r {path} (the directory: chmod 0750, group reconciler)"),
    ("runs", "the daemon writes its run logs group-readable (runs/ 0750, logs 0640) from this version on; "
             "restart it (systemctl restart reconciler) and check that the pushing user is in its group"),
    ("trigger", "the daemon creates it group-writable (0660) when it starts, and refuses a symlink there (its "
                "journal says why); restart it and check that the pushing user is in its group"),
)


def failure_line(hook: str, e: BaseException) -> str:
    """One line naming the path, the cause and the fix (pre-receive fails closed on it)."""
    verdict = "the push was refused" if hook == "pre-receive" else "the push landed"
    if isinstance(e, ConfigError | SourceError):
        return f"reconciler: {hook}: {e} ({verdict})"
    if isinstance(e, OSError):
        path = e.filename or "?"
        cause = e.strerror or type(e).__name__
        fix = next((f.format(path=path) for key, f in _FIXES if key in str(path)),
                   "check that the pushing user can read it (see systemd/README.md, the pushing users)")
        return f"reconciler: {hook}: cannot use {path}: {cause}; {verdict}. Fix: {fix}"
    return f"reconciler: {hook}: failed: {type(e).__name__}: {e} ({verdict})"
