"""The reconciler's exceptions, one root, each carrying the fields a report needs.

    ReconcilerError
     ├── ConfigError          bad desired state: a list of Problems (file, key, message); exit 1
     ├── SourceError          the git repo or revision cannot be read; exit 1
     ├── HostError            one host failed; the others go on (`reason`: a reasons.Reason)
     │    ├── ConnectError        unreachable, refused, timed out, auth failed (Unreachable)
     │    ├── HostKeyError        host key unknown or changed (HostKeyUnverified)
     │    ├── CommandError        a command on the host failed (CommandFailed; the host run
     │    │                       reports ApplyFailed for one that changes the host: loop/results.py)
     │    ├── ObserveError        the host's answer could not be understood (ObserveFailed)
     │    └── LockedError         another run holds the host's lock (Locked; host/lock.py)
     ├── RevisionRefused      the trust policy refuses a revision (desired/trust.py)
     ├── PublishError         pull mode's report could not be written or pushed (pull/_git.py)
     └── NotesError           the deploy notes could not be written (controller/gitnotes.py)

Messages never include environment values: they may carry tokens.
"""

from __future__ import annotations

import msgspec

from .reasons import Reason


class ReconcilerError(Exception):
    """Root of every error the reconciler raises on purpose."""


class Problem(msgspec.Struct, frozen=True):
    """One thing wrong with the desired state: where (file, dotted key) and what is expected."""

    file: str
    key: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}: {self.key}" if self.key else self.file
        return f"{where}: {self.message}"

    def data(self) -> dict[str, str]:
        """As JSON data: file, key, message."""
        return {"file": self.file, "key": self.key, "message": self.message}


class ConfigError(ReconcilerError):
    """The desired state is invalid; nothing may be applied anywhere."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class SourceError(ReconcilerError):
    """The git repository or the revision cannot be read."""


class HostError(ReconcilerError):
    """Something failed on one host. `reason` says what, in one word, for reports."""

    reason = Reason.HOST_FAILED

    def __init__(self, host: str, message: str):
        self.host = host
        self.message = message
        super().__init__(f"{host}: {message}")


class ConnectError(HostError):
    reason = Reason.UNREACHABLE


class HostKeyError(HostError):
    reason = Reason.HOST_KEY_UNVERIFIED


class CommandError(HostError):
    """A command on the host exited non-zero. stderr is kept short and never holds env values."""

    reason = Reason.COMMAND_FAILED

    def __init__(self, host: str, what: str, exit_status: int | None, stderr: str):
        self.what = what
        self.exit_status = exit_status
        self.stderr = _tail(stderr.strip(), 1000)
        tail = f": {self.stderr}" if self.stderr else ""
        super().__init__(host, f"{what} failed (exit {exit_status}){tail}")


def _tail(text: str, limit: int) -> str:
    """The end of the text, at most `limit` characters, starting at a line or word boundary: a
    token cut in half no longer matches the redactor's patterns, which run later, at the edge."""
    if len(text) <= limit:
        return text
    tail = text[-limit:]
    for sep in ("\n", " ", "\t"):
        at = tail.find(sep)
        if at >= 0:
            return "... " + tail[at + 1:].lstrip()
    return "... (the rest of the output is one word, not shown)"


class ObserveError(HostError):
    reason = Reason.OBSERVE_FAILED


# ---- how a value is named in a message (schema and rule-pack messages) ----


def describe(value: object) -> str:
    """A short TOML-flavoured rendering of a value for messages: 'abc', 22, true, a table."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value if len(value) <= 80 else value[:77] + "...")
    if isinstance(value, int | float):
        return repr(value)
    return kind_of(value)


def kind_of(value: object) -> str:
    """The TOML kind of a value ('a string', 'an integer', 'a table' ...), never the value."""
    return next((word for kind, word in _KINDS if isinstance(value, kind)), "a date or time")


# bool before int: a TOML boolean is a Python int too.
_KINDS: tuple[tuple[type, str], ...] = ((bool, "a boolean"), (str, "a string"), (int, "an integer"),
                                        (float, "a float"), (dict, "a table"), (list, "an array"))
