"""reconciler.libcache: find_library's answers kept across runs, asked again when the system changes."""

from __future__ import annotations

import ctypes.util
import os
from pathlib import Path

import pytest

from reconciler import libcache


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    calls: list[str] = []

    def fake(name: str) -> str | None:
        calls.append(name)
        return "libnettle.so.8" if name == "nettle" else None

    monkeypatch.setattr(ctypes.util, "find_library", fake)
    ld = tmp_path / "ld.so.cache"
    ld.write_text("v1")
    monkeypatch.setattr(libcache, "LD_CACHE", str(ld))
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    return calls


def _lookup(path: Path) -> list[str | None]:
    with libcache.remembered(path):
        return [ctypes.util.find_library(n) for n in ("oqs", "liboqs", "nettle")]


def test_answers_are_remembered_and_the_same(asked: list[str], tmp_path: Path) -> None:
    cache = tmp_path / "c" / "find_library.json"
    assert _lookup(cache) == [None, None, "libnettle.so.8"]
    assert asked == ["oqs", "liboqs", "nettle"]
    assert _lookup(cache) == [None, None, "libnettle.so.8"]
    assert asked == ["oqs", "liboqs", "nettle"]         # the second run asked nothing
    assert ctypes.util.find_library("x") is None and asked[-1] == "x"    # restored after the block


def test_a_changed_system_is_asked_again(asked: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "find_library.json"
    _lookup(cache)
    ld = Path(libcache.LD_CACHE)
    ld.write_text("v2, a library installed")
    os.utime(ld, ns=(1, 2))
    _lookup(cache)
    assert asked.count("oqs") == 2
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/oqs/lib")
    _lookup(cache)
    assert asked.count("oqs") == 3
    _lookup(cache)
    assert asked.count("oqs") == 3


def test_an_unreadable_cache_asks_ctypes(asked: list[str], tmp_path: Path) -> None:
    cache = tmp_path / "find_library.json"
    cache.write_text("{not json")
    assert _lookup(cache) == [None, None, "libnettle.so.8"]
    assert len(asked) == 3
    cache.write_text('{"key": 1, "libs": []}')
    _lookup(cache)
    assert len(asked) == 6


def _asyncssh_in_fresh_process(code: str, tmp_path: Path) -> list[object]:
    import json
    import subprocess
    import sys
    probe = (f"import sys, json\n{code}\nimport asyncssh\n"
             "print(json.dumps([asyncssh.public_key._x509_available, 'cryptography.x509' in sys.modules,\n"
             "                  sys.modules.get('asyncssh.crypto.x509', 0) is None]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True,
                         env={**os.environ, "RECONCILER_CACHE_DIR": str(tmp_path)}).stdout
    return list(json.loads(out))


def test_asyncssh_without_pyopenssl_never_tries_its_x509_module(tmp_path: Path) -> None:
    # asyncssh's X.509 support needs pyOpenSSL: without it, its module imported cryptography.x509
    # (20-40 ms) and then failed. import_asyncssh skips the attempt; asyncssh ends up the same.
    import importlib.util
    plain = _asyncssh_in_fresh_process("", tmp_path)
    ours = _asyncssh_in_fresh_process("from reconciler.libcache import import_asyncssh\nimport_asyncssh()", tmp_path)
    assert ours[0] == plain[0]                  # X.509 available or not, as asyncssh decides
    assert ours[2] is False                     # and nothing is left blocked after the import
    if importlib.util.find_spec("OpenSSL") is None:
        assert (plain[0], plain[1], ours[1]) == (False, True, False)
    else:
        assert ours[1] == plain[1]
