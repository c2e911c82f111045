"""Pull mode's edges without a host: the clone and the reports in git (real repositories built
with pygit2; two "hosts" mirror one bare repo through a file:// URL, as hosts mirror a server),
and the systemd units that `reconcile pull --install` writes (into a temp directory, with a
stand-in for systemctl that records what it was asked)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pygit2
import pytest

from reconciler.pull import _git
from reconciler.pull._units import PATH, SERVICE, TIMER, install, quote, render_units, uninstall
from reconciler.pull.schedule import NOTES_PREFIX, Report, Standing

SIG = pygit2.Signature("Test", "test@example.invalid")


def commit(repo: pygit2.Repository, message: str, *, when: int | None = None,
           parents: list[pygit2.Oid] | None = None, ref: str | None = "refs/heads/main") -> pygit2.Oid:
    sig = pygit2.Signature("Test", "test@example.invalid", when, 0) if when is not None else SIG
    blob = repo.create_blob(message.encode())
    tb = repo.TreeBuilder()
    tb.insert("file", blob, pygit2.GIT_FILEMODE_BLOB)
    if parents is None:
        parents = [] if repo.head_is_unborn else [repo.head.target]
    return repo.create_commit(ref, sig, sig, message, tb.write(), parents)


@pytest.fixture
def server(tmp_path: Path) -> pygit2.Repository:
    """A bare repo with three commits on main (a "server" that hosts fetch from)."""
    repo = pygit2.init_repository(str(tmp_path / "server.git"), bare=True, initial_head="main")
    for i, when in enumerate((1000, 2000, 3000)):
        commit(repo, f"c{i}", when=when)
    return repo


def test_history_is_first_parent_newest_first_with_committer_times(server: pygit2.Repository) -> None:
    side = commit(server, "side", when=3500, parents=[server.head.target], ref=None)
    merge = commit(server, "merge", when=4000, parents=[server.head.target, side])
    got = _git.history(server[merge])
    assert [c.time for c in got] == [4000, 3000, 2000, 1000]        # the side commit is not a candidate
    assert got[0].revision == str(merge)
    assert len(_git.history(server[merge], limit=2)) == 2


def test_reports_travel_through_the_server(server: pygit2.Repository, tmp_path: Path) -> None:
    url = f"file://{server.path}"
    a = _git.open_clone(url, tmp_path / "a")
    b = _git.open_clone(url, tmp_path / "b")
    assert a.path != b.path and Path(a.path).is_relative_to(tmp_path / "a" / "repos")
    head = str(a.head.target)
    said = _git.publish(a, Report("gpu-1", head, Standing.BAD, wave="canary", reason="CrashLoop", at=5), push=True)
    assert said == f"bad at {head[:7]} -> {NOTES_PREFIX}gpu-1 (pushed)"
    # the same report again (a later time aside) writes nothing
    assert _git.publish(a, Report("gpu-1", head, Standing.BAD, wave="canary", reason="CrashLoop", at=9),
                        push=True) is None
    assert server.lookup_note(head, f"{NOTES_PREFIX}gpu-1") is not None
    # host b sees it after its next fetch (open_clone fetches the notes with the branches)
    assert _git.read_reports(b, ["gpu-1"], {head}) == {}
    b = _git.open_clone(url, tmp_path / "b")
    got = _git.read_reports(b, ["gpu-1", "gpu-2"], {head})
    assert got == {"gpu-1": {head: Report("gpu-1", head, Standing.BAD, wave="canary", reason="CrashLoop", at=5)}}
    # only the revisions asked about
    assert _git.read_reports(b, ["gpu-1"], {"0" * 40}) == {}
    # `git log --notes` shows them to a person
    log = subprocess.run(["git", "-C", server.path, "log", "-1", "--notes=reconciler-pull/*", "--format=%N"],
                         capture_output=True, text=True, check=True).stdout
    assert '"standing": "bad"' in log


def test_a_local_repo_gets_the_note_itself(server: pygit2.Repository) -> None:
    repo = _git.open_clone(server.path, Path("/nonexistent"))     # a path is read where it is: no mirror
    assert Path(repo.path) == Path(server.path)
    head = str(repo.head.target)
    said = _git.publish(repo, Report("gpu-1", head, Standing.OK), push=False)
    assert said == f"ok at {head[:7]} -> {NOTES_PREFIX}gpu-1"
    assert _git.published(server, "gpu-1", head) == Report("gpu-1", head, Standing.OK)


def test_a_local_repo_of_another_user_is_left_alone(server: pygit2.Repository) -> None:
    """Root writing notes into a repo that another user pushes to would leave object directories
    that user cannot write: report nothing instead, and say why."""
    if os.geteuid() != 0:
        pytest.skip("needs root to hand the repo to another user")
    os.chown(server.path, 65534, 65534)
    with pytest.raises(_git.PublishError, match="belongs to uid 65534"):
        _git.publish(server, Report("gpu-1", str(server.head.target), Standing.OK), push=False)
    assert _git.published(server, "gpu-1", str(server.head.target)) is None


def test_a_push_that_fails_is_a_publish_error(server: pygit2.Repository, tmp_path: Path) -> None:
    a = _git.open_clone(f"file://{server.path}", tmp_path / "a")
    Path(server.path).rename(tmp_path / "gone.git")          # the server went away after the fetch
    with pytest.raises(_git.PublishError, match="cannot push refs/notes/reconciler-pull/gpu-1"):
        _git.publish(a, Report("gpu-1", str(a.head.target), Standing.OK), push=True)


def test_a_host_name_git_cannot_spell_is_not_published(server: pygit2.Repository) -> None:
    assert _git.notes_ref("a..b") is None
    with pytest.raises(_git.PublishError, match="cannot name a git ref"):
        _git.publish(server, Report("a..b", str(server.head.target), Standing.OK), push=False)


def test_branch_dir_is_where_the_followed_ref_lives(server: pygit2.Repository) -> None:
    assert _git.branch_dir(server, None) == str(Path(server.path) / "refs/heads")
    assert _git.branch_dir(server, "main") == str(Path(server.path) / "refs/heads")
    assert _git.branch_dir(server, str(server.head.target)) is None      # a fixed revision never moves
    server.set_head(server.head.target)
    assert _git.branch_dir(server, None) is None                          # detached


# ---- units ----------------------------------------------------------------------------------


def test_quote_for_execstart() -> None:
    assert quote("/opt/reconciler/bin/python3") == "/opt/reconciler/bin/python3"
    assert quote("git://127.0.0.1/fleet.git") == "git://127.0.0.1/fleet.git"
    assert quote("/srv/my fleet") == '"/srv/my fleet"'
    assert quote('a"b\\c') == '"a\\"b\\\\c"'
    assert quote("50%") == "50%%"
    assert quote("$HOME") == '"$$HOME"'
    assert quote("fleet\n") == '"fleet\\n"'                  # `$` would have let a trailing newline pass as plain


def test_render_units() -> None:
    argv = ["/opt/venv/bin/python3", "-m", "reconciler", "pull", "--repo", "/srv/fleet.git", "--host", "gpu-1"]
    units = render_units(argv, interval=60, splay=6, watch="/srv/fleet.git/refs/heads")
    assert set(units) == {SERVICE, TIMER, PATH}
    svc = units[SERVICE]
    assert "Type=oneshot\n" in svc and "TimeoutStartSec=infinity\n" in svc and "StartLimitIntervalSec=0\n" in svc
    assert "ExecStart=/opt/venv/bin/python3 -m reconciler pull --repo /srv/fleet.git --host gpu-1\n" in svc
    timer = units[TIMER]
    for line in ("OnBootSec=60s", "OnUnitActiveSec=60s", "RandomizedDelaySec=6s", "AccuracySec=1s",
                 "WantedBy=timers.target"):
        assert line + "\n" in timer
    assert "PathChanged=/srv/fleet.git/refs/heads\n" in units[PATH] and f"Unit={SERVICE}\n" in units[PATH]
    short = render_units(argv, interval=2.5, splay=0, watch=None)
    assert set(short) == {SERVICE, TIMER}
    assert "OnUnitActiveSec=2.500s\n" in short[TIMER] and "RandomizedDelaySec" not in short[TIMER]
    assert "OnBootSec=60s\n" in render_units(argv, interval=3600, splay=0, watch=None)[TIMER]


class Systemctl:
    """Records what it was asked; answers 0."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, cmd: list[str]) -> subprocess.CompletedProcess[str]:
        self.calls.append(" ".join(cmd[1:]))
        return subprocess.CompletedProcess(cmd, 0, "", "")


def test_install_is_idempotent_and_uninstall_removes(tmp_path: Path) -> None:
    argv = ["python3", "-m", "reconciler", "pull", "--repo", "/srv/fleet.git"]
    units = render_units(argv, interval=60, splay=0, watch="/srv/fleet.git/refs/heads")
    sc = Systemctl()
    said = install(units, unit_dir=tmp_path, run=sc)
    assert said[:3] == [f"{tmp_path / n}: written" for n in units]
    assert sc.calls == ["daemon-reload", f"enable --now {TIMER} {PATH}", f"restart {TIMER} {PATH}",
                        f"start --no-block {SERVICE}"]
    assert (tmp_path / SERVICE).read_text() == units[SERVICE] and (tmp_path / SERVICE).stat().st_mode & 0o777 == 0o600
    # again: nothing written, no reload, no restart (the run is started once more)
    sc.calls.clear()
    said = install(units, unit_dir=tmp_path, run=sc)
    assert said[:3] == [f"{tmp_path / n}: unchanged" for n in units]
    assert sc.calls == [f"enable --now {TIMER} {PATH}", f"start --no-block {SERVICE}"]
    # a URL now: no path unit; the old one is stopped and removed; a new interval restarts the timer
    sc.calls.clear()
    url_units = render_units(argv, interval=30, splay=0, watch=None)
    said = install(url_units, unit_dir=tmp_path, run=sc)
    assert not (tmp_path / PATH).exists()
    assert f"{tmp_path / PATH}: removed (the repo is not a local path any more)" in said
    assert sc.calls == [f"disable --now {PATH}", "daemon-reload", f"enable --now {TIMER}", f"restart {TIMER}",
                        f"start --no-block {SERVICE}"]
    sc.calls.clear()
    said = uninstall(unit_dir=tmp_path, run=sc)
    assert said == [f"{tmp_path / SERVICE}: removed", f"{tmp_path / TIMER}: removed"]
    assert not list(tmp_path.iterdir())
    assert sc.calls == [f"disable --now {TIMER}", "daemon-reload", f"reset-failed {SERVICE}"]
    assert uninstall(unit_dir=tmp_path, run=sc)[0].startswith("nothing to remove")


def test_install_says_when_systemctl_fails(tmp_path: Path) -> None:
    def failing(cmd: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 1, "", "Failed to connect to bus")
    with pytest.raises(OSError, match=r"systemctl daemon-reload failed \(1\): Failed to connect to bus"):
        install(render_units(["x"], interval=60, splay=0, watch=None), unit_dir=tmp_path, run=failing)


# ---- choosing over a real history -----------------------------------------------------------


def commit_files(repo: pygit2.Repository, files: dict[str, str], when: int) -> str:
    """A commit on main holding exactly `files` (nested paths), committed at `when`."""
    def tree(entries: dict[str, str]) -> pygit2.Oid:
        tb = repo.TreeBuilder()
        subdirs: dict[str, dict[str, str]] = {}
        for path, text in entries.items():
            head, _, rest = path.partition("/")
            if rest:
                subdirs.setdefault(head, {})[rest] = text
            else:
                tb.insert(head, repo.create_blob(text.encode()), pygit2.GIT_FILEMODE_BLOB)
        for name, sub in subdirs.items():
            tb.insert(name, tree(sub), pygit2.GIT_FILEMODE_TREE)
        return tb.write()
    sig = pygit2.Signature("Test", "test@example.invalid", when, 0)
    parents = [] if repo.head_is_unborn else [repo.head.target]
    return str(repo.create_commit("refs/heads/main", sig, sig, "c", tree(files), parents))


def test_an_invalid_or_hostless_commit_is_passed_over(tmp_path: Path) -> None:
    """The wave may deploy two older commits; the newer of them is broken: the one before it.
    The commits' ages are taken at a fixed `now` (the run's wall clock is the caller's)."""

    from reconciler.desired.load import load_desired
    from reconciler.desired.source import snapshot
    from reconciler.errors import ConfigError
    from reconciler.pull._run import PullOptions, _choose

    r = pygit2.init_repository(str(tmp_path / "desired.git"), bare=True, initial_head="main")
    files = {"fleet.toml": '[pull]\nwaves = [ { name = "canary", labels = { wave = "canary" } }, '
                           '{ name = "rest", after = "1h" } ]\n',
             "hosts/a.toml": 'address = "127.0.0.5"\nlabels = { wave = "canary" }\n',
             "hosts/b.toml": 'address = "127.0.0.6"\n'}
    now = 1_795_000_000
    good = commit_files(r, files, now - 3 * 3600)
    broken = commit_files(r, {**files, "hosts/b.toml": 'address = "127.0.0.6"\nport = 22\n'}, now - 2 * 3600)
    head = commit_files(r, files, now - 60)                     # valid, but too young for "rest"
    opts = PullOptions(repo=r.path)
    snap = snapshot(r, None)
    choice, wave, loaded = _choose(r, snap, load_desired(snap), "b", None, opts, now=now)
    assert (choice.revision, wave) == (good, 1), choice
    assert [s.revision for s in choice.skipped] == [head, broken]
    assert choice.skipped[1].why.startswith("cannot be loaded (hosts/b.toml: port: unknown key")
    assert set(loaded) == {head, good}
    # the host's applied revision is never left for an older one: one that cannot be loaded any
    # more (and nothing newer old enough) stops the run, as an invalid head does (exit 1)
    with pytest.raises(ConfigError, match="port: unknown key"):
        _choose(r, snap, load_desired(snap), "b", broken, opts, now=now)
    # a host that the older commits do not have yet waits until the commit that adds it is old enough
    late = commit_files(r, {**files, "hosts/c.toml": 'address = "127.0.0.7"\n'}, now - 30)
    snap = snapshot(r, None)
    choice, _, _ = _choose(r, snap, load_desired(snap), "c", None, opts, now=now)
    assert choice.revision is None and [s.revision for s in choice.skipped] == [late, head, broken, good]
    assert choice.skipped[1].why == "1m old; wave rest deploys a commit once it is 1h old"
    assert choice.skipped[2].why.startswith("cannot be loaded")
    assert choice.skipped[3].why == f"c has no host file at {good[:7]}"
