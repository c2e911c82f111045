"""Shell commands the reconciler sends to hosts: `sh -c SCRIPT NAME ARGS...`, kept with their parts,
and the programs they run, which are real shell files: reconciler/sh/*.sh.

Every program that runs on a host is a file in reconciler/sh/ (shellcheck-clean: tests/test_sh.py),
read once (`program`). Its constants are shell variables with defaults at the top, which the
Python side's constants are tested to equal; its variable parts are positional parameters.

`ShCommand` is the command line itself (a str, run as it is), and it keeps its script and
arguments, so that several can run in one sh (`one_sh`): each in a subshell of its own (its
positional parameters, variables, traps and `exit` its own), one exec of sh for all of them
instead of one each. Every process counts on a host that also loads a model: pre-flight's four
checks were four `sh` processes.
"""

from __future__ import annotations

import hashlib
import shlex
from collections.abc import Sequence
from functools import cache
from importlib import resources


class ShCommand(str):
    """`sh -c SCRIPT NAME ARGS...` (ARGS shell-quoted here), as a string with its parts."""

    script: str
    args: tuple[str, ...]

    def __new__(cls, script: str, name: str = "sh", args: Sequence[str] = ()) -> ShCommand:
        line = " ".join(["sh -c", shlex.quote(script), shlex.quote(name), *(shlex.quote(a) for a in args)])
        self = super().__new__(cls, line)
        self.script, self.args = script, tuple(args)
        return self

    def subshell(self) -> str:
        """The same script as a subshell of another sh, its positional parameters set."""
        params = " ".join(shlex.quote(a) for a in self.args)
        return f"(set -- {params}\n{self.script}\n)"


def one_sh(commands: Sequence[ShCommand], name: str = "sh") -> ShCommand:
    """Several commands run one after another in one sh, each in its own subshell (its exit
    status does not stop the next); stdin is the outer sh's, read by whichever reads it."""
    if len(commands) == 1:
        return commands[0]
    return ShCommand("\n".join(c.subshell() for c in commands), name)


@cache
def program(name: str) -> str:
    """The text of reconciler/sh/<name>.sh (package data) as it is sent: without its comment
    lines and blank lines (a third to a half of each file). Most programs go on the SSH command
    line of every run, to every host: at 1,000 hosts, every byte is sent a thousand times a round.
    The file in the package keeps them (shellcheck reads it, and so do people)."""
    text = resources.files("reconciler").joinpath("sh", f"{name}.sh").read_text()
    lines = text.splitlines()
    return "".join(line + "\n" for i, line in enumerate(lines)
                   if i == 0 or (line.strip() and not line.lstrip().startswith("#")))


def digest(text: str) -> str:
    """A program's content name: the first 16 hex digits of its SHA-256 (installed by content)."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]
