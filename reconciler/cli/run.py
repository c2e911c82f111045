"""The `reconcile` run: build the run's options, open the revision, call the one fleet run
(`loop.fleet.run_fleet`), record, print, exit with the run's code.

What may deploy (desired/trust.py TrustPolicy) comes from the flags (--require-signed,
--allowed-signers, --allow-insecure-transport) or the trust variables of the same names
(RECONCILER_REQUIRE_SIGNED, ...), and, for a run as root on a host that has the controller's
config, from that config too: the stricter of both; a variable that would loosen either, or
not take effect, is an error (controller/trustvars.py). So `reconcile --repo
/srv/git/fleet.git` as root on the control host deploys only what the daemon would.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from .. import redact
from ..desired.trust import TrustPolicy
from ..errors import ConfigError, Problem
from ..loop.options import RunIO, RunOptions
from ..process import starting
from .output import console, escape, exits_on_bad_input, fail, fail_input, print_json, run_async, say

if TYPE_CHECKING:
    from rich.console import Console

    from ..controller.store import Store
    from ..desired.source import Snapshot
    from ..loop.results import FleetResult
    from ..loop.revision import Revision

PATH = click.Path(path_type=Path)


# The options several commands share (click.option makes a new Option at each use).
repo_opt = click.option("--repo", default=".", envvar="RECONCILER_REPO", metavar="PATH|URL", show_envvar=False,
                        help="Desired-state repo: a local path (clone or bare) or a URL.")
rev_opt = click.option("--rev", metavar="REV", help="Revision to deploy (default: HEAD of the branch).")
path_opt = click.option("--path", default="", envvar="RECONCILER_PATH", metavar="DIR",
                        help="Sub-directory of the repo that holds fleet.toml and hosts/.")
json_opt = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
state_opt = click.option("--state-dir", type=PATH, envvar="RECONCILER_STATE_DIR", metavar="DIR",
                         help="Where the state store lives (default ~/.local/state/reconciler).")


def trust_policy(require_signed: bool, allowed_signers: str | None, insecure_transport: bool, *,
                 as_json: bool = False, euid: int | None = None, env: Mapping[str, str] | None = None) -> TrustPolicy:
    """The run's trust policy: the flags', with the trust variables of the environment as the
    flags of the same name (RECONCILER_REQUIRE_SIGNED=true is --require-signed), merged (the
    stricter of both) with the controller's config when run as root and the config exists. A
    variable that would loosen the flags or the config, or not take effect, exits 1 naming it
    (controller/trustvars.py); so does an invalid config, naming file and key."""
    from ..controller import trustvars
    env = os.environ if env is None else env
    found, bad = trustvars.read(env)
    flags = trustvars.TrustVars(require_signed or None, allowed_signers, insecure_transport or None)
    path = trustvars.config_path()
    cfg = file = None
    if (os.geteuid() if euid is None else euid) == 0 and path.exists():
        from ..controller.config import load_config
        try:
            cfg = load_config(path, environ={k: v for k, v in env.items() if k not in trustvars.NAMES})
        except ConfigError as e:
            fail_input(e, as_json, str(path))
        file = trustvars.TrustVars(cfg.require_signed, cfg.allowed_signers, cfg.allow_insecure_transport)
    bad += trustvars.problems(found, flags=flags, file=file, file_name=f"{path} (a run as root)")
    if bad:
        unusable_settings(bad, as_json)
    signers = allowed_signers or found.allowed_signers
    signed = require_signed or signers is not None or bool(found.require_signed)
    origin = " and ".join(o for o, on in (("--allowed-signers", allowed_signers), ("--require-signed", require_signed),
                                          (trustvars.SIGNERS, found.allowed_signers and not allowed_signers),
                                          (trustvars.REQUIRE, found.require_signed)) if on)
    mine = TrustPolicy.of(require_signed=signed, allowed_signers=signers,
                          insecure_transport=insecure_transport or bool(found.insecure_transport), origin=origin)
    return mine.merged(cfg.trust_policy(f"{path} (a run as root)")) if cfg is not None else mine


def unusable_settings(problems: list[Problem], as_json: bool) -> NoReturn:
    """Trust settings that may not stand (trustvars.problems): one line each, naming the variable
    or option, or --json; exit 1 before anything is fetched."""
    if as_json:
        print_json({"error": "ConfigError", "message": "; ".join(str(p) for p in problems),
                    "problems": [p.data() for p in problems]})
        raise SystemExit(1)
    for p in problems[:-1]:
        say(f"error: {p}")
    fail(str(problems[-1]))


def check_state_dirs(state_dir: Path | None, as_json: bool) -> None:
    """Refuse, before anything is fetched or run, a state directory that is not this user's alone
    (dirs.own_dir): the store's (--state-dir) and the caches' ($RECONCILER_STATE_DIR, else the
    user's; docs/usage.md says why). Exit 1, one line naming it and the fix."""
    from ..dirs import UnsafePath, default_state_dir, own_dir
    try:
        for d in dict.fromkeys((state_dir or default_state_dir(), default_state_dir())):
            own_dir(d)
    except UnsafePath as e:
        fail_input(e, as_json, str(state_dir or default_state_dir()))


def opened(opts: RunOptions, as_json: bool) -> tuple[Snapshot, Revision]:
    """The revision the options name, opened for a run (verified under the run's trust policy);
    bad input and a refused revision exit 1 (exits_on_bad_input)."""
    from ..loop.fleet import selected
    from ..loop.revision import load_revision
    with exits_on_bad_input(as_json, f"{opts.repo}@{opts.rev or 'HEAD'}"):
        snap, rev = load_revision(opts)
        selected(rev.state, opts)          # a --host or --label that matches nothing: before any host
    return snap, rev


def converge(opts: RunOptions, *, as_json: bool = False, state_dir: Path | None = None,
             notes: bool = False) -> NoReturn:
    """Converge every host to the desired state at a revision (or preview it with --dry-run);
    exits with the run's code.

    A one-shot run collects young cycles after 20,000 allocations rather than 700: a 10-host env
    change took about 40 ms less CPU in alternated runs (the daemon keeps the default). What it
    imports and loads before the first host is made with the collector off, then frozen
    (process.starting)."""
    import gc
    gc.set_threshold(20_000, 20, 20)
    with starting():
        from ..controller.store import remember, remember_in_sync
        from ..loop.fleet import run_fleet
        from ..loop.report import PhaseView, print_result
        snap, rev, store, expect, out = _start(opts, as_json, state_dir, notes)
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


def _start(opts: RunOptions, as_json: bool, state_dir: Path | None,
           notes: bool) -> tuple[Snapshot, Revision, Store | None, frozenset[str], Console]:
    """A run up to its first host: the checks of its input, the revision opened, the store and
    the hosts it is expected to change (store.expect_changes: they are locked at once), the
    secret warnings said."""
    from ..desired import source
    if notes and source.is_url(opts.repo):
        fail(f"--notes writes to a local repo; {redact.redact(opts.repo)} is a URL (its local mirror is a cache "
             f"that nobody reads). Run it on a local clone; the deploy repo's pre-receive hook takes "
             f"refs/notes/reconciler* only from the users in notes_pushers of the controller's config")
    check_state_dirs(state_dir, as_json)
    with exits_on_bad_input(as_json, opts.repo):
        opts.trust.check_url(opts.repo)      # before anything is fetched
    snap, rev = opened(opts, as_json)
    if rev.signer is not None:
        say(f"{snap.short}: signed by {rev.signer}")
    from ..controller.store import Store, expect_changes
    from ..loop.fleet import selected
    from ..preflight import secret_warnings
    store = None if opts.dry_run else Store(state_dir)
    expect = expect_changes(store.in_sync(), rev.revision, selected(rev.state, opts)) if store is not None \
        else frozenset()
    out = console()
    for w in secret_warnings(rev.state, snap.read):
        console(stderr=True).print(f"[yellow]{escape(w)}[/]", soft_wrap=True)
    return snap, rev, store, expect, out


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
