"""reconciler.dccache: dataclasses' generated methods compiled once, kept across runs, and the
classes exactly what dataclasses makes without it."""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reconciler import dccache

# A frozen dataclass as the package writes them: defaults, a default factory, a docstring.
SOURCE = '''
from dataclasses import dataclass, field

@dataclass(frozen=True)
class Probe:
    """a probe"""
    name: str
    port: int = 8000
    tags: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
'''


def _make() -> type:
    ns: dict[str, Any] = {}
    exec(compile(SOURCE, "probe_module", "exec", dont_inherit=True), ns)
    return ns["Probe"]


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The texts dccache compiled (its own `compile`, counted)."""
    seen: list[str] = []

    def counting(source: str, *args: Any, **kwargs: Any) -> Any:
        seen.append(source)
        return compile(source, *args, **kwargs)
    dccache.uninstall()
    monkeypatch.setattr(dccache, "compile", counting, raising=False)
    yield seen
    dccache.uninstall()


def _same(cls: type, plain: type) -> None:
    """`cls` behaves as the class dataclasses makes with its own exec (`plain`)."""
    a, b = cls("m", tags=("x",)), plain("m", tags=("x",))
    assert repr(a).replace(cls.__qualname__, "P") == repr(b).replace(plain.__qualname__, "P")
    assert a == cls("m", 8000, ("x",), {"k": "v"}) and a != cls("n")
    assert hash(a) == hash(cls("m", tags=("x",)))
    assert str(inspect.signature(cls)) == str(inspect.signature(plain))
    assert dataclasses.replace(a, port=1).port == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.port = 2          # type: ignore[attr-defined]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del a.name          # type: ignore[attr-defined]
    assert cls.__init__.__qualname__ == "Probe.__init__"
    assert cls.__init__.__code__.co_filename == plain.__init__.__code__.co_filename == "<string>"
    assert cls.__init__.__code__.co_code == plain.__init__.__code__.co_code


def test_methods_compile_once_and_the_class_is_the_same(compiles: list[str], tmp_path: Path) -> None:
    plain = _make()                                  # dataclasses' own exec (not installed)
    assert compiles == []
    path = tmp_path / "code" / "dc.marshal"
    dccache.install(path)
    assert dataclasses.exec is dccache._exec  # type: ignore[attr-defined]
    _same(_make(), plain)
    first = len(compiles)
    assert first >= 5        # __init__, __repr__, __eq__, __setattr__, __delattr__, __hash__ (3.11/3.12)
    dccache.save()
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700

    dccache.uninstall()      # the next run
    dccache.install(path)
    _same(_make(), plain)
    assert len(compiles) == first                    # nothing compiled again
    mtime = path.stat().st_mtime_ns
    dccache.save()
    assert path.stat().st_mtime_ns == mtime          # and nothing to keep


def test_a_file_not_only_ours_is_not_read(compiles: list[str], tmp_path: Path) -> None:
    path = tmp_path / "code" / "dc.marshal"
    dccache.install(path)
    _make()
    dccache.save()
    first = len(compiles)
    for target, mode in ((path, 0o620), (path.parent, 0o770)):
        os.chmod(target, mode)
        dccache.uninstall()
        dccache.install(path)
        before = len(compiles)
        _make()
        assert len(compiles) == before + first       # compiled afresh: what the file holds is run
        os.chmod(target, 0o600 if target == path else 0o700)


def test_a_corrupt_file_is_compiled_over(compiles: list[str], tmp_path: Path) -> None:
    path = tmp_path / "code" / "dc.marshal"
    path.parent.mkdir(mode=0o700)
    path.write_bytes(b"\x00not marshal")
    os.chmod(path, 0o600)
    dccache.install(path)
    plain_count = len(compiles)
    _make()
    assert len(compiles) > plain_count
    dccache.save()
    dccache.uninstall()
    dccache.install(path)
    before = len(compiles)
    _make()
    assert len(compiles) == before                   # the rewritten file serves


def test_exec_of_code_and_mappings_passes_through(compiles: list[str], tmp_path: Path) -> None:
    dccache.install(tmp_path / "dc.marshal")
    ns: dict[str, Any] = {}
    dccache._exec(compile("x = 1", "<t>", "exec"), ns)
    dccache._exec("y = x + 1", ns, ns)
    assert ns["y"] == 2 and compiles == ["y = x + 1"]


def test_the_reconcile_command_keeps_them(tmp_path: Path) -> None:
    """Through the real entry point: a first run keeps what it compiled, a second run finds all
    of it there (it writes nothing)."""
    env = {**os.environ, "RECONCILER_CACHE_DIR": str(tmp_path / "cache"), "NO_COLOR": "1"}
    stamps = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-m", "reconciler", "--help"], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        (path,) = (tmp_path / "cache" / "code").glob("dataclasses-*.marshal")
        stamps.append(path.stat().st_mtime_ns)
    assert stamps[0] == stamps[1]
    assert len(dccache._read(path)) > 20


def test_a_full_file_keeps_only_what_this_process_used(compiles: list[str], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "code" / "dc.marshal"
    dccache.install(path)
    _make()
    for i in range(3):      # texts another entry point compiled
        dccache._exec(f"z{i} = {i}", {})
    dccache.save()
    assert len(dccache._read(path)) == len(compiles)
    dccache.uninstall()
    monkeypatch.setattr(dccache, "LIMIT", 3)
    dccache.install(path)
    _make()                 # all from the file; nothing new to keep
    dccache._exec("w = 1", {})
    dccache.save()
    kept = dccache._read(path)
    assert "w = 1" in kept and not any(k.startswith("z") for k in kept)
    assert len(kept) == len(compiles) - 3
