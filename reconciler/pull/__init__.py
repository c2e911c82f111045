"""Pull mode: a host reconciles itself from git, with no controller (`reconcile pull`). What it
does, and its limits: docs/pull.md.

    schedule.py   PURE: which wave a host is in, which revision it may deploy, the reports
    _git.py       the clone, the branch's history, the notes (pygit2)
    _run.py       one run: fetch, choose, report, reconcile, report, record
    _units.py     the systemd service, timer and path unit (`--install`, `--uninstall`)
"""

from ._run import DEFAULT_DIR, PullOptions, PullOutcome, pull_once, this_host
from ._units import install, render_units, uninstall

__all__ = ["DEFAULT_DIR", "PullOptions", "PullOutcome", "install", "pull_once", "render_units", "this_host",
           "uninstall"]
