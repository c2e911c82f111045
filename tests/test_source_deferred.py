"""A run at a commit loaded before reads neither git nor the loader (issue 15, cold start):
HEAD comes from git's own ref files (source.deferred_snapshot), the state from the load cache
by the tree noted for that commit (loadcache.load_known); git is opened only if something reads
the repository; and anything unusual falls back to pygit2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from reconciler import loadcache, source
from reconciler.errors import ConfigError

from .test_cold_start import heavy, loaded, small_repo


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def test_head_from_ref_files_loose_packed_detached_and_bare(tmp_path):
    repo = small_repo(tmp_path / "desired")
    first = repo.commit()
    snap = source.deferred_snapshot(str(repo.path), None, "fleet")
    assert snap is not None and snap.revision == first and snap.subdir == "fleet"
    git(repo.path, "pack-refs", "--all")               # refs/heads/main only in packed-refs now
    assert not (repo.path / ".git/refs/heads/main").exists()
    assert source.deferred_snapshot(str(repo.path)).revision == first      # type: ignore[union-attr]
    repo.write("fleet/units/s.service", "[Service]\nExecStart=/bin/false\n")
    second = repo.commit()                              # a loose ref again, newer than the packed one
    assert source.deferred_snapshot(str(repo.path)).revision == second     # type: ignore[union-attr]
    git(repo.path, "checkout", "-q", "--detach", first)
    assert source.deferred_snapshot(str(repo.path)).revision == first      # type: ignore[union-attr]
    bare = tmp_path / "bare.git"
    git(tmp_path, "clone", "-q", "--bare", str(repo.path), str(bare))
    assert source.deferred_snapshot(str(bare)).revision == git(bare, "rev-parse", "HEAD")  # type: ignore[union-attr]


def test_anything_unusual_is_left_to_pygit2(tmp_path, monkeypatch):
    repo = small_repo(tmp_path / "desired")
    first = repo.commit()
    assert source.deferred_snapshot(str(repo.path), first) is None            # a revision given
    assert source.deferred_snapshot(str(repo.path / "fleet")) is None          # inside a clone
    assert source.deferred_snapshot("https://example.invalid/x.git") is None   # a URL
    git(repo.path, "worktree", "add", "-q", str(tmp_path / "wt"))
    assert source.deferred_snapshot(str(tmp_path / "wt")) is None              # a linked worktree
    assert source.deferred_snapshot(str(tmp_path / "nothing")) is None
    monkeypatch.setenv("GIT_QUARANTINE_PATH", str(tmp_path))                   # inside pre-receive
    assert source.deferred_snapshot(str(repo.path)) is None


def test_a_commit_loaded_before_needs_neither_git_nor_the_loader(tmp_path):
    repo = small_repo(tmp_path / "desired")
    first = repo.commit()
    cache = tmp_path / "cache"
    snap = source.deferred_snapshot(str(repo.path), None, "fleet")
    assert snap is not None and loadcache.load_known(snap, cache) is None      # never loaded: the loader
    state = loadcache.load(source.snapshot(source.open_repo(str(repo.path)), None, "fleet"), cache)
    assert state.revision == first

    code = (f"from pathlib import Path\nfrom reconciler import loadcache, source\n"
            f"snap = source.deferred_snapshot({str(repo.path)!r}, None, 'fleet')\n"
            f"state = loadcache.load_known(snap, Path({str(cache)!r}))\n"
            f"assert state is not None and state.revision == {first!r}\n"
            f"assert state.hosts['h1'].services['s'].env == {{'A': '1'}}\n"
            f"import sys\nassert 'pygit2' not in sys.modules\n"
            f"rules = loadcache.rules(snap)       # pre-flight's rule pack: kept too, still no git\n"
            f"assert 'pygit2' not in sys.modules\n"
            f"assert snap.read('units/s.service') == b'[Service]\\nExecStart=/bin/true\\n'   # git, now\n"
            f"print('OK', len(rules.rules))")
    mods = loaded(code)
    assert "pygit2" in mods      # opened for the read at the end
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent, timeout=60)
    assert "OK" in out.stdout, out.stderr
    mods = loaded(code.split("rules = ")[0])
    assert heavy(mods, ("pygit2", "pydantic", "tomlkit", "reconciler.load", "reconciler.schema")) == []

    # A new commit has no note yet: the loader runs (and notes it); a moved HEAD is followed.
    host = repo.path / "fleet/hosts/h1.toml"
    host.write_text(host.read_text().replace('"1"', '"2"'))
    second = repo.commit()
    snap2 = source.deferred_snapshot(str(repo.path), None, "fleet")
    assert snap2 is not None and snap2.revision == second and loadcache.load_known(snap2, cache) is None
    # another --path at the same commit is another note
    other = source.deferred_snapshot(str(repo.path), None, "")
    assert other is not None and loadcache.load_known(other, cache) is None


def test_a_new_commit_without_rules_of_its_own_reuses_the_kept_shipped_pack(tmp_path):
    """The rule pack of a revision with no rules/ is the shipped one, the same for every such
    revision of this code: parsed once, then read back (a new commit skips parsing it); a repo
    with rules of its own is parsed every time, its bad rule file still an error."""
    repo = small_repo(tmp_path / "desired")
    repo.commit()
    cache = tmp_path / "cache"
    loadcache.load(source.snapshot(source.open_repo(str(repo.path)), None, "fleet"), cache)
    assert len(list((cache / "desired").glob("shipped-*.rules"))) == 1
    host = repo.path / "fleet/hosts/h1.toml"
    host.write_text(host.read_text().replace('"1"', '"3"'))
    repo.commit()
    code = (f"from pathlib import Path\nfrom reconciler import loadcache, source\nimport sys\n"
            f"snap = source.snapshot(source.open_repo({str(repo.path)!r}), None, 'fleet')\n"
            f"state = loadcache.load(snap, Path({str(cache)!r}))\n"
            f"assert state.hosts['h1'].services['s'].env == {{'A': '3'}}\n"
            f"assert 'reconciler.preflight._rules' not in sys.modules\n"
            f"rules = loadcache.rules(snap)\n"
            f"print('RULES', len(rules.rules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0 and "RULES" in out.stdout, out.stderr
    shipped = int(out.stdout.split()[-1])
    assert shipped > 0

    # rules of its own: parsed (a bad one is the load's error, as before)
    repo.write("fleet/rules/mine.toml", "[[rule]]\nid = 'x'\nbogus = 1\n")
    repo.commit()
    with pytest.raises(ConfigError):
        loadcache.load(source.snapshot(source.open_repo(str(repo.path)), None, "fleet"), cache)
