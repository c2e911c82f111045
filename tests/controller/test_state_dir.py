"""The state directory is not trusted by its name (review N4): `sudo -E` hands a user's
RECONCILER_STATE_DIR, XDG_STATE_HOME or HOME to root. The caches (engine verdicts, server versions)
and the store (`state.db`) are opened only in a directory of this user's alone, as files of this
user's alone: a planted link is never followed (its target is untouched), a forged file of
another user is never read, and a door refuses such a directory in one line naming it and the fix.

Run as root (as CI runs the unit tier), with files of `nobody` standing in for the user's."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from reconciler import dirs
from reconciler.controller.store import Store
from reconciler.host.cachefile import CacheFile
from reconciler.host.engine import VerdictCache
from tests.conftest import ROOT, DesiredRepo

NOBODY = 65534
FORGED = {"gpu-1": {"k": {"stamp": "s", "verdict": {"verdict": "ok", "message": "forged"}}}}


def victim(tmp_path: Path) -> tuple[Path, bytes, int]:
    """A file root cares about (stands in for /etc/nologin, /etc/passwd): its path, bytes, mtime."""
    v = tmp_path / "victim"
    v.write_bytes(b"root's file\n")
    os.utime(v, ns=(1_000_000_000, 1_000_000_000))
    return v, v.read_bytes(), v.stat().st_mtime_ns


def untouched(v: Path, data: bytes, mtime: int) -> bool:
    return v.read_bytes() == data and v.stat().st_mtime_ns == mtime


def theirs(path: Path) -> Path:
    """A directory of the user's (uid nobody), as ~/.local/state/reconciler would be under sudo -E."""
    path.mkdir(parents=True)
    os.chown(path, NOBODY, NOBODY)
    return path


# ---- the caches ------------------------------------------------------------------------------------


def test_a_cache_linked_elsewhere_is_not_read_and_its_save_replaces_the_link_not_the_target(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    v, data, mtime = victim(tmp_path)
    v.write_text(json.dumps(FORGED))
    data, mtime = v.read_bytes(), v.stat().st_mtime_ns
    (state / "engine-verdicts.json").symlink_to(v)
    c = VerdictCache(state / "engine-verdicts.json")
    assert c.data == {}                                    # the forged verdict was not read through the link
    c.data["gpu-2"] = {"x": {"stamp": "1"}}
    c.save()
    assert untouched(v, data, mtime)
    entry = state / "engine-verdicts.json"
    assert not entry.is_symlink() and json.loads(entry.read_text()) == {"gpu-2": {"x": {"stamp": "1"}}}
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600
    assert sorted(p.name for p in state.iterdir()) == ["engine-verdicts.json"]       # no temp file left


def test_temporary_names_planted_for_the_next_pids_are_never_written_through(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    v, data, mtime = victim(tmp_path)
    pid = os.getpid()
    for n in range(pid - 5, pid + 200):            # the old scheme's names, and then some
        (state / f"server-versions.tmp{n}").symlink_to(v)
        (state / f".server-versions.json.{n}.tmp").symlink_to(v)
    c = CacheFile(state / "server-versions.json")
    c.data["gpu-1"] = {"k": {"stamp": "1", "version": "0.5.12"}}
    c.save()
    assert untouched(v, data, mtime)
    assert json.loads((state / "server-versions.json").read_text())["gpu-1"]["k"]["version"] == "0.5.12"


@pytest.mark.parametrize("spoil", ["another owner", "group-writable", "two links", "a fifo"])
def test_a_cache_file_that_is_not_ours_alone_is_not_read(tmp_path, spoil):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    entry = state / "engine-verdicts.json"
    if spoil == "a fifo":
        os.mkfifo(entry, 0o600)                     # never blocks the run: opened non-blocking, then refused
    else:
        entry.write_text(json.dumps(FORGED))
        entry.chmod(0o600)
    if spoil == "another owner":
        os.chown(entry, NOBODY, NOBODY)
    elif spoil == "group-writable":
        entry.chmod(0o620)
    elif spoil == "two links":
        os.link(entry, tmp_path / "second")
    assert VerdictCache(entry).data == {}
    assert CacheFile(entry).data == {}


def test_a_cache_in_another_users_directory_is_neither_read_nor_written(tmp_path):
    state = theirs(tmp_path / "home" / "state")
    entry = state / "engine-verdicts.json"
    entry.write_text(json.dumps(FORGED))
    os.chown(entry, NOBODY, NOBODY)
    (state / "server-versions.json").symlink_to(tmp_path / "victim")
    before = sorted(p.name for p in state.iterdir())
    c = VerdictCache(entry)
    assert c.data == {}
    c.data["gpu-2"] = {"x": {"stamp": "1"}}
    c.save()                                        # memory only: nothing written there
    CacheFile(state / "server-versions.json").save()
    assert sorted(p.name for p in state.iterdir()) == before
    assert json.loads(entry.read_text()) == FORGED
    assert not (tmp_path / "victim").exists()


def test_a_good_cache_round_trips(tmp_path):
    entry = tmp_path / "new" / "engine-verdicts.json"
    c = VerdictCache(entry)
    c.data["gpu-1"] = {"k": {"stamp": "1"}}
    c.save()
    assert stat.S_IMODE(entry.parent.stat().st_mode) == 0o700
    assert VerdictCache(entry).data == {"gpu-1": {"k": {"stamp": "1"}}}


# ---- the store -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["state.db", "state.db-wal", "state.db-shm", "state.db-journal"])
def test_a_store_file_linked_elsewhere_is_refused_and_its_target_untouched(tmp_path, name):
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    v, data, mtime = victim(tmp_path)
    (state / name).symlink_to(v)
    with pytest.raises(dirs.UnsafePath) as e:
        Store(state)
    assert str(e.value) == (f"state store {state / name} is a symbolic link: the store is not opened through it; "
                            f"remove it (the store starts empty) or move the real one there")
    assert untouched(v, data, mtime)
    assert sorted(p.name for p in state.iterdir()) == [name]          # nothing created beside it


def test_a_dangling_link_for_state_db_is_not_created_through(tmp_path):
    """The review's example: state.db -> /etc/nologin, which does not exist yet (root would create it)."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "state.db").symlink_to(tmp_path / "nologin")
    with pytest.raises(dirs.UnsafePath):
        Store(state)
    assert not (tmp_path / "nologin").exists()


@pytest.mark.parametrize("spoil", ["another owner", "group-writable", "two links"])
def test_a_store_file_that_is_not_ours_alone_is_refused(tmp_path, spoil):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    Store(state).close()
    db = state / "state.db"
    if spoil == "another owner":
        os.chown(db, NOBODY, NOBODY)
        why = f"belongs to uid {NOBODY}, not 0"
    elif spoil == "group-writable":
        db.chmod(0o660)
        why = "is writable by others (mode 0660)"
    else:
        os.link(db, tmp_path / "second")
        why = "has 2 hard links"
    with pytest.raises(dirs.UnsafePath) as e:
        Store(state)
    assert str(e.value).startswith(f"state store {db} {why}: ")


def test_another_programs_database_is_not_written_into(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    other = sqlite3.connect(state / "state.db")
    other.execute("CREATE TABLE accounts (name TEXT)")
    other.commit()
    other.close()
    (state / "state.db").chmod(0o600)
    with pytest.raises(dirs.UnsafePath) as e:
        Store(state)
    assert "holds tables that are not the reconciler's (accounts)" in str(e.value)
    tables = {r[0] for r in sqlite3.connect(state / "state.db").execute("SELECT name FROM sqlite_master")}
    assert tables == {"accounts"}


def test_a_new_store_is_root_only_and_an_existing_one_opens(tmp_path):
    s = Store(tmp_path / "fresh")
    s.set_value("k", "v")
    s.close()
    assert stat.S_IMODE((tmp_path / "fresh" / "state.db").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "fresh").stat().st_mode) == 0o700
    assert Store(tmp_path / "fresh").get_value("k") == "v"


# ---- the directory ---------------------------------------------------------------------------------


def test_another_users_state_directory_is_refused_naming_it_and_the_fix(tmp_path):
    state = theirs(tmp_path / "home" / "state")
    with pytest.raises(dirs.UnsafePath) as e:
        Store(state)
    assert str(e.value) == (f"state directory {state} belongs to uid {NOBODY}, not to this run's uid 0: run as its "
                            f"owner (sudo -u '#{NOBODY}' ...), or set RECONCILER_STATE_DIR to a directory of uid 0's "
                            f"(sudo -E keeps a user's HOME, XDG_STATE_HOME and RECONCILER_STATE_DIR)")
    assert list(state.iterdir()) == []


def test_a_state_directory_writable_by_others_is_refused(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o777)
    with pytest.raises(dirs.UnsafePath) as e:
        Store(state)
    assert str(e.value) == f"state directory {state} is writable by others (mode 0777): chmod go-w {state}"


def test_a_state_directory_inside_one_another_user_can_change_is_refused(tmp_path):
    parent = theirs(tmp_path / "home")
    state = parent / "state"
    state.mkdir(mode=0o700)                          # root's, but the user could rename it away
    with pytest.raises(dirs.UnsafePath) as e:
        Store(state)
    assert str(e.value).startswith(f"state directory {state} lies in {parent}, which uid {NOBODY} or others can "
                                   f"change (mode 0755)")


def test_a_link_to_our_own_directory_is_followed_once_and_checked_there(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    Store(tmp_path / "link").close()
    assert (real / "state.db").is_file()
    link = tmp_path / "link2"
    link.symlink_to(theirs(tmp_path / "theirs"))
    with pytest.raises(dirs.UnsafePath) as e:
        Store(link)
    assert str(e.value).startswith(f"state directory {tmp_path / 'theirs'} belongs to uid {NOBODY}")


# ---- the doors -------------------------------------------------------------------------------------


def reconcile(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reconciler", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env={**os.environ, "NO_COLOR": "1", "COLUMNS": "400", **env})


@pytest.mark.parametrize("args", [("--dry-run",), ("--dry-run", "--json"), ()])
def test_a_run_as_root_with_the_users_state_directory_refuses_before_anything(tmp_path, args):
    r = DesiredRepo(tmp_path / "r")
    r.write("fleet.toml", "")
    r.write("units/m.service", "[Service]\nExecStart=/usr/bin/server\n")
    r.write("hosts/a.toml", 'address = "127.0.0.9"\n[services.m]\nunit_file = "units/m.service"\n')
    r.commit("one")
    state = theirs(tmp_path / "home" / ".local" / "state" / "reconciler")
    (state / "engine-verdicts.tmp1234").symlink_to(tmp_path / "victim")
    res = reconcile("--repo", str(r.path), *args, env={"RECONCILER_STATE_DIR": str(state)})
    assert res.returncode == 1, res.stdout + res.stderr
    message = (f"state directory {state} belongs to uid {NOBODY}, not to this run's uid 0: run as its owner (sudo -u "
               f"'#{NOBODY}' ...), or set RECONCILER_STATE_DIR to a directory of uid 0's (sudo -E keeps a user's HOME, "
               f"XDG_STATE_HOME and RECONCILER_STATE_DIR)")
    if "--json" in args:
        assert json.loads(res.stdout) == {"error": "UnsafePath", "message": message}
    else:
        assert res.stderr.strip() == f"error: {message}"
    assert "127.0.0.9" not in res.stdout + res.stderr and "Traceback" not in res.stderr
    assert sorted(p.name for p in state.iterdir()) == ["engine-verdicts.tmp1234"]
    assert not (tmp_path / "victim").exists()


def test_status_and_history_refuse_it_in_one_line(tmp_path):
    state = theirs(tmp_path / "state")
    for args in (("status",), ("history", "gpu-1")):
        res = reconcile(*args, "--state-dir", str(state), env={})
        assert res.returncode == 1 and res.stderr.startswith(f"error: state directory {state} belongs to uid "), \
            res.stderr
        assert "Traceback" not in res.stderr


def test_the_daemon_refuses_it_before_making_anything_there(tmp_path):
    from reconciler.controller.config import ControllerConfig
    from reconciler.controller.daemon import Daemon
    state = theirs(tmp_path / "state")
    with pytest.raises(dirs.UnsafePath) as e:
        Daemon(ControllerConfig(repo=str(tmp_path), state_dir=str(state), web="", metrics=""))
    assert str(e.value).startswith(f"state directory {state} belongs to uid {NOBODY}")
    assert list(state.iterdir()) == []                 # no runs/ made in it
