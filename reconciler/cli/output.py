"""What every command prints, and how it fails: redacted consoles, --json, one-line errors.

Everything printed, to the terminal, as --json or in an error (a traceback included), goes
through redact: the values of the secrets the controller decrypted and token-like patterns are
masked. On a terminal rich lays the output out; written to a pipe, a log or CI it is plain text
(report.PlainConsole) and rich is not imported.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, NoReturn, TextIO, TypeVar, cast

from .. import redact
from ..desired.trust import RevisionRefused
from ..errors import ConfigError, SourceError

if TYPE_CHECKING:
    from rich.console import Console

_T = TypeVar("_T")


def run_async(coro: Coroutine[Any, Any, _T]) -> _T:
    """asyncio.run(coro), with the coroutine's result kept out of the main task: asyncio.run's
    SIGINT handler holds that task, and putting the default handler back at the end has the
    signal module format the handler it replaces, task and result included (the repr of a whole
    fleet's result, twice)."""
    import asyncio
    box: list[_T] = []

    async def main() -> None:
        box.append(await coro)
    asyncio.run(main())
    return box[0]


def escape(text: str) -> str:
    """rich's markup escape (rich is imported when something is printed on a terminal, not
    before), with control characters shown as escapes (`\x1b`): the text may come from a repo,
    a host or an error, and must not drive the terminal."""
    from ..loop.report import escape_markup
    return escape_markup(redact.escape_controls(text))


def console(stderr: bool = False) -> Console:
    """Rich on a terminal; plain text at least 160 columns wide in logs, pipes and CI (no
    mid-line wrapping of diffs and journal lines). Everything printed is redacted."""
    # A TextIO as rich types it: Console only writes, flushes and asks isatty/fileno.
    out = cast(TextIO, redact.RedactingWriter(sys.stderr if stderr else sys.stdout))
    from ..loop.report import PlainConsole, writes_plain
    if writes_plain(out):
        return cast("Console", PlainConsole(out, _width()))
    from rich.console import Console
    c = Console(highlight=False, file=out)
    if not c.is_terminal and "COLUMNS" not in os.environ:
        c = Console(highlight=False, file=out, width=160)
    return c


def _width() -> int:
    """A plain console's width (the result table's detail column): $COLUMNS, else 160."""
    try:
        return max(40, int(os.environ.get("COLUMNS", "")))
    except ValueError:
        return 160


def print_json(data: object) -> None:
    """--json output, redacted (every string before serializing, then the text once more)."""
    import json
    print(redact.redact(json.dumps(redact.redact_data(data), indent=2)))


def fail_input(err: Exception, as_json: bool, where: str) -> NoReturn:
    """Bad input (a config or source error): the problems, naming file and key; exit 1."""
    if as_json:
        payload: dict[str, object] = {"error": type(err).__name__, "message": str(err)}
        if isinstance(err, ConfigError):
            payload["problems"] = [p.data() for p in err.problems]
        print_json(payload)
    elif isinstance(err, ConfigError):
        from ..loop.report import print_config_error
        print_config_error(console(stderr=True), err, where)
    else:
        fail(str(err))
    raise SystemExit(1)


@contextlib.contextmanager
def exits_on_bad_input(as_json: bool, where: str) -> Iterator[None]:
    """Bad input (ConfigError, SourceError) exits 1 naming file and key (`where`: the repo and
    revision); a revision or URL the trust policy refused exits 1 saying why (one line, or --json)."""
    try:
        yield
    except (ConfigError, SourceError) as e:
        fail_input(e, as_json, where)
    except RevisionRefused as e:
        if as_json:
            print_json({"error": "RevisionRefused", "reason": e.reason, "message": str(e)})
            raise SystemExit(1) from None
        fail(f"refused ({e.reason}): {e}")


def say(text: str) -> None:
    """A plain line on stderr (no markup: `[services.m.secrets]` is text), redacted, control
    characters shown as escapes."""
    console(stderr=True).print(redact.escape_controls(text), markup=False, soft_wrap=True)


def fail(message: str) -> NoReturn:
    """One error line on stderr, never wrapped at the console's width (a log, CI, a hook reads it
    whole); exit 1."""
    console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise SystemExit(1)


def guarded(run: Callable[[], object]) -> None:
    """Run a command: Ctrl-C exits 130; a state directory or file that is not this user's alone
    (dirs.UnsafePath) is one line, exit 1; an unexpected error prints its traceback redacted and
    exits 1."""
    from ..dirs import UnsafePath
    try:
        run()
    except KeyboardInterrupt:
        sys.exit(130)
    except UnsafePath as e:           # the state directory (or a file in it) is not ours alone
        fail(str(e))
    except Exception:
        import traceback
        sys.stderr.write(redact.escape_controls(redact.redact(traceback.format_exc())))
        sys.exit(1)
