"""How every program the reconciler runs on a host frames its output, read one way (pure).

A program (reconciler/sh/*.sh) is given a TOKEN, random per run, and prints its answer as
records, one a line: `TOKEN KIND PAYLOAD`, the last `TOKEN END`. No file's content, no process
name and no other program's output can forge a record, since none holds the token: lines
without it (a login banner, another program of the same batch) are not records. An answer
without its END line was cut short: the facts that must be whole refuse it (`early`).

A program may end with a section printed as it is (observe.sh: `systemctl show`, unencoded):
from its `TOKEN MARK` line up to the last END line, read by `raw_section`.

Each fact is a command builder and a parser of these records, a handler per kind, next to
each other: facts.py (observe.sh), host/gpu.py (gpu.sh), host/versions.py (versions.sh),
loop/checks.py (verify.sh) and preflight/_hostcheck.py (model-check.sh; the preflight layer
may not import plan/, so it keeps a copy of `frames`, tested to read the same).

Host output is data: every parser of it answers any text (decoded as the transport decodes it)
with a value, or, where a fact must be whole, an ObserveError; never another exception. Its
numbers are bounded (`number`), its texts redacted before they are cut (redact.clip).
tests/test_host_output_props.py holds every parser to that.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator
from typing import NamedTuple

from . import redact
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
