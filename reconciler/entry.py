"""The `reconcile` console script and `python -m reconciler`.

The plain run, `reconcile [options]` (what a user, a git hook and the benchmarks start most),
is parsed here without typer: importing typer and building its command costs about 50 ms of
every run's start, a tenth of a no-change run on one host. Everything else goes to the typer
app in cli.py, unchanged: a sub-command, --help, an option this table does not know, a value it
cannot take (typer then prints the error). tests/test_entry.py keeps OPTIONS equal to the typer
command's options, and both parsers' results equal for the same arguments.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

# option -> (parameter of clicore.converge, kind, environment variable). Kinds: flag, str, int
# (>= 1), float (>= 0), path, list (repeatable).
OPTIONS: dict[str, tuple[str, str, str | None]] = {
    "--repo": ("repo", "str", "RECONCILER_REPO"),
    "--rev": ("rev", "str", None),
    "--path": ("path", "str", "RECONCILER_PATH"),
    "--dry-run": ("dry_run", "flag", None), "-n": ("dry_run", "flag", None),
    "--json": ("as_json", "flag", None),
    "--identity": ("identity", "str", "RECONCILER_IDENTITY"), "-i": ("identity", "str", "RECONCILER_IDENTITY"),
    "--concurrency": ("concurrency", "int", None),
    "--host": ("host", "list", None), "-H": ("host", "list", None),
    "--label": ("label", "list", None), "-l": ("label", "list", None),
    "--retry": ("retry", "flag", None),
    "--allow-rewind": ("allow_rewind", "flag", None),
    "--lock-wait": ("lock_wait", "float", None),
    "--age-identity": ("age_identity", "str", "RECONCILER_AGE_IDENTITY"),
    "--cache-dir": ("cache_dir", "path", "RECONCILER_CACHE_DIR"),
    "--state-dir": ("state_dir", "path", "RECONCILER_STATE_DIR"),
    "--notes": ("notes", "flag", None),
}
DEFAULTS: dict[str, Any] = {"repo": ".", "rev": None, "path": "", "dry_run": False, "as_json": False,
                            "identity": None, "concurrency": None, "host": None, "label": None, "retry": False,
                            "allow_rewind": False, "lock_wait": 30.0, "age_identity": None, "cache_dir": None,
                            "state_dir": None, "notes": False}


def _value(kind: str, text: str) -> Any:
    """The option's value, or ValueError where typer would refuse it (typer then says why)."""
    if kind == "int":
        n = int(text)
        if n < 1:
            raise ValueError(text)
        return n
    if kind == "float":
        f = float(text)
        if not f >= 0:
            raise ValueError(text)
        return f
    return Path(text) if kind == "path" else text


def parse(argv: Sequence[str], environ: Mapping[str, str]) -> dict[str, Any] | None:
    """converge()'s keyword arguments for a plain run, or None: anything else (typer's to parse)."""
    out: dict[str, Any] = {}
    lists: dict[str, list[str]] = {}
    args = list(argv)
    try:
        while args:
            arg = args.pop(0)
            name, eq, inline = arg.partition("=") if arg.startswith("--") else (arg, "", "")
            spec = OPTIONS.get(name)
            if spec is None:
                return None                 # a sub-command, --help, `--`, -nH...: typer's
            param, kind, _env = spec
            if kind == "flag":
                if eq:
                    return None
                out[param] = True
                continue
            if not eq:
                if not args or args[0].startswith("-"):
                    return None
                inline = args.pop(0)
            if kind == "list":
                lists.setdefault(param, []).append(inline)
            else:
                out[param] = _value(kind, inline)
    except ValueError:
        return None
    out.update(lists)
    for param, kind, env in OPTIONS.values():
        if param not in out and env and environ.get(env):
            out[param] = _value(kind, environ[env])
    return {**DEFAULTS, **out}


def main() -> None:
    """Entry point of `reconcile`: the plain run here, everything else through typer (cli.py).
    An unexpected error prints its traceback redacted (clicore.guarded), as cli.main's does."""
    kwargs = parse(sys.argv[1:], os.environ)
    if kwargs is None:
        from .cli import main as typer_main
        typer_main()
        return
    from .clicore import converge, guarded
    guarded(lambda: converge(**kwargs))


def console() -> NoReturn:
    """`reconcile` and `python -m reconciler`: main(), then leave() (no interpreter teardown).

    The cyclic garbage collector runs less often: a young collection after 20,000 allocations
    instead of 700 (the daemon too; cycles are still collected, a few MB later at most). A
    10-host env change took about 40 ms less CPU in alternated runs (1.13 s against 1.17 s;
    with no collection at all, 1.09 s). The dataclasses it imports compile their methods once
    (dccache)."""
    import gc
    gc.set_threshold(20_000, 20, 20)
    from . import dccache
    dccache.install()
    try:
        main()
    except SystemExit as e:
        leave(e.code)
    leave(0)


def leave(code: object) -> NoReturn:
    """Exit with `code` (as SystemExit takes it) without the interpreter's teardown.

    By the time a run returns it has closed its connections, committed its store and printed
    its report. What Python's finalization did after that (clearing some 340 modules and
    collecting their objects) took 140-170 ms of CPU after the last line on a 2-core machine:
    a sixth of a one-host run (the git hooks use it too). The atexit handlers still run
    (logging's flush among them), and stdout and stderr are flushed. Where another thread still
    runs, it exits the ordinary way, which waits for it."""
    import atexit
    import threading
    if isinstance(code, int) or code is None:
        status = code or 0
    else:
        print(code, file=sys.stderr)
        status = 1
    if threading.active_count() != 1:
        sys.exit(status)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a reader that went (a closed pipe): as Python's own exit
            status = status or 120
    os._exit(status)
