"""The TOML files of a revision: listed, parsed and validated, every fault reported as a Problem.

One reading for fleet.toml, hosts/ and services/: a file that does not parse is one problem
with the line and column; a file that parses but does not match its schema gives a problem per
bad key, and is validated again without those keys so that the rest of it (a host's other
services, say) is still checked in the same run. A stray non-.toml file in a TOML folder is a
problem too, so that a mistyped extension never silently does nothing.

Limits, so that a crafted file is a problem of that file and never a traceback, a stalled hook
or a daemon that crashes on every run: a file over MAX_FILE_BYTES, the files of a revision over
MAX_REPO_BYTES together, and a file nested deeper than MAX_DEPTH (tomllib recurses per level
and raises RecursionError; tables.py and our own walks recurse too) are not used; tomlkit, a
tenth of tomllib's speed, words a syntax error only for a file up to MAX_FALLBACK_BYTES.
"""

from __future__ import annotations

import re
import tomllib
from typing import Any, TypeVar

from . import schema, tables
from .collect import Problems
from .problems import Hints, key_path, validation_problems
from .repo import SnapshotLike

T = TypeVar("T", bound=tables.Table)

_PARSE_POSITION = re.compile(r" at line \d+ col \d+$")

MAX_FILE_BYTES = 1 << 20          # one TOML file: a host file is a few KiB
MAX_REPO_BYTES = 32 << 20         # every TOML file of a revision together (thousands of hosts)
MAX_FALLBACK_BYTES = 256 << 10    # tomlkit (about 1.8 s per MiB) only words errors of files up to this
MAX_DEPTH = 32                    # tables and arrays inside each other; the schema needs 6
_TOO_DEEP: dict[str, Any] = {}    # what a parser that ran out of stack gives (tested by identity)

# Keys that belong elsewhere: say where, rather than list the keys allowed here.
_HINTS: Hints = {
    (schema.HostSSH, "known_hosts"): "unknown key: known_hosts is fleet-wide, set it under [ssh] in fleet.toml",
    (schema.ServiceDefinition, "use"):
        "unknown key: a definition cannot `use` another one (only a host's service table can)",
}


class TomlFiles:
    """Reads TOML files through the snapshot; every fault goes to `problems`."""

    def __init__(self, snap: SnapshotLike, problems: Problems):
        self.snap = snap
        self.problems = problems
        self.total = 0                 # bytes of TOML read so far in this load

    def parse(self, file: str, data: bytes) -> dict[str, Any] | None:
        """The parsed file, or None with a problem naming it (not UTF-8, too big, nested too
        deep, a syntax error with its line and column)."""
        if not self._within_limits(file, data):
            return None
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            self.problems.add(file, "", f"not UTF-8 text (bad byte at offset {e.start})")
            return None
        # The standard library's parser first (a tenth of tomlkit's time, and no tomlkit import:
        # every new revision is parsed whole, a 1,000-host repo is 1,000 files); tomlkit only
        # when it fails, for its message: the line, column and key of the fault.
        try:
            parsed: dict[str, Any] | None = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            parsed = self._fallback(file, text, e)
        except (RecursionError, MemoryError):
            parsed = _TOO_DEEP
        if parsed is _TOO_DEEP or (parsed is not None and nesting_depth(parsed) > MAX_DEPTH):
            self.problems.add(file, "", f"tables or arrays nested more than {MAX_DEPTH} deep: not a "
                                        "desired-state file; it was not read")
            return None
        return parsed

    def _within_limits(self, file: str, data: bytes) -> bool:
        self.total += len(data)
        if len(data) > MAX_FILE_BYTES:
            self.problems.add(file, "", f"the file is {len(data):,} bytes: a TOML file may be at most "
                                        f"{MAX_FILE_BYTES:,} bytes (1 MiB); it was not read")
            return False
        if self.total > MAX_REPO_BYTES:
            if self.total - len(data) <= MAX_REPO_BYTES:     # said once, at the file that crossed it
                self.problems.add(file, "", f"the TOML files of this revision are over {MAX_REPO_BYTES:,} "
                                            "bytes (32 MiB) together from this file on; it and the files "
                                            "after it were not read")
            return False
        return True

    def _fallback(self, file: str, text: str, error: tomllib.TOMLDecodeError) -> dict[str, Any] | None:
        """What tomlkit makes of a file tomllib refused: its words for the error (line, column,
        key), or the file when it takes it after all (a corner of the spec where they differ)."""
        if len(text) > MAX_FALLBACK_BYTES:       # tomllib's own words: tomlkit would take seconds
            self.problems.add(file, "", f"TOML syntax error: {error}")
            return None
        import tomlkit
        import tomlkit.exceptions
        try:
            return dict(tomlkit.parse(text).unwrap())
        except tomlkit.exceptions.ParseError as e:
            why = _PARSE_POSITION.sub("", str(e))
            self.problems.add(file, "", f"TOML syntax error at line {e.line}, column {e.col}: {why}")
        except (tomlkit.exceptions.TOMLKitError, ValueError) as e:
            self.problems.add(file, "", f"TOML syntax error: {e}")
        except (RecursionError, MemoryError):
            return _TOO_DEEP
        return None

    def validate(self, file: str, model: type[T], data: bytes) -> tuple[T | None, set[tuple[str, ...]]]:
        """Parse and validate one file; report its problems.

        Returns the model and the key paths that had problems. When only some keys are wrong,
        the model is validated again without them, so that the rest of the file (a host's other
        services, say) is still checked and its problems reported in the same run; callers skip
        whatever lies under a bad path (see `under`). None when nothing usable is left (a
        required key).
        """
        parsed = self.parse(file, data)
        if parsed is None:
            return None, set()
        try:
            return tables.validate(model, parsed), set()
        except tables.Invalid as e:
            for p in validation_problems(file, model, e.errors, data=parsed, hints=_HINTS):
                self.problems.add(p.file, p.key, p.message)
            bad = {key_path(err["loc"]) for err in e.errors}
        try:
            return tables.validate(model, _without(parsed, bad)), bad
        except tables.Invalid:
            return None, bad

    def listed(self, directory: str, what: str) -> list[tuple[str, str]]:
        """(stem, path) of the .toml files in a directory; other files there are problems,
        except README* and dotfiles, so that a mistyped extension never silently does nothing."""
        found = []
        for name in self.snap.list(directory):
            path = f"{directory}/{name}"
            if name.endswith(".toml"):
                found.append((name[: -len(".toml")], path))
            elif not (name.startswith(".") or name.upper().startswith("README")):
                self.problems.add(path, "", f"not a .toml file: {directory}/ holds only <{what}>.toml files")
        return found


def nesting_depth(data: Any) -> int:
    """How deep tables and arrays nest in parsed TOML (a table of scalars is 1), without
    recursion; stops counting past MAX_DEPTH."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, level = stack.pop()
        deepest = max(deepest, level)
        if level > MAX_DEPTH:
            break
        children = value.values() if isinstance(value, dict) else value
        stack += [(child, level + 1) for child in children if isinstance(child, dict | list)]
    return deepest


def under(path: tuple[str, ...], bad: set[tuple[str, ...]]) -> bool:
    """Whether any problem path lies at or below `path`."""
    return any(b[: len(path)] == path for b in bad)


def _without(data: dict[str, Any], paths: set[tuple[str, ...]], prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    """A copy of parsed TOML (the table at `prefix`) with the keys at `paths` removed (absent ones
    are ignored)."""
    return {key: _without(value, paths, (*prefix, key)) if isinstance(value, dict) else value
            for key, value in data.items() if (*prefix, key) not in paths}
