"""Running host programs: one round trip for one program or several (frames.HostProgram).

`run(t, program)` runs one program on the host behind a transport and returns its parsed answer;
`run_all(t, programs)` runs several in one sh, in one round trip and one exec of sh (the
pre-flight reads its facts so), each given its own token and its parameters on stdin, and
returns each one's answer. Nothing here decides what a reading means: the parsers are pure and
live beside their programs; what the planner makes of them is the planner's.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any, TypeVar

from ..frames import HostProgram, Records, batch
from .transport import Completed, Transport

T = TypeVar("T")


def tokens(n: int) -> list[str]:
    """n fresh tokens, one per program of a round trip (random per run: host output cannot
    forge a record)."""
    return [secrets.token_hex(8) for _ in range(n)]


async def run(t: Transport, program: HostProgram[T], *, what: str, timeout: float = 60.0,
              check: bool = True) -> T:
    """Run one program and read its answer. check: a non-zero exit is a CommandError (what
    says which step, for the message)."""
    (answer,) = await run_all(t, [program], what=what, timeout=timeout, check=check)
    return answer  # type: ignore[no-any-return]


async def run_with_status(t: Transport, program: HostProgram[T], *, what: str,
                          timeout: float = 60.0) -> tuple[T, Completed]:
    """Run one program: its answer, and how the command ended (its exit status and stderr),
    for a caller that judges both (the executor: a step that failed, or the script itself)."""
    tok = tokens(1)[0]
    cmd, stdin = batch([program], [tok])
    res = await t.run(cmd, input=stdin, check=False, timeout=timeout, what=what)
    return program.parse(Records(res.stdout, tok, t.host, res.stderr)), res


async def run_all(t: Transport, programs: Sequence[HostProgram[Any]], *, what: str, timeout: float = 60.0,
                  check: bool = True) -> list[Any]:
    """Run programs one after the other in one sh (frames.batch) and read each one's answer, in
    order. Empty: nothing runs."""
    if not programs:
        return []
    toks = tokens(len(programs))
    cmd, stdin = batch(programs, toks)
    res = await t.run(cmd, input=stdin, check=check, timeout=timeout, what=what)
    return [p.parse(Records(res.stdout, tok, t.host, res.stderr)) for p, tok in zip(programs, toks, strict=True)]
