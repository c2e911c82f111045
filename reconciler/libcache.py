"""asyncssh's import without a compiler run: `ctypes.util.find_library` answers remembered.

Importing asyncssh looks for three optional C libraries with `ctypes.util.find_library`
(liboqs twice, for post-quantum key exchange, and nettle, for UMAC). On Linux each miss runs
`ldconfig -p`, then gcc (with collect2 and ld), then ld: eleven processes and about 30 ms on
every run, and every git hook, of a controller where liboqs is not installed. The answers
depend only on the system's libraries, so they are kept in the cache dir, keyed by what they
depend on: /etc/ld.so.cache (rewritten by ldconfig whenever a library is installed or removed),
the library path variables and the Python version. Any change there, or an unreadable cache,
asks ctypes again: the answer is always the one ctypes gives.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

LD_CACHE = "/etc/ld.so.cache"


def _key() -> str:
    try:
        st = os.stat(LD_CACHE)
        ld = f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        ld = "-"
    env = [os.environ.get(v, "") for v in ("LD_LIBRARY_PATH", "LIBRARY_PATH")]
    return json.dumps([ld, *env, sys.version, sys.platform])


def cache_file() -> Path:
    from .source import default_cache_dir
    return default_cache_dir() / "find_library.json"


@contextlib.contextmanager
def remembered(path: Path | None = None) -> Iterator[None]:
    """Within the block, `ctypes.util.find_library` answers from the cache where it can; what
    it had to ask ctypes for is saved at the end."""
    path = path or cache_file()
    key = _key()
    known: dict[str, str | None] = {}
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        data = json.loads(path.read_text())
        if data.get("key") == key and isinstance(data.get("libs"), dict):
            known = {str(k): (v if isinstance(v, str) else None) for k, v in data["libs"].items()}
    asked: list[str] = []
    real = ctypes.util.find_library

    def find_library(name: str) -> str | None:
        if name not in known:
            known[name] = real(name)
            asked.append(name)
        return known[name]

    ctypes.util.find_library = find_library
    try:
        yield
    finally:
        ctypes.util.find_library = real
        if asked:
            with contextlib.suppress(OSError):
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.{os.getpid()}")
                tmp.write_text(json.dumps({"key": key, "libs": known}))
                os.replace(tmp, path)


X509 = "asyncssh.crypto.x509"


def import_asyncssh() -> None:
    """Import asyncssh (once per process) with find_library's answers remembered.

    asyncssh's X.509 certificate support is optional and needs pyOpenSSL. Where pyOpenSSL is
    missing, its module imports cryptography.x509 (20-40 ms) before it fails on `from OpenSSL
    import crypto`, and asyncssh goes on without it. There the module is not tried at all:
    asyncssh meets the same ImportError at once, and goes on exactly as it would have."""
    if "asyncssh" in sys.modules:
        return
    import importlib.util
    skip = X509 not in sys.modules and importlib.util.find_spec("OpenSSL") is None
    if skip:
        sys.modules[X509] = None        # type: ignore[assignment]  # import says: not available
    try:
        with remembered():
            import asyncssh  # noqa: F401
    finally:
        if skip and sys.modules.get(X509, 0) is None:
            del sys.modules[X509]
