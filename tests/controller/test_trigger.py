"""The trigger file (H2 of the 2026-12-02 review): the daemon and the post-receive hook never
create, chmod or touch a file through a symlink or a hard link someone left at its path."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pygit2
import pytest

from reconciler.controller import hooks
from reconciler.controller.config import ControllerConfig
from reconciler.controller.daemon import Daemon
from reconciler.controller.trigger import TRIGGER_MODE


def bare(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.git"
    pygit2.init_repository(str(path), bare=True, initial_head="main")
    return path


def daemon(tmp_path: Path, repo: Path) -> Daemon:
    return Daemon(ControllerConfig(repo=str(repo), state_dir=str(tmp_path / "state"), metrics="", web=""),
                  interval=3600)


def victim(tmp_path: Path) -> Path:
    """A file of the daemon's that must keep its mode: a stand-in for state.db."""
    v = tmp_path / "elsewhere" / "state.db"
    v.parent.mkdir()
    v.write_text("the rewind memory\n")
    v.chmod(0o600)
    return v


def test_a_symlinked_trigger_is_refused_at_daemon_start_and_its_target_is_untouched(tmp_path, capsys):
    repo = bare(tmp_path)
    v = victim(tmp_path)
    (repo / "reconciler.trigger").symlink_to(v)
    d = daemon(tmp_path, repo)
    looked = asyncio.Event()
    watch_paths = d._watch_paths

    def spy() -> tuple[list[Path], set[str]]:
        try:
            return watch_paths()
        finally:
            looked.set()

    d._watch_paths = spy  # type: ignore[method-assign]

    async def start_and_stop() -> None:
        served = asyncio.create_task(d.serve())
        await asyncio.wait_for(looked.wait(), 30)
        d.stopping.set()
        await asyncio.wait_for(served, 30)

    asyncio.run(start_and_stop())
    out = capsys.readouterr().out
    assert stat.S_IMODE(v.stat().st_mode) == 0o600
    assert v.read_text() == "the rewind memory\n"
    assert (f"reconciler: not using the trigger file {repo / 'reconciler.trigger'}: it is a symbolic link "
            f"(it would make the daemon change the file it points to); remove it") in out, out
    assert (repo / "reconciler.trigger").is_symlink()        # left as found, for the admin to look at


def test_a_dangling_symlink_creates_nothing(tmp_path, capsys):
    repo = bare(tmp_path)
    target = tmp_path / "elsewhere" / "find_library.json"
    target.parent.mkdir()
    (repo / "reconciler.trigger").symlink_to(target)
    paths, names = daemon(tmp_path, repo)._watch_paths()
    assert not target.exists() and not target.is_symlink()
    assert str(repo / "reconciler.trigger") not in names
    assert "it is a symbolic link" in capsys.readouterr().out


def test_a_missing_trigger_is_made_the_daemons_own_regular_file(tmp_path, capsys):
    repo = bare(tmp_path)
    os.umask(0o077)           # the unit's UMask: the mode is set explicitly, never from the umask
    try:
        paths, names = daemon(tmp_path, repo)._watch_paths()
    finally:
        os.umask(0o022)
    st = os.lstat(repo / "reconciler.trigger")
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == TRIGGER_MODE
    assert str(repo / "reconciler.trigger") in names and repo in paths
    assert "not using" not in capsys.readouterr().out


def test_an_own_trigger_gets_its_mode_back(tmp_path):
    repo = bare(tmp_path)
    t = repo / "reconciler.trigger"
    t.write_text("")
    t.chmod(0o600)
    paths, names = daemon(tmp_path, repo)._watch_paths()
    assert stat.S_IMODE(t.stat().st_mode) == TRIGGER_MODE and str(t) in names


def test_a_hard_link_to_a_daemon_file_is_refused_and_keeps_its_mode(tmp_path, capsys):
    repo = bare(tmp_path)
    v = victim(tmp_path)
    os.link(v, repo / "reconciler.trigger")
    paths, names = daemon(tmp_path, repo)._watch_paths()
    assert stat.S_IMODE(v.stat().st_mode) == 0o600
    assert str(repo / "reconciler.trigger") not in names
    assert "it has 2 hard links (a chmod would change the other names too); remove it" in capsys.readouterr().out


def test_a_fifo_is_refused_without_blocking(tmp_path, capsys):
    repo = bare(tmp_path)
    os.mkfifo(repo / "reconciler.trigger", 0o666)
    paths, names = daemon(tmp_path, repo)._watch_paths()
    assert str(repo / "reconciler.trigger") not in names
    assert "it is not a regular file; remove it" in capsys.readouterr().out


def test_another_users_regular_file_is_watched_with_its_mode_left_alone(tmp_path, monkeypatch, capsys):
    repo = bare(tmp_path)
    t = repo / "reconciler.trigger"
    t.write_text("")
    t.chmod(0o640)
    d = daemon(tmp_path, repo)                                         # its own state directory
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(t).st_uid + 1)   # the daemon is someone else
    paths, names = d._watch_paths()
    assert stat.S_IMODE(t.stat().st_mode) == 0o640 and str(t) in names
    assert "not using" not in capsys.readouterr().out


def test_a_trigger_the_daemon_cannot_create_says_how_to_make_it(tmp_path, capsys):
    d = daemon(tmp_path, bare(tmp_path))
    target = tmp_path / "ro" / "reconciler.trigger"
    target.parent.mkdir()
    d.cfg = d.cfg.model_copy(update={"trigger_file": str(target)})

    def refuse(*_a: object, **_k: object) -> int:
        raise PermissionError(13, "Permission denied", str(target))

    with pytest.MonkeyPatch.context() as m:
        m.setattr(os, "open", refuse)
        paths, names = d._watch_paths()
    assert str(target) not in names
    assert "cannot create it (Permission denied); make it the daemon's: install -m 0660 -o " in capsys.readouterr().out


def post_receive(repo: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    import io
    monkeypatch.setenv("GIT_DIR", str(repo))
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{'0' * 40} {'1' * 40} refs/heads/main\n"))
    code = hooks.main(["post-receive"])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_the_hook_never_touches_through_a_symlink(tmp_path, monkeypatch, capsys):
    repo = bare(tmp_path)
    v = victim(tmp_path)
    os.utime(v, (1_000_000_000, 1_000_000_000))
    (repo / "reconciler.trigger").symlink_to(v)
    code, out = post_receive(repo, monkeypatch, capsys)
    assert v.stat().st_mtime == 1_000_000_000 and v.read_text() == "the rewind memory\n"
    assert code == 1 and f"post-receive: cannot use {repo / 'reconciler.trigger'}: Too many levels of symbolic" in out


def test_the_hook_never_creates_the_trigger(tmp_path, monkeypatch, capsys):
    repo = bare(tmp_path)
    code, out = post_receive(repo, monkeypatch, capsys)
    assert code == 0 and not (repo / "reconciler.trigger").exists()
    assert f"the daemon's trigger {repo / 'reconciler.trigger'} does not exist" in out


def test_the_hook_bumps_the_daemons_trigger(tmp_path, monkeypatch, capsys):
    repo = bare(tmp_path)
    t = repo / "reconciler.trigger"
    t.write_text("")
    os.utime(t, (1_000_000_000, 1_000_000_000))
    code, out = post_receive(repo, monkeypatch, capsys)
    assert code == 0 and t.stat().st_mtime > 1_000_000_000 and "deploy of 1111111 requested" in out
