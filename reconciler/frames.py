"""What a program run on a host is, and how its output is framed and read (pure).

Every program the reconciler runs on a host is a `HostProgram`: a shell file
(reconciler/sh/<name>.sh, shellcheck-clean), its named parameters, and a pure parser of its
answer into a typed result, as pyinfra writes a fact (a command and `process(output)`). The
program reads its parameters as `name=value` lines on stdin, ended by an empty line (a list is
its name repeated), then its payload, if it has one; the constants it shares with the Python
side (paths, limits) are assignments the sender puts in front of its text (`HostProgram.text`),
never written twice. host/programs.py runs programs, several in one sh where a round trip
reads several facts.

The program is given a TOKEN (its `token` parameter), random per run, and prints its answer as
records, one a line: `TOKEN KIND PAYLOAD`, the last `TOKEN END`. No file's content, no process
name and no other program's output can forge a record, since none holds the token: lines
without it (a login banner, another program of the same batch) are not records. An answer
without its END line was cut short: the facts that must be whole refuse it (`early`).

A program may end with a section printed as it is (observe.sh: `systemctl show`, unencoded):
from its `TOKEN MARK` line up to the last END line, read by `raw_section`.

Where each program and its parser live: plan/facts/ (observe, verify, GPU, versions, progress,
the journal, the apply script's answer), preflight/ (the model check and the engine check,
whose types are the rule pack's: preflight may not import plan/), host/ (the lock holder and
its session, which are the transport's). docs/architecture.md shows one worked example.

Host output is data: every parser of it answers any text (decoded as the transport decodes it)
with a value, or, where a fact must be whole, an ObserveError; never another exception. Its
numbers are bounded (`number`), its texts redacted before they are cut (redact.clip).
tests/test_host_output_props.py holds every parser to that.
"""

from __future__ import annotations

import base64
import binascii
from abc import abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from functools import cache, lru_cache
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

import msgspec

from . import redact, shell
from .errors import ObserveError


class Frame(NamedTuple):
    """One record: its kind, the rest of its line (payload), and the whole line (for messages)."""

    kind: str
    payload: str
    line: str

    def fields(self, most: int = -1) -> list[str]:
        """The fields after the kind, split on single spaces: at most `most` of them, the last
        holding the rest of the line (all of them when most is -1); [] when the line ends
        right after the kind."""
        return self.line.split(" ", most + 1 if most >= 0 else -1)[2:]


def frames(stdout: str, token: str, host: str = "?", *, early: str | None = None) -> Iterator[Frame]:
    """The records of `token` in stdout, in order, up to its END line.

    early: the message of the ObserveError raised, once the records are read, when there is no
    END line (the answer was cut short); None where an answer without END is read as far as it
    goes. Lines are split on newlines only (not splitlines(): a file's line may hold \\r, \\x0c
    or \\u2028).
    """
    prefix = token + " "
    for line in stdout.split("\n"):
        if not line.startswith(prefix):
            continue
        kind, _, payload = line[len(prefix):].partition(" ")
        if kind == "END":
            return
        yield Frame(kind, payload, line)
    if early is not None:
        raise ObserveError(host, early)


def raw_section(stdout: str, token: str, mark: str, host: str, early: str) -> tuple[str, str | None]:
    """Split off the section printed as it is after the line `TOKEN MARK`, up to the last END
    line: (the records before it, closed by their END line; the section, or None where there
    is none). A section without its END line raises ObserveError(host, early)."""
    head, opened, rest = stdout.partition(f"{token} {mark}\n")
    if not opened:
        return stdout, None
    section, end, _ = rest.rpartition(f"\n{token} END\n")
    if not end:
        raise ObserveError(host, early)
    return head + f"{token} END\n", section


def ended(stdout: str, token: str) -> tuple[str, int | None]:
    """A stream cut at its last END record that carries a status (`TOKEN END STATUS`: the
    holder's session ends each command's stdout so, host/session.py): the text before that
    record ("" where there is none), and the status (0-255; None where the record says none, or
    there is no record)."""
    body, end, status = stdout.rpartition(f"{token} END ")
    return body, exit_status(status.strip()) if end else None


def exit_status(text: str) -> int | None:
    """An exit status as a host program prints it ($?: 0-255); None for anything else."""
    code = number(text, 3)
    return code if code is not None and code <= 255 else None


def malformed(host: str, what: str, frame: Frame) -> ObserveError:
    """The error for a record that does not read as its kind says (its line redacted, then cut)."""
    return ObserveError(host, f"malformed {what} line: {redact.clip(frame.line, 80)!r}")


def number(text: str, digits: int = 18) -> int | None:
    """A count as a host program prints it: ASCII digits only (not `²` or `٣`, which str.isdigit
    accepts), at most `digits` of them; None for anything else. A longer run of digits is no
    number we take: int() refuses one of over 4,300 digits, and float() of a big one overflows."""
    if 0 < len(text) <= digits and text.isascii() and text.isdigit():
        return int(text)
    return None


def decode(payload: str, *, plain: bool = True) -> str:
    """A payload as the programs send a text: `@` and the text itself (printable ASCII without
    spaces, where plain), else base64 of its bytes (UTF-8, errors replaced). ValueError when
    it is not base64."""
    if plain and payload.startswith("@"):
        return payload[1:]
    try:
        return base64.b64decode(payload, validate=True).decode("utf-8", errors="replace")
    except (binascii.Error, ValueError):
        raise ValueError("bad base64") from None


# ---- the program: a file, its named parameters, its parser -------------------------------------

Param = str | int | Sequence[str] | None
T_co = TypeVar("T_co", covariant=True)


class Records(msgspec.Struct, frozen=True):
    """One program's answer in a command's output: the records of its token, and where they
    came from (`host`, for messages); `stderr`, for a program that says there what its steps
    printed (the apply script)."""

    stdout: str
    token: str
    host: str = "?"
    stderr: str = ""

    def __iter__(self) -> Iterator[Frame]:
        """The records, as far as they go (an answer cut short is read up to where it ends)."""
        return frames(self.stdout, self.token, self.host)

    def whole(self, early: str) -> Iterator[Frame]:
        """The records of an answer that must be whole: ObserveError(early) without its END."""
        return frames(self.stdout, self.token, self.host, early=early)

    def section(self, mark: str, early: str) -> tuple[Records, str | None]:
        """The records before the section printed as it is after `TOKEN MARK`, and that section
        (None where there is none): raw_section."""
        head, raw = raw_section(self.stdout, self.token, mark, self.host, early)
        return Records(head, self.token, self.host), raw


class HostProgram(msgspec.Struct, Generic[T_co], frozen=True):
    """A program run on a host: reconciler/sh/<name>.sh with its constants in front (`text`),
    its named parameters and payload on stdin (`stdin`), and a pure parser of its answer
    (`parse`). A subclass is a frozen Struct of what it asks; host/programs.run runs it."""

    name: ClassVar[str]
    constants: ClassVar[Mapping[str, str]] = {}
    # The fragments (reconciler/sh/<name>.sh: shared functions) sent in front of its text: every
    # program reads its named parameters with params.sh's `params`
    fragments: ClassVar[tuple[str, ...]] = ("params",)
    # In a batch it goes last: its answer runs to the end of the output (the shell becomes its
    # last command: show.sh), or it may leave the end of its payload unread (engine-probe.sh
    # reads its probe only where it runs it).
    last: ClassVar[bool] = False
    # The shell reads the program itself from stdin (`sh -s`), its parameters first as
    # assignments, then its text, then its payload (the apply script's steps, which are calls
    # of the program's functions): it runs alone.
    script_on_stdin: ClassVar[bool] = False
    # Its text is POSIX sh that bash runs alike; it never exits, `exec`s or sets a trap, and sets
    # every name it reads: a host session's bash may run it itself, with no sh of its own
    # (shell.ShScript), and a standing session in its own shell, run after run (the warm daemon's
    # observation: session.sh's here()).
    in_session: ClassVar[bool] = False
    # Its parameters come from its fields alone, and its fields are hashable: they are made once
    # for equal programs (the observation: a daemon asks every host the same each round).
    same_params: ClassVar[bool] = False

    def params(self) -> shell.Params:
        """The named parameters (a sequence: the name once per item; None: left out; or
        (name, value) pairs in the order a program reads them, as groups)."""
        return {}

    def payload(self) -> str:
        """What follows the parameters on stdin (the program reads exactly this much: a batch's
        next program reads what follows; a `last` one may leave its end unread)."""
        return ""

    @abstractmethod
    def parse(self, answer: Records) -> T_co:
        """The answer, read (pure): any text gives a value, or an ObserveError where the fact
        must be whole."""

    @classmethod
    def text(cls) -> str:
        """The program as it is sent: its file without comment lines, its constants first, then
        the fragments it calls (made once per program: the same text goes to every host)."""
        return _text(cls)

    def stdin(self, token: str) -> str:
        """Its stdin: `token=TOKEN`, its parameters, an empty line, then its payload. A program
        read from stdin: its text, then `T=TOKEN` and its parameters as assignments, then its
        payload."""
        if self.script_on_stdin:
            params = self.params()
            assert isinstance(params, Mapping)
            return self.text() + shell.assignments({"T": token, **params}) + self.payload()
        lines = _param_lines(self) if self.same_params else shell.param_lines(self.params())
        return f"token={token}\n{lines}{self.payload()}"


def batch(programs: Sequence[HostProgram[Any]], tokens: Sequence[str]) -> tuple[str, str]:
    """The command line that runs these programs one after the other in one sh (each but the
    last in a subshell of its own: its `exit`, traps and settings its own; the last in the sh
    itself, one process fewer), and the stdin that gives each its parameters, in order."""
    if len(programs) != len(tokens) or not programs:
        raise ValueError("one token per program, and at least one program")
    if any(p.last for p in programs[:-1]):
        raise ValueError("a program whose answer runs to the end of the output goes last")
    if programs[0].script_on_stdin:
        if len(programs) > 1:
            raise ValueError("a program read from stdin runs alone")
        return "sh -s", programs[0].stdin(tokens[0])
    stdin = "".join(p.stdin(t) for p, t in zip(programs, tokens, strict=True))
    return _command(tuple(type(p) for p in programs)), stdin


@lru_cache(maxsize=4096)
def _param_lines(program: HostProgram[Any]) -> str:
    """A program's parameter lines, made once for equal programs (HostProgram.same_params), each
    time sent with a token of its own in front."""
    return shell.param_lines(program.params())


@cache
def _text(program: type[HostProgram[Any]]) -> str:
    return shell.with_constants(shell.with_fragments(shell.program(program.name), program.fragments),
                                program.constants)


@cache
def _command(programs: tuple[type[HostProgram[Any]], ...]) -> str:
    """batch's command line for these programs (each a class's fixed text: made once)."""
    texts = [p.text() for p in programs]
    script = "".join(f"(\n{t})\n" for t in texts[:-1]) + texts[-1]
    name = f"reconciler-{programs[0].name}" if len(programs) == 1 else "reconciler-batch"
    return shell.ShScript(script, name) if all(p.in_session for p in programs) else shell.sh_c(script, name)
