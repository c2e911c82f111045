"""One run's output in `reconcile watch`: said on the journal (stdout) and written to
<state_dir>/runs/<sha>.log at once, and the exit code in <sha>.exit when the run ends, for the
post-receive hook to stream to the pusher (hooks.py). All of it passes through redact first (the
values of the secrets decrypted with `age_identity`, and token-like patterns, are masked), and so
does the pusher's stream, which reads those files.

Who may read them is set here, never left to the process umask (the unit runs with UMask=0077):
the logs and exit files are group-readable (0640, runs/ 0750) so a pusher in the daemon's group
can stream them.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from types import TracebackType
from typing import IO, TextIO, cast

from rich.console import Console

from .. import redact

RUNS_DIR_MODE = 0o750       # group: pushers stream their deploy's log (post-receive hook)
RUN_FILE_MODE = 0o640
WIDTH = 160                 # the journal's and the log's line width


def runs_dir(state_dir: Path) -> Path:
    """<state_dir>/runs, made with its mode set (the pushers' group may list and read it)."""
    runs = state_dir / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    os.chmod(runs, RUNS_DIR_MODE)
    return runs


def open_run_file(path: Path, *, append: bool) -> TextIO:
    """Open a run log or exit file with its mode set explicitly (not from the umask). The
    caller closes it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), RUN_FILE_MODE)
    os.fchmod(fd, RUN_FILE_MODE)
    return open(fd, "a") if append else open(fd, "w")


def write_exit(runs: Path, revision: str, code: int) -> None:
    """<revision>.exit: the run of `revision` is over, with exit code `code` (the hook's stream ends)."""
    with open_run_file(runs / f"{revision}.exit", append=False) as f:
        f.write(f"{code}\n")


class _Tee(io.TextIOBase):
    """Write run output to stdout (the journal) and the run's log file at once, redacted."""

    def __init__(self, *files: IO[str]):
        self.files = files

    def write(self, s: str) -> int:
        text = redact.redact(s)
        for f in self.files:
            f.write(text)
            f.flush()
        return len(s)

    def flush(self) -> None:
        for f in self.files:
            f.flush()


def tee(*files: IO[str]) -> TextIO:
    """A _Tee typed as the file rich's Console asks for: Console only writes and flushes it."""
    return cast(TextIO, _Tee(*files))


class RunLog:
    """One run's output: the journal (`journal`, the daemon's console) from the start, and the
    revision's log once the run knows its revision (`start`). A context manager: the log is
    closed at its end, after the run's error handlers have written to it too."""

    def __init__(self, runs: Path, journal: Console):
        self.runs = runs
        self.journal = journal
        self.file: TextIO | None = None

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.file is not None:
            self.file.close()

    def start(self, revision: str) -> Console:
        """Open <revision>.log (appended to: each run of the revision adds its own) and return the
        console the run prints on: the journal and the log at once."""
        self.file = open_run_file(self.runs / f"{revision}.log", append=True)
        return Console(file=tee(self.journal.file, self.file), highlight=False, force_terminal=False, width=WIDTH)

    def console(self) -> Console:
        """A console on the journal and the log, if the run has one yet (for an error's report)."""
        return Console(file=tee(self.journal.file, *([self.file] if self.file else [])), highlight=False,
                       width=WIDTH)

    def say(self, line: str) -> None:
        """One line, redacted, on stdout and in the log (if the run has one yet)."""
        line = redact.redact(line)
        print(line, flush=True)
        if self.file is not None:
            self.file.write(line + "\n")
