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


def test_starting_turns_the_collector_off_and_freezes_what_it_made_then_on_again_even_after_an_error():
    """process.starting: a one-shot command's start-up objects (modules, the loaded revision)
    live as long as the process, so they are made with the collector off and then frozen out of
    its collections; the collector is on again after the block, however it ended."""
    import gc

    from reconciler.process import starting
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        try:
            with starting():
                made = [[i] for i in range(1000)]
                assert not gc.isenabled()
                raise KeyError("a bad input exits the command from inside the block")
        except KeyError:
            pass
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen + len(made)
    finally:
        gc.unfreeze()


def test_the_reconcile_command_runs_with_its_command_tree_frozen_out_of_the_collections():
    """`python -m reconciler` and the `reconcile` script (reconciler.__main__:console) import the
    command tree inside process.starting: when the command runs, the collector is on and the
    modules it imported are frozen."""
    probe = ("import gc, sys\n"
             "import reconciler.__main__ as m\n"
             "import reconciler.process as p\n"
             "before = gc.get_freeze_count()\n"
             "def run():\n"
             "    print(before, gc.get_freeze_count(), gc.isenabled(), flush=True)\n"
             "import types\n"
             "sys.modules['reconciler.cli'] = types.SimpleNamespace(console=run)\n"
             "m.console()\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    before, after, enabled = out.stdout.split()
    assert before == "0" and int(after) > 0 and enabled == "True"
    script = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; print([e.value for e in "
                             "m.entry_points(group='console_scripts') if e.name == 'reconcile'])"],
                            capture_output=True, text=True, timeout=60, check=True)
    assert script.stdout.strip() == "['reconciler.__main__:console']"
