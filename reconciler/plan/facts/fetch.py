"""PURE: a model's own fetch command, run on the host (reconciler/sh/fetch.sh), and its answer.

`FetchCommand(path, command)` runs the service's `model.fetch` in the model's directory (made
first) as the SSH user's login shell runs a command line; host/apply.fetch_model runs it, once
the planner decided it may (plan/state.fetch_refused). The command comes as the payload (any
text, line breaks included), never on a command line of ours. `parse_fetch` reads its exit
status and the last lines it printed (its stderr and stdout, both sent to stderr), redacted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import msgspec

from ... import redact
from ...frames import HostProgram, Param, Records
from .apply import status_of

TAIL_LINES = 3            # the last lines of what a failed fetch printed, for its message
TAIL_MAX = 600            # characters kept of them (redacted first)


class Fetched(msgspec.Struct, frozen=True):
    """How a fetch ended: its exit status (None: the answer never said: cut short), and the
    last lines it printed."""

    status: int | None
    tail: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == 0


class FetchCommand(HostProgram[Fetched], frozen=True):
    """reconciler/sh/fetch.sh: `command` run in `path`."""

    name: ClassVar[str] = "fetch"
    path: str
    command: str

    def params(self) -> Mapping[str, Param]:
        return {"path": self.path}

    def payload(self) -> str:
        return self.command

    def parse(self, answer: Records) -> Fetched:
        return parse_fetch(answer)


def parse_fetch(answer: Records) -> Fetched:
    """The fetch's answer (pure, any text): its `F STATUS` record (a status that is no number of
    at most 3 digits reads as 1), and the last TAIL_LINES non-blank lines of its stderr."""
    status: int | None = None
    for f in answer:
        if f.kind == "F":
            fields = f.fields()
            status = status_of(fields[0]) if fields else 1
    lines = [x.strip() for x in answer.stderr.split("\n") if x.strip()][-TAIL_LINES:]
    return Fetched(status, tuple(redact.clip(x, TAIL_MAX) for x in lines))
