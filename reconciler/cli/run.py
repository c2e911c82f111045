"""The `reconcile` run: build the run's options, open the revision, call the one fleet run
(`loop.fleet.run_fleet`), record, print, exit with the run's code.

What may deploy (desired/trust.py TrustPolicy) comes from the flags (--require-signed,
--allowed-signers, --allow-insecure-transport) and, for a run as root on a host that has the
controller's config, from that config too: the stricter of both. So `reconcile --repo
/srv/git/fleet.git` as root on the control host deploys only what the daemon would.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from .. import redact
from ..desired.trust import RevisionRefused, TrustPolicy
from ..errors import ConfigError, SourceError
from ..loop.options import RunIO, RunOptions
from .output import console, escape, fail, fail_input, print_json, run_async, say

if TYPE_CHECKING:
    from ..desired.source import Snapshot
    from ..loop.results import FleetResult
    from ..loop.revision import Revision

CONFIG = "/etc/reconciler/config.toml"


def config_file() -> Path:
    """The controller's config as controller/config.py finds it ($RECONCILER_CONFIG, else
    /etc/reconciler/config.toml), named here so that a run on a host without one never imports
    the config's schema (pydantic)."""
    return Path(os.environ.get("RECONCILER_CONFIG") or CONFIG)


def trust_policy(require_signed: bool, allowed_signers: str | None, insecure_transport: bool, *,
                 as_json: bool = False, euid: int | None = None) -> TrustPolicy:
    """The run's trust policy: the flags', merged (the stricter of both) with the controller's
    config when run as root and the config exists; an invalid config exits 1 naming file and key."""
    signed = require_signed or allowed_signers is not None
    flags = TrustPolicy.of(require_signed=signed, allowed_signers=allowed_signers,
                           insecure_transport=insecure_transport,
                           origin="--allowed-signers" if allowed_signers else "--require-signed" if signed else "")
    path = config_file()
    if (os.geteuid() if euid is None else euid) != 0 or not path.exists():
        return flags
    from ..controller.config import load_config
    try:
        cfg = load_config(path)
    except ConfigError as e:
        fail_input(e, as_json, str(path))
    return flags.merged(cfg.trust_policy(f"{path} (a run as root)"))


def refused(e: RevisionRefused, as_json: bool) -> NoReturn:
    """The trust policy refused the revision (or the repo's URL): one line, or --json; exit 1."""
    if as_json:
        print_json({"error": "RevisionRefused", "reason": e.reason, "message": str(e)})
        raise SystemExit(1)
    fail(f"refused ({e.reason}): {e}")


def opened(opts: RunOptions, as_json: bool) -> tuple[Snapshot, Revision]:
    """The revision the options name, opened for a run (verified under the run's trust policy);
    bad input exits 1 naming file and key, a refused revision exits 1 saying why."""
    from ..loop.fleet import selected
    from ..loop.revision import load_revision
    try:
        snap, rev = load_revision(opts)
        selected(rev.state, opts)          # a --host or --label that matches nothing: before any host
    except (ConfigError, SourceError) as e:
        fail_input(e, as_json, f"{opts.repo}@{opts.rev or 'HEAD'}")
    except RevisionRefused as e:
        refused(e, as_json)
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
             f"that nobody reads). Run it on a local clone; the deploy repo's pre-receive hook takes "
             f"refs/notes/reconciler* only from the users in notes_pushers of the controller's config")
    try:
        opts.trust.check_url(opts.repo)      # before anything is fetched
    except RevisionRefused as e:
        refused(e, as_json)
    snap, rev = opened(opts, as_json)
    if rev.signer is not None:
        say(f"{snap.short}: signed by {rev.signer}")
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
    for r, why in rev.refused.items():       # rollback targets the trust policy refused
        say(f"refused to roll back to {r[:7]}: {why}")
    doc = result.to_json()
    engine = engine_check_said(opts, rev, result)
    if engine is not None:
        doc["engine_check"] = engine
    if as_json:
        print_json(doc)
    else:
        if engine is not None:
            out.print(escape(str(engine["line"])), soft_wrap=True, highlight=False)
        print_result(out, result, shown=view.shown)
    raise SystemExit(result.exit_code())


def engine_check_said(opts: RunOptions, rev: Revision, result: FleetResult) -> dict[str, object] | None:
    """What a dry run says about the engine check (options.engine_check), where a service it
    would (re)start has one: whether it ran and why ("skipped: the revision is not signed;
    --engine-check runs it", "ran: signed by KEY", "ran: --engine-check"). None on a real run,
    and where no service has an engine check."""
    from ..loop.preview import engine_check
    services = sum(h.checked.engine_checks for h in result.hosts if h.checked is not None)
    if not opts.dry_run or not services:
        return None
    gate = engine_check(opts.dry_run, opts.engine_check, rev.signer)
    return {"ran": gate.run, "why": gate.why, "services": services, "line": gate.line()}
