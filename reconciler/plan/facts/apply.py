"""PURE: what the executor's program (reconciler/sh/apply.sh) answers about the steps it ran.

Its records: `now EPOCH` (the host's clock as the script began), `ok N` and `fail N STATUS` (a
systemctl step: the script went on), `fatal N STATUS` (a file step: the script stopped there),
then `S -` and systemd's reading of the units it started, as it is, up to its END (the health
watch's first reading). On stderr, `step N` records say which step printed what follows them:
a failed step's message is what it printed, redacted, then cut.

Host output is data (review N5): a record that does not read as its kind says (a step number
past the plan's, a status of many digits, a clock that is no number) is read as far as it goes,
never raised. The answer is never refused for being cut short: the steps it reports happened.
"""

from __future__ import annotations

import re

import msgspec

from ... import redact
from ...frames import Records, exit_status, number
from .show import parse_show

MESSAGE_MAX = 2000        # characters kept of what a failed step printed (redacted first)
SOFT_LINES = 5            # the last lines of a failed systemctl step's message
_CLOCK = re.compile(r"[0-9]{1,12}(?:\.[0-9]{1,9})?")     # epoch seconds, as `date +%s` prints them


class StepFailed(msgspec.Struct, frozen=True):
    """A step that failed: its index in the plan, its exit status, and what it printed."""

    step: int
    status: int
    message: str


class ApplyAnswer(msgspec.Struct, frozen=True):
    """What the script said: the host's clock when it began, the systemctl steps that failed
    (the script went on), the file step it stopped at (if any), and systemd's reading of the
    units it started (None: the script ended before it)."""

    clock: float | None = None
    failures: tuple[StepFailed, ...] = ()
    fatal: StepFailed | None = None
    shown: dict[str, dict[str, str]] | None = msgspec.field(default=None)


def status_of(text: str) -> int:
    """An exit status as a host program prints it (frames.exit_status); 1 for anything else."""
    status = exit_status(text)
    return 1 if status is None else status


def step_output(stderr: str, token: str) -> dict[int, list[str]]:
    """What each step printed on stderr: the lines after each of its `step N` records, up to the
    next such record (of any step)."""
    out: dict[int, list[str]] = {}
    current: list[str] | None = None
    mark = f"{token} step "
    for line in stderr.split("\n"):
        if line.startswith(mark):
            n = number(line[len(mark):], 9)
            current = out.setdefault(n, []) if n is not None else None
        elif current is not None:
            current.append(line)
    return out


def parse_apply(answer: Records, steps: int) -> ApplyAnswer:
    """The apply script's answer (pure), for a plan of `steps` actions: a step number that is no
    step of it is not one."""
    before, mark, rest = answer.stdout.partition(f"{answer.token} S -\n")
    shown, end, _ = rest.rpartition(f"\n{answer.token} END\n")
    head = Records(before, answer.token, answer.host)
    printed = step_output(answer.stderr, answer.token)
    clock: float | None = None
    failures: list[StepFailed] = []
    fatal: StepFailed | None = None
    for f in head:
        fields = f.fields()
        n = number(fields[0], 9) if fields else None
        if f.kind == "now" and fields:
            clock = float(fields[0]) if _CLOCK.fullmatch(fields[0]) else clock
        elif f.kind == "fail" and n is not None and n < steps and len(fields) >= 2:
            last = [x for x in printed.get(n, []) if x.strip()][-SOFT_LINES:]
            failures.append(StepFailed(n, status_of(fields[1]), redact.clip("\n".join(last).strip(), MESSAGE_MAX)))
        elif f.kind == "fatal" and n is not None and n < steps and len(fields) >= 2:
            fatal = StepFailed(n, status_of(fields[1]), redact.clip("\n".join(printed.get(n, [])).strip(), MESSAGE_MAX))
    return ApplyAnswer(clock, tuple(failures), fatal, parse_show(shown) if mark and end else None)
