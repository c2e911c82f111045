"""The texts of the programs the reconciler runs on hosts, and how they are sent (base: pure).

Every program that runs on a host is a file in reconciler/sh/ (shellcheck-clean: tests/test_sh.py),
read once (`program`). The constants it shares with the Python side are assignments put in
front of its text (`with_constants`), never written in the file; its variable parts are named
parameters, `name=value` lines on its stdin (`param_lines`). frames.HostProgram puts these
together; the command line is `sh -c TEXT NAME` (`sh_c`), several programs in one sh where a
round trip reads several facts (frames.batch): every process counts on a host that also loads
a model.
"""

from __future__ import annotations

import hashlib
import shlex
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path


@cache
def program(name: str) -> str:
    """The text of reconciler/sh/<name>.sh (package data) as it is sent: without its comment
    lines and blank lines (a third to a half of each file). Most programs go on the SSH command
    line of every run, to every host: at 1,000 hosts, every byte is sent a thousand times a round.
    The file in the package keeps them (shellcheck reads it, and so do people)."""
    text = (Path(__file__).parent / "sh" / f"{name}.sh").read_text()      # no importlib.resources: 3 ms to import
    lines = text.splitlines()
    return "".join(line + "\n" for i, line in enumerate(lines)
                   if i == 0 or (line.strip() and not line.lstrip().startswith("#")))


def digest(text: str) -> str:
    """A program's content name: the first 16 hex digits of its SHA-256 (installed by content)."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def with_fragments(text: str, names: Sequence[str]) -> str:
    """A program's text with the functions it shares with others (reconciler/sh/<name>.sh, a
    fragment: functions only) after its first line: written once, sent with each program that
    calls them."""
    if not names:
        return text
    first, _, rest = text.partition("\n")
    return first + "\n" + "".join(program(n).partition("\n")[2] for n in names) + rest


def with_constants(text: str, constants: Mapping[str, str]) -> str:
    """A program's text with its constants assigned after its first line (the shebang): the
    values the Python side holds, written once there (`NAME='value'`)."""
    if not constants:
        return text
    first, _, rest = text.partition("\n")
    head = "".join(f"{k}={shlex.quote(v)}\n" for k, v in constants.items())
    return f"{first}\n{head}{rest}"


Params = Mapping[str, str | int | Sequence[str] | None] | Sequence[tuple[str, str]]


def param_lines(params: Params) -> str:
    """Named parameters as a program reads them on stdin: `name=value` lines (a sequence: one
    line per item; pairs: in their order, for a program that reads groups), then an empty line.
    ValueError for a value with a line break (it would end its line) or a name that is not a
    lowercase word."""
    out: list[str] = []
    pairs = params.items() if isinstance(params, Mapping) else params
    for name, value in pairs:
        if not name.replace("_", "a").isalnum() or not name.islower():
            raise ValueError(f"parameter name {name!r}")
        items = [] if value is None else [str(value)] if isinstance(value, (str, int)) else list(value)
        for v in items:
            if "\n" in v or "\r" in v:
                raise ValueError(f"parameter {name} holds a line break")
            out.append(f"{name}={v}\n")
    return "".join(out) + "\n"


def sh_c(script: str, name: str = "sh") -> str:
    """`sh -c SCRIPT NAME`: the command line that runs a program's text."""
    return f"sh -c {shlex.quote(script)} {shlex.quote(name)}"


class ShScript(str):
    """`sh -c SCRIPT NAME` (the command line, as `sh_c` makes it) that also carries its SCRIPT:
    a shell already running on the host (a host session's bash, host/session.py) may run the
    script itself, with no `sh` of its own. Only for a script that bash runs as sh does and
    that never `exec`s (the session's shell writes its end record after it): frames.HostProgram
    says which (`in_session`)."""

    script: str

    def __new__(cls, script: str, name: str = "sh") -> ShScript:
        cmd = super().__new__(cls, sh_c(script, name))
        cmd.script = script
        return cmd


def assignments(values: Mapping[str, str | int | Sequence[str] | None]) -> str:
    """Named parameters of a program the shell reads from stdin: `NAME='value'` lines (a
    sequence: its items a word each, for a list of plain words; None: left out)."""
    out = []
    for name, value in values.items():
        if not name.replace("_", "a").isalnum() or name[0].isdigit():
            raise ValueError(f"parameter name {name!r}")
        if value is None:
            continue
        text = str(value) if isinstance(value, (str, int)) else " ".join(value)
        out.append(f"{name}={shlex.quote(text)}\n")
    return "".join(out)
