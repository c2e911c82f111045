"""Running host programs: one round trip for one program or several (frames.HostProgram).

`run(t, program)` runs one program on the host behind a transport and returns its parsed answer;
`run_all(t, programs)` runs several in one sh, in one round trip and one exec of sh (the
pre-flight reads its facts so), each given its own token and its parameters on stdin, and
returns each one's answer. Nothing here decides what a reading means: the parsers are pure and
live beside their programs; what the planner makes of them is the planner's. `Seen`: a warm
daemon's answers that are not parsed again.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import msgspec

from ..frames import HostProgram, Records, batch
from .transport import Completed, Transport

T = TypeVar("T")


class Seen:
    """Each host's last answer to a program, and what it was read as. A parser is pure, and its
    answer's token is random per run only so that host output cannot forge a record: two
    answers that are the same text around their tokens read as the same facts. A warm daemon
    (controller/daemon.py) reads every host every round, and a host that changed nothing
    answers the same text each time: its reading is then the last one, not parsed again (at
    1,000 hosts, about 0.2 s of the controller's CPU a round). One reading a host and program: a
    new answer replaces it; `retain` drops the hosts that left the fleet."""

    def __init__(self) -> None:
        # (host, program) -> (the fingerprint of its last answer, what that was read as)
        self._last: dict[tuple[str, str], tuple[bytes, Any]] = {}

    def __len__(self) -> int:
        return len(self._last)

    def parse(self, program: HostProgram[T], answer: Records) -> T:
        key, fingerprint = (answer.host, type(program).__qualname__), _fingerprint(program, answer)
        last = self._last.get(key)
        if last is not None and last[0] == fingerprint:
            return last[1]  # type: ignore[no-any-return]
        read = program.parse(answer)       # an answer that is no reading raises: nothing is kept
        self._last[key] = (fingerprint, read)
        return read

    def retain(self, hosts: Iterable[str]) -> None:
        keep = set(hosts)
        self._last = {k: v for k, v in self._last.items() if k[0] in keep}


def _fingerprint(program: HostProgram[Any], answer: Records) -> bytes:
    """What a parse of `answer` depends on besides the program's class (Seen's key): what the
    program asks, and the answer's text in the pieces between its tokens (msgpack: each piece
    with its length, so no two splits of different texts give the same bytes)."""
    pieces = (program, answer.stdout.split(answer.token), answer.stderr.split(answer.token))
    return hashlib.blake2b(msgspec.msgpack.encode(pieces), digest_size=16).digest()


async def _answers(t: Transport, programs: Sequence[HostProgram[Any]], *, what: str, timeout: float,
                   check: bool) -> tuple[list[Records], Completed]:
    """Run programs one after the other in one sh (frames.batch): each one's answer, and how the
    command ended."""
    toks = [secrets.token_hex(8) for _ in programs]   # random per run: host output cannot forge a record
    cmd, stdin = batch(programs, toks)
    res = await t.run(cmd, input=stdin, check=check, timeout=timeout, what=what)
    return [Records(res.stdout, tok, t.host, res.stderr) for tok in toks], res


async def run(t: Transport, program: HostProgram[T], *, what: str, timeout: float = 60.0,
              check: bool = True, seen: Seen | None = None) -> T:
    """Run one program and read its answer. check: a non-zero exit is a CommandError (what
    says which step, for the message). seen: read as the host's last answer was, where this
    one is the same."""
    (answer,), _ = await _answers(t, [program], what=what, timeout=timeout, check=check)
    return seen.parse(program, answer) if seen is not None else program.parse(answer)


async def run_with_status(t: Transport, program: HostProgram[T], *, what: str,
                          timeout: float = 60.0) -> tuple[T, Completed]:
    """Run one program: its answer, and how the command ended (its exit status and stderr),
    for a caller that judges both (the executor: a step that failed, or the script itself)."""
    (answer,), res = await _answers(t, [program], what=what, timeout=timeout, check=False)
    return program.parse(answer), res


async def run_all(t: Transport, programs: Sequence[HostProgram[Any]], *, what: str, timeout: float = 60.0,
                  check: bool = True) -> list[Any]:
    """Run programs one after the other in one sh (frames.batch) and read each one's answer, in
    order. Empty: nothing runs."""
    if not programs:
        return []
    answers, _ = await _answers(t, programs, what=what, timeout=timeout, check=check)
    return [p.parse(a) for p, a in zip(programs, answers, strict=True)]
