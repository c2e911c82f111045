"""dataclasses' generated methods, compiled once: a run imports its frozen dataclasses without
compiling their methods' source again.

`@dataclass` writes each class's `__init__`, `__repr__`, `__eq__`, `__hash__` and, frozen,
`__setattr__` and `__delattr__` as source text and runs it with `exec` (Python 3.11 and 3.12: one
`exec` per method; 3.13: one per class). Compiling that text is most of a dataclass's cost:
about 0.8 ms a class on a 2-core controller, against 0.1 ms with the code compiled before. A run
that deploys creates some 65 of them, and a new commit's load in its child some 50 more
(pydantic's own). Importing a run's modules took 191 ms of CPU with this against 229 ms without
(medians of 20 alternated processes), the start of every run and every git hook.

The text depends only on the class (its fields, their defaults, the decorator's options), never
on the run, so the code it compiles to is kept like Python's own bytecode cache: in the cache dir
(`$RECONCILER_CACHE_DIR` or ~/.cache/reconciler, `code/`), one marshal file per Python build,
the text as the key. `install()` gives the dataclasses module an `exec` of its own that takes
the code for a text from there, and compiles (exactly as `exec` would: filename `<string>`, no
inherited compiler flags) what is not there. `save()` keeps what was compiled. The code a text
compiles to is the same code either way, so a class is the same class; only the time differs.

The file is read only where it and its directory are this user's and writable by nobody else:
what it holds is run. Anything else (missing, unreadable, foreign, corrupt, another build's)
means compiling as before. Only the command-line entry points install it; an importer of the
package gets dataclasses as they are.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import dataclasses
import marshal
import os
import sys
from pathlib import Path
from types import CodeType
from typing import Any

LIMIT = 2048     # entries kept (about 2 MB, 12 ms to read); past that a save keeps only what its process used
_codes: dict[str, CodeType] = {}
_used: set[str] = set()
_new: set[str] = set()      # compiled in this process, not (yet) in the file
_state: dict[str, Path | None] = {"path": None}


def cache_file(base: Path | None = None) -> Path:
    from .source import default_cache_dir
    tag = f"{sys.implementation.cache_tag}-{sys.hexversion:x}"
    return (base or default_cache_dir()) / "code" / f"dataclasses-{tag}.marshal"


def _read(path: Path) -> dict[str, CodeType]:
    """The kept code by text, or {} where the file is missing, foreign or not ours to trust
    (loadcache's rule for its pickles, which are run too; imported once dataclasses go
    through the cache)."""
    from .loadcache import _trusted
    try:
        if not _trusted(path.parent.stat()):
            return {}
        with open(path, "rb") as f:
            if not _trusted(os.fstat(f.fileno())):
                return {}
            data = marshal.load(f)
    except (OSError, EOFError, ValueError, TypeError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, CodeType)}


def _exec(source: Any, /, *args: Any, **kwargs: Any) -> None:
    """`exec` for the dataclasses module: a text's code from the cache, compiled once."""
    if type(source) is str:
        code = _codes.get(source)
        if code is None:
            # exec's own compile of a text: "<string>", and dataclasses.py's compiler flags
            # (none), not this module's (its `from __future__ import annotations`)
            code = _codes[source] = compile(source, "<string>", "exec", dont_inherit=True)
            _new.add(source)
        _used.add(source)
        source = code
    builtins.exec(source, *args, **kwargs)


def install(path: Path | None = None) -> None:
    """From now on (this process), dataclasses' methods compile through the cache at `path`
    (default: cache_file()). Once per process; what was compiled is kept at exit (`save()`;
    a forked child that leaves with os._exit calls it itself)."""
    if _state["path"] is not None:
        return
    dataclasses.exec = _exec  # type: ignore[attr-defined]  # found before the builtin by its `exec(...)`
    path = path or cache_file()           # (which imports a module or two: through the cache too)
    kept = _read(path)
    _codes.update(kept)
    _new.difference_update(kept)
    _state["path"] = path
    atexit.register(save)


def uninstall() -> None:
    """dataclasses' own `exec` again, and nothing kept in memory (tests)."""
    with contextlib.suppress(AttributeError):
        delattr(dataclasses, "exec")
    _codes.clear()
    _used.clear()
    _new.clear()
    _state["path"] = None


def save() -> None:
    """Keep the code compiled since install() (nothing to do when all of it came from the
    cache). Merged with what the file holds now (a load's child saves too); never raises."""
    path = _state["path"]
    if path is None or not _new:
        return
    _new.clear()
    from .loadcache import _trusted
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _trusted(path.parent.stat()):
            return
        codes = {**_read(path), **_codes}
        if len(codes) > LIMIT:
            codes = {k: _codes[k] for k in _used}
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            marshal.dump(codes, f)
        os.replace(tmp, path)
    except (OSError, ValueError):
        with contextlib.suppress(OSError):
            os.unlink(tmp)
