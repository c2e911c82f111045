"""`reconcile pull`: a host reconciles itself from its clone of the desired-state repo (pull
mode: no controller; rollout waves from fleet.toml [pull]), and `--install` makes that a timer."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..errors import ConfigError, SourceError
from .output import console, fail, fail_input, print_json, run_async, say

if TYPE_CHECKING:
    from ..pull import PullOptions

PATH = click.Path(path_type=Path)


@click.command()
@click.option("--repo", default=".", envvar="RECONCILER_REPO", metavar="PATH|URL",
              help="Desired-state repo: a local path (clone or bare) or a URL.")
@click.option("--rev", metavar="REV", help="Revision to deploy (default: HEAD of the branch).")
@click.option("--path", default="", envvar="RECONCILER_PATH", metavar="DIR",
              help="Sub-directory of the repo that holds fleet.toml and hosts/.")
@click.option("--host", "-H", metavar="NAME", help="This host's name in hosts/ (default: its hostname).")
@click.option("--dir", "workdir", type=PATH, envvar="RECONCILER_PULL_DIR", metavar="DIR",
              help="Where a URL repo is mirrored (default /var/lib/reconciler/pull).")
@click.option("--dry-run", "-n", is_flag=True,
              help="Show what this host would deploy, and the diff; change and report nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--retry", is_flag=True, help="Re-apply quarantined (failed) service versions once more.")
@click.option("--allow-rewind", is_flag=True, help="Deploy a revision that does not descend from the one this host "
                                                   "records as applied.")
@click.option("--lock-wait", type=click.FloatRange(min=0), default=30.0, metavar="SECONDS",
              help="How long to wait for another run's lock on this host.")
@click.option("--publish/--no-publish", default=True,
              help="Leave this host's verdicts in the repo as git notes for the later waves "
                   "(refs/notes/reconciler-pull/<host>; only hosts of a wave that is not the last write them).")
@click.option("--age-identity", envvar="RECONCILER_AGE_IDENTITY", metavar="KEYFILE",
              help="An age identity on this host that decrypts the repo's age secrets (without one, a service "
                   "that has some is blocked).")
@click.option("--state-dir", type=PATH, envvar="RECONCILER_STATE_DIR", metavar="DIR",
              help="Where the state store lives (default ~/.local/state/reconciler).")
@click.option("--install", is_flag=True, help="Install and start reconciler-pull.service and .timer (and .path for "
                                              "a repo on this host), which run this command with these options.")
@click.option("--uninstall", is_flag=True, help="Stop and remove those units.")
@click.option("--interval", default="60s", metavar="DURATION",
              help="With --install: how often the timer runs it (30s, 5m, 1h).")
@click.option("--splay", metavar="DURATION", help="With --install: a random extra delay before each run, up to this "
                                                  "(default: a tenth of the interval; spreads a large fleet's "
                                                  "fetches).")
def pull(repo: str, rev: str | None, path: str, host: str | None, workdir: Path | None, dry_run: bool,
         as_json: bool, retry: bool, allow_rewind: bool, lock_wait: float, publish: bool, age_identity: str | None,
         state_dir: Path | None, install: bool, uninstall: bool, interval: str, splay: str | None) -> None:
    """Reconcile this host against itself from its clone of the desired-state repo (pull mode: no
    controller; rollout waves from fleet.toml [pull]). Run it on the host, as root."""
    from .. import pull as pull_mode
    if install and uninstall:
        fail("--install and --uninstall: choose one")
    if uninstall:
        try:
            for line in pull_mode.uninstall():
                say(line)
        except OSError as e:
            fail(str(e))
        return
    opts = pull_mode.PullOptions(repo=repo, rev=rev, path=path, host=host, workdir=workdir or pull_mode.DEFAULT_DIR,
                                 age_identity=age_identity, retry=retry, allow_rewind=allow_rewind,
                                 lock_wait=lock_wait, dry_run=dry_run, publish=publish)
    if install:
        _pull_install(opts, interval, splay, state_dir)
        return
    _pull_run(opts, as_json, state_dir)


def _pull_run(opts: PullOptions, as_json: bool, state_dir: Path | None) -> None:
    """Run `reconcile pull` until a local repo's branch stops moving under it (at most 3 runs);
    print each run, record it in the state store, exit with the last run's code."""

    from ..loop.report import PhaseView, print_result
    from ..pull import PullOutcome, pull_once
    out = console()

    def chosen(outcome: PullOutcome) -> None:
        if as_json:
            return
        c = outcome.choice
        wave = f" (wave {outcome.wave})" if outcome.wave else ""
        say(f"pull {outcome.host}{wave}: head {outcome.head[:7]}, reconciling "
             f"{c.revision[:7] if c.revision else 'nothing'}: {c.why}")
        for skip in c.skipped[:3]:
            say(f"  not {skip.revision[:7]}: {skip.why}")
        if len(c.skipped) > 3:
            say(f"  ... and {len(c.skipped) - 3} older commits")

    outcome = None
    for _ in range(3):
        try:
            with PhaseView(console(stderr=True), plans=None if as_json or opts.dry_run else out) as view:
                outcome = run_async(pull_once(opts, on_phase=view, on_choice=chosen))
        except (ConfigError, SourceError) as e:
            fail_input(e, as_json, f"{opts.repo}@{opts.rev or 'HEAD'}")
            return
        if outcome.result is not None and not opts.dry_run:
            from ..controller.store import Store, remember
            store = Store(state_dir)
            remember(store, outcome.result)
            store.close()
        if as_json:
            print_json(outcome.to_json())
        else:
            if outcome.result is not None:
                print_result(out, outcome.result, shown=view.shown)
            for line in outcome.reported:
                say(f"reported {line}")
            for w in outcome.warnings:
                say(f"warning: {w}")
        if not outcome.moved:
            break
        say("the branch moved during the run: running again")
    raise SystemExit(outcome.exit_code() if outcome is not None else 1)


def _pull_install(opts: PullOptions, interval: str, splay: str | None, state_dir: Path | None) -> None:
    """`reconcile pull --install`: check that the repo and this host resolve, then write and enable
    the units that run the same command, and say what was installed."""
    from ..desired import source
    from ..desired.load import load_desired
    from ..desired.schema import parse_duration
    from ..pull import DEFAULT_DIR, install, render_units, this_host
    from ..pull._git import branch_dir, open_clone
    every = parse_duration(interval)
    if every is None or every <= 0:
        fail(f"--interval {interval!r}: expected a duration > 0 like 60s, 5m or 1h")
    spread = parse_duration(splay) if splay is not None else every / 10
    if spread is None:
        fail(f"--splay {splay!r}: expected a duration like 5s or 2m")
    repo = opts.repo if source.is_url(opts.repo) else str(Path(opts.repo).resolve())
    from ..redact import looks_secret
    if source.is_url(repo) and looks_secret(repo):
        # the URL would be in the unit file and in `systemctl show`, which every local user reads
        fail("--repo: the URL carries a password or token; it would be readable by every local user in the "
              "unit file. Give the host a read-only deploy key or a git credential helper instead")
    try:
        clone = open_clone(repo, opts.workdir)
        state = load_desired(source.snapshot(clone, opts.rev, opts.path))
        name = this_host(state, opts.host)
    except (ConfigError, SourceError) as e:
        fail_input(e, False, f"{repo}@{opts.rev or 'HEAD'}")
        return
    argv = [sys.executable, "-m", "reconciler", "pull", "--repo", repo, "--host", name]
    # the unit runs in /: paths as absolute ones
    for flag, value in (("--rev", opts.rev), ("--path", opts.path),
                        ("--age-identity", str(Path(opts.age_identity).resolve()) if opts.age_identity else None),
                        ("--state-dir", str(state_dir.resolve()) if state_dir else None)):
        if value:
            argv += [flag, value]
    if opts.workdir != DEFAULT_DIR:
        argv += ["--dir", str(opts.workdir.resolve())]
    if opts.lock_wait != 30.0:
        argv += ["--lock-wait", f"{opts.lock_wait:g}"]
    if not opts.publish:
        argv.append("--no-publish")
    watch = None if source.is_url(repo) else branch_dir(clone, opts.rev)
    units = render_units(argv, interval=every, splay=spread, watch=watch)
    try:
        lines = install(units)
    except OSError as e:
        fail(str(e))
    say(f"pull mode for {name} from {repo}:")
    say(f"  runs: {' '.join(argv)}")
    say(f"  every {interval} (plus up to {spread:g}s at random) and soon after boot"
         + (f"; at once when {watch} changes" if watch else ""))
    for line in lines:
        say(f"  {line}")
