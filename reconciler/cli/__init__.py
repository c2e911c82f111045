"""The `reconcile` command: parse (click), build the run, call the library, print, exit.

`reconcile` and `python -m reconciler` start at `console`."""

from __future__ import annotations

from typing import NoReturn

from ..process import leave, tune_gc
from .app import app
from .output import guarded

__all__ = ["app", "console", "main"]


def main(argv: list[str] | None = None) -> None:
    """Run the command line; an unexpected error prints its traceback, redacted (output.guarded)."""
    guarded(lambda: app(args=argv, prog_name="reconcile"))


def console() -> NoReturn:
    """`reconcile` and `python -m reconciler`: main() with the collector tuned for a run's heap,
    then process.leave() (no interpreter teardown)."""
    tune_gc()
    try:
        main()
    except SystemExit as e:
        leave(e.code)
    leave(0)
