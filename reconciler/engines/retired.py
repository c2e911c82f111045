"""The engine probe's view of dead and renamed configuration, as the installed engine declares
it (no list of names of our own): its environment registry and deprecation tables, the flags its
parser marks deprecated, and its own warnings while the probe runs.

Sent to the host after probe.py and before the engine's adapter, in one text (``probe_text``):
it imports only the standard library and must not use ``from __future__`` (probe.py's holds for
the whole text).
"""

import argparse
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

# What an engine says of configuration it retired, in its own warnings and help texts (words, not names).
RETIRED = re.compile(r"deprecat|has been removed|no longer (?:supported|used|has any effect)|has no effect"
                     r"|will be removed|is ignored", re.I)

@dataclass
class Registry:
    """What the installed engine declares of its environment variables."""

    known: set[str] = field(default_factory=set)
    deprecated: dict[str, str] = field(default_factory=dict)     # name -> the engine's own words
    removed: dict[str, str] = field(default_factory=dict)        # name -> the engine's own words


def environment_warnings(engine_name: str, version: str | None, prefixes: tuple[str, ...],
                         packages: tuple[str, ...], read_registry: Callable[[], "Registry | None"]) -> list[str]:
    """A line for each variable of the engine's prefixes that the installed engine retired or
    does not know: not in its registry, not in its deprecation tables, not named in its code.
    The registry is read only when such a variable is set."""
    names = sorted(k for k in os.environ if k.startswith(prefixes))
    if not names:
        return []
    registry = read_registry()
    if registry is None:
        return []
    engine = f"{engine_name} {version}" if version else engine_name
    out: list[str] = []
    unknown: list[str] = []
    for name in names:
        canonical = canonical_name(prefixes, name)
        if name in registry.removed:
            out.append(registry.removed[name])
        elif name in registry.deprecated:
            out.append(registry.deprecated[name])
        elif name not in registry.known and canonical not in registry.known:
            unknown.append(name)
    for name in named_nowhere(packages, unknown):
        out.append(f"{name} is set, but {engine} does not know it (not in its environment registry, not named in "
                   f"its code): it has no effect there")
    return out


def canonical_name(prefixes: tuple[str, ...], name: str) -> str:
    """A variable under an engine's older prefix, as the engine reads it (SGL_X is SGLANG_X)."""
    first = prefixes[0]
    for old in prefixes[1:]:
        if name.startswith(old):
            return first + name[len(old):]
    return name


def named_nowhere(stems: tuple[str, ...], names: list[str]) -> list[str]:
    """Those of `names` that no source file of the engine's packages mentions: every top-level
    package on sys.path whose name starts with one of `stems` (the engine and its own kernels,
    e.g. sglang and sgl_kernel). Read only for a name outside the registry: the engine may still
    read it with os.environ; the files are read until every name has been seen in one."""
    if not names:
        return []
    left = {n: n.encode() for n in names}
    for data in _sources(_package_roots(stems)):
        for n in [n for n, b in left.items() if b in data]:
            del left[n]
        if not left:
            return []
    return [n for n in names if n in left]


def _package_roots(stems: tuple[str, ...]) -> list[str]:
    """The folders of the top-level packages on sys.path named with one of `stems` (each
    sys.path folder once; one that cannot be listed is passed over)."""
    roots: list[str] = []
    for entry in dict.fromkeys(p for p in sys.path if p and os.path.isdir(p)):
        try:
            names = sorted(os.listdir(entry))
        except OSError:
            continue
        roots += [os.path.join(entry, d) for d in names if _package_named(entry, d, stems)]
    return roots


def _package_named(entry: str, name: str, stems: tuple[str, ...]) -> bool:
    """Whether `name` in the sys.path folder `entry` is a package folder of the engine's (not a
    .dist-info or .pth beside it)."""
    return name.startswith(stems) and "." not in name and os.path.isdir(os.path.join(entry, name))


def _sources(roots: list[str]) -> Iterator[bytes]:
    """The bytes of each Python file under `roots`, one at a time, so that the search stops at
    the first file that leaves no name unseen (caches skipped, an unreadable file passed over)."""
    for root in roots:
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in files:
                if not f.endswith(".py"):
                    continue
                try:
                    with open(os.path.join(folder, f), "rb") as fh:
                        data = fh.read()
                except OSError:
                    continue
                yield data


def deprecated_flags(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """A line for each flag in `args` that the engine's parser marks deprecated or a no-op: a
    Deprecated* action, argparse's ``deprecated=`` (or the engine's own copy of it), or a help
    text that says so of the flag itself; the help text is the engine's replacement."""
    marked: set[Any] = getattr(parser, "_deprecated", set())
    out: list[str] = []
    for a in args:
        option = a.split("=", 1)[0]
        action = parser._option_string_actions.get(option) if option.startswith("-") else None
        if action is None:
            continue
        text = " ".join(str(action.help or "").split())
        if "Deprecated" in type(action).__name__ or getattr(action, "deprecated", False) is True \
                or action in marked or retired_help(text, action.option_strings):
            out.append(text if option in text else f"{option}: {text}" if text else f"{option} is deprecated")
    return out


def retired_help(text: str, options: Sequence[str]) -> bool:
    """Whether a help text says its own flag is retired: it starts with "Deprecated", or it says
    "--flag is deprecated" of one of the flag's own spellings (not "has no effect with X")."""
    if re.match(r"\W*deprecated\b", text, re.I):
        return True
    return any(re.search(rf"{re.escape(o)}\W*(?: \([^)]*\))? is deprecated", text, re.I)
               for o in options)


class Heard:
    """The engine's own warnings (log records at WARNING and up, and ``warnings.warn``) raised
    from its files while the probe runs, kept to quote those about retired configuration."""

    def __init__(self, package: str) -> None:
        self.package = package
        self.records: list[logging.LogRecord] = []
        self.caught: list[warnings.WarningMessage] = []

    @contextmanager
    def listening(self) -> Iterator[None]:
        old = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = old(*args, **kwargs)
            if record.levelno >= logging.WARNING and len(self.records) < 1000:
                self.records.append(record)
            return record

        logging.setLogRecordFactory(factory)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    yield
                finally:
                    self.caught = list(caught)[:1000]
        finally:
            logging.setLogRecordFactory(old)

    def retired(self) -> list[str]:
        out: list[str] = []
        for r in self.records:
            if engine_file(r.pathname, self.package):
                try:
                    text = r.getMessage()
                except Exception:  # a malformed record of the engine's: not ours to quote
                    continue
                if RETIRED.search(text):
                    out.append(text)
        out += [str(w.message) for w in self.caught
                if engine_file(w.filename, self.package) and RETIRED.search(str(w.message))]
        return out


def engine_file(path: str, package: str) -> str | None:
    """``PACKAGE/...py`` for a file of the engine package, else None."""
    m = re.search(rf"(?:^|/)({re.escape(package)}/.+)$", path or "")
    return m.group(1) if m and ("-packages/" in path or "/lib/python" in path) else None
