"""How a command's process runs and leaves: the cyclic collector's threshold for a run's heap,
and, for a one-shot command, an exit without the interpreter's teardown.

The collector: a run allocates in bursts (every host's observation parsed, planned and
reported), and with CPython's default threshold (a young collection every 700 allocations more
than deallocations) a daemon's warm round of 300 hosts ran 39 collections, 60-240 ms of its
0.5 s of CPU, some of them full ones that walk every object the daemon keeps (its connections,
the loaded state). `tune_gc` raises the young generation's threshold to GC_YOUNG: one
collection a round, 13-17 ms, and the round's CPU 0.41-0.46 s against 0.49-0.59 s (three
warm rounds each, 300 simulated hosts as bench/scale.py sets them up, 2026-12-04). Reference
cycles are still collected, only less often; memory held meanwhile is at most GC_YOUNG objects
more.

The start-up: what a one-shot command imports and loads before its first host (the command
tree, the run's modules, the revision) lives as long as the process, and is made with the
collector off and then frozen out of its collections (`starting`: gc.freeze, the documented way
to keep long-lived objects out of every later collection). With the default threshold, the
import of the command tree alone ran some 35 collections that each walked objects none of which
could be garbage; `reconcile` on one host took about 13 ms less CPU in alternated runs.

The exit: the `reconcile` and `reconcile-hook` console scripts end through `leave`. By the time a command
returns it has closed its connections, committed its store and printed its report; what
Python's finalization did after that (clearing some 340 modules and collecting their objects)
took 140-170 ms of CPU after the last line on a 2-core machine, a sixth of a one-host run, and a
push waits for its hooks. The contract: whatever a command opened is closed before it returns
(the state store's `close` commits; a run log is a `with` block). atexit handlers still run and
stdout and stderr are flushed.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading
from collections.abc import Iterator
from typing import NoReturn

GC_YOUNG = 20_000


def tune_gc() -> None:
    """The collector's young-generation threshold for a run's heap (see above); the older
    generations' as they are."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG, middle, old)


@contextlib.contextmanager
def starting() -> Iterator[None]:
    """A one-shot command's start: its modules imported and its revision loaded with the
    collector off (all of it lives as long as the process, so a collection would only walk it),
    then frozen out of every later collection (gc.freeze) and the collector on again, whatever
    happened meanwhile."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def leave(code: object) -> NoReturn:
    """Exit with `code` (as SystemExit takes it) without the interpreter's teardown; where
    another thread still runs, the ordinary way, which waits for it."""
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
