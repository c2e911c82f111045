"""The `reconcile` process: the collector tuned for a run's heap, and its exit status."""

from __future__ import annotations

import ast
import subprocess
import sys

from reconciler.process import GC_YOUNG


def test_the_command_runs_with_the_young_generation_threshold_raised_and_the_older_ones_kept():
    """`reconcile` (console) raises the collector's young threshold before the command runs; a
    library import leaves the interpreter's own."""
    probe = ("import gc, sys\n"
             "import reconciler.cli as c\n"
             "before = gc.get_threshold()\n"
             "c.main = lambda: print(before, gc.get_threshold(), flush=True)\n"
             "c.console()\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    default = subprocess.run([sys.executable, "-c", "import gc; print(gc.get_threshold())"], capture_output=True,
                             text=True, timeout=60, check=True).stdout.strip()
    before, after = out.stdout.strip().split(") (")
    assert before + ")" == default
    _, middle, old = ast.literal_eval(default)
    assert "(" + after == str((GC_YOUNG, middle, old))
