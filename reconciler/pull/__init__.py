"""Pull mode: a host reconciles itself from git, with no controller (`reconcile pull`).

git is the distribution engine: each host keeps a clone of the desired-state repo, fetches it on
a timer (or at once, through a path unit, when the repo is on the host), and converges itself
with the same planner, pre-flight, health watch, rollback, quarantine and records as a
controller's run (loop.fleet.run_fleet over a LocalTransport, this host only). Rollout waves come
from the hosts' labels and fleet.toml [pull] waves (schedule.py); hosts of early waves leave
their verdicts in the repo as git notes for the later ones. README "Pull mode" says it all, with
its limits.

    schedule.py   PURE: which wave a host is in, which revision it may deploy, the reports
    _git.py       the clone, the branch's history, the notes (pygit2)
    _run.py       one run: fetch, choose, report, reconcile, report, record
    _units.py     the systemd service, timer and path unit (`--install`, `--uninstall`)
"""

from ._run import DEFAULT_DIR, PullOptions, PullOutcome, pull_once, this_host
from ._units import install, render_units, uninstall

__all__ = ["DEFAULT_DIR", "PullOptions", "PullOutcome", "install", "pull_once", "render_units", "this_host",
           "uninstall"]
