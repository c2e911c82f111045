"""The TOML files of a revision: listed, parsed and validated, every fault reported as a Problem.

One reading for fleet.toml, hosts/ and services/: a file that does not parse is one problem
with the line and column; a file that parses but does not match its schema gives a problem per
bad key, and is validated again without those keys so that the rest of it (a host's other
services, say) is still checked in the same run. A stray non-.toml file in a TOML folder is a
problem too, so that a mistyped extension never silently does nothing.
"""

from __future__ import annotations

import contextlib
import re
import tomllib
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from . import schema
from .collect import Problems
from .problems import Hints, key_path, validation_problems
from .repo import SnapshotLike

T = TypeVar("T", bound=BaseModel)

_PARSE_POSITION = re.compile(r" at line \d+ col \d+$")

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

    def parse(self, file: str, data: bytes) -> dict[str, Any] | None:
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            self.problems.add(file, "", f"not UTF-8 text (bad byte at offset {e.start})")
            return None
        # The standard library's parser first (a tenth of tomlkit's time, and no tomlkit import:
        # every new revision is parsed whole, a 1,000-host repo is 1,000 files); tomlkit only
        # when it fails, for its message: the line, column and key of the fault.
        with contextlib.suppress(tomllib.TOMLDecodeError):
            return tomllib.loads(text)
        import tomlkit
        import tomlkit.exceptions
        try:
            parsed = tomlkit.parse(text).unwrap()
        except tomlkit.exceptions.ParseError as e:
            why = _PARSE_POSITION.sub("", str(e))
            self.problems.add(file, "", f"TOML syntax error at line {e.line}, column {e.col}: {why}")
            return None
        except (tomlkit.exceptions.TOMLKitError, ValueError) as e:
            self.problems.add(file, "", f"TOML syntax error: {e}")
            return None
        return dict(parsed)

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
            return model.model_validate(parsed), set()
        except ValidationError as e:
            for p in validation_problems(file, model, e, data=parsed, hints=_HINTS):
                self.problems.add(p.file, p.key, p.message)
            bad = {key_path(err["loc"]) for err in e.errors(include_url=False)}
        try:
            return model.model_validate(_without(parsed, bad)), bad
        except ValidationError:
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


def under(path: tuple[str, ...], bad: set[tuple[str, ...]]) -> bool:
    """Whether any problem path lies at or below `path`."""
    return any(b[: len(path)] == path for b in bad)


def _without(data: dict[str, Any], paths: set[tuple[str, ...]]) -> dict[str, Any]:
    """A copy of parsed TOML with the keys at `paths` removed (absent ones are ignored)."""

    def prune(table: dict[str, Any], prefix: tuple[str, ...]) -> dict[str, Any]:
        out = {}
        for key, value in table.items():
            path = (*prefix, key)
            if path in paths:
                continue
            out[key] = prune(value, path) if isinstance(value, dict) else value
        return out

    return prune(data, ())
