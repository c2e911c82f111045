"""The `reconcile` run: build the run's options, open the revision, call the one fleet run
(`loop.fleet.run_fleet`), record, print, exit with the run's code."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from .. import redact
from ..errors import ConfigError, SourceError
from ..loop.options import RunIO, RunOptions
from .output import console, escape, fail, fail_input, print_json, run_async, say

if TYPE_CHECKING:
    from ..desired.source import Snapshot
    from ..loop.revision import Revision


def opened(opts: RunOptions, as_json: bool) -> tuple[Snapshot, Revision]:
    """The revision the options name, opened for a run; bad input exits 1 naming file and key."""
    from ..loop.fleet import selected
    from ..loop.revision import load_revision
    try:
        snap, rev = load_revision(opts)
        selected(rev.state, opts)          # a --host or --label that matches nothing: before any host
    except (ConfigError, SourceError) as e:
        fail_input(e, as_json, f"{opts.repo}@{opts.rev or 'HEAD'}")
    return snap, rev


def converge(opts: RunOptions, *, as_json: bool = False, state_dir: Path | None = None,
             notes: bool = False) -> NoReturn:
    """Converge every host to the desired state at a revision (or preview it with --dry-run);
    exits with the run's code.

    A one-shot run collects young cycles after 20,000 allocations rather than 700: a 10-host env
    change took about 40 ms less CPU in alternated runs (the daemon keeps the default)."""
    import gc
    gc.set_threshold(20_000, 20, 20)
    from ..desired import source
    if notes and source.is_url(opts.repo):
        fail(f"--notes writes to a local repo; {redact.redact(opts.repo)} is a URL (its local mirror is a cache "
             f"that nobody reads). Run it on a clone and push refs/notes/reconciler")
    snap, rev = opened(opts, as_json)
    from ..controller.store import Store, expect_changes, remember, remember_in_sync
    from ..loop.fleet import run_fleet, selected
    from ..loop.report import PhaseView, print_result
    from ..preflight import secret_warnings
    # Which hosts this run is expected to change (store.expect_changes): they are locked at once.
    store = None if opts.dry_run else Store(state_dir)
    expect = expect_changes(store.in_sync(), rev.revision, selected(rev.state, opts)) if store is not None \
        else frozenset()
    out = console()
    for w in secret_warnings(rev.state, snap.read):
        console(stderr=True).print(f"[yellow]{escape(w)}[/]", soft_wrap=True)
    with PhaseView(console(stderr=True), plans=None if as_json or opts.dry_run else out) as view:
        io = RunIO(on_phase=view, on_planned=view.planned, expect_changes=expect)
        result = run_async(run_fleet(rev, opts, io))
    if store is not None:
        remember(store, result)
        remember_in_sync(store, result)
        store.close()
        if notes:
            from ..controller.gitnotes import NotesError, record_run
            try:
                record_run(snap.repo, result)
            except NotesError as e:
                say(f"warning: deploy notes not written: {e}")
    if as_json:
        print_json(result.to_json())
    else:
        print_result(out, result, shown=view.shown)
    raise SystemExit(result.exit_code())
