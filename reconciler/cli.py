"""The `reconcile` command: parse arguments, call the library, print, set the exit code.

Exit codes: 0 converged / in sync; 1 bad input or internal error (nothing applied);
2 --dry-run found changes; 3 a host was rolled back (reserved); 4 at least one host failed.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import typer
from rich.console import Console

from . import load, source
from .errors import ConfigError, SourceError
from .fleet import reconcile_fleet, select_hosts
from .load import render_at
from .preflight import check_desired, load_rules
from .reconcile import ssh_connector
from .report import PhaseView, print_config_error, print_history, print_result, print_status
from .status import Store, remember
from .trust import descends

app = typer.Typer(add_completion=False, no_args_is_help=False,
                  help="GitOps for bare-metal GPU hosts: converge systemd model servers to a git revision.")

RepoOpt = typer.Option(".", "--repo", envvar="RECONCILER_REPO",
                       help="Desired-state repo: a local path (clone or bare) or a URL.")
RevOpt = typer.Option(None, "--rev", help="Revision to deploy (default: HEAD of the branch).")
PathOpt = typer.Option("", "--path", envvar="RECONCILER_PATH",
                       help="Sub-directory of the repo that holds fleet.toml and hosts/.")
JsonOpt = typer.Option(False, "--json", help="Machine-readable output.")
CacheOpt = typer.Option(None, "--cache-dir", envvar="RECONCILER_CACHE_DIR", help="Where URL repos are mirrored.")
StateOpt = typer.Option(None, "--state-dir", envvar="RECONCILER_STATE_DIR",
                        help="Where the state store lives (default ~/.local/state/reconciler).")


def _console(stderr: bool = False) -> Console:
    """Rich on a terminal; plain text at least 160 columns wide in logs, pipes and CI (no
    mid-line wrapping of diffs and journal lines)."""
    c = Console(highlight=False, stderr=stderr)
    if not c.is_terminal and "COLUMNS" not in os.environ:
        c = Console(highlight=False, stderr=stderr, width=160)
    return c


def _load(repo: str, rev: str | None, path: str, cache_dir: Path | None):
    r = source.open_repo(repo, cache_dir)
    snap = source.snapshot(r, rev, path)
    return snap, load.load_desired(snap)


def _fail_input(err: Exception, as_json: bool, where: str) -> None:
    if as_json:
        payload: dict = {"error": type(err).__name__, "message": str(err)}
        if isinstance(err, ConfigError):
            payload["problems"] = [p.__dict__ for p in err.problems]
        print(json.dumps(payload, indent=2))
    elif isinstance(err, ConfigError):
        print_config_error(_console(stderr=True), err, where)
    else:
        _console(stderr=True).print(f"[bold red]error:[/] {err}")
    raise typer.Exit(1)


@app.callback(invoke_without_command=True)
def main_cmd(
    ctx: typer.Context,
    repo: str = RepoOpt,
    rev: str | None = RevOpt,
    path: str = PathOpt,
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="Show diffs and actions; change nothing."),
    as_json: bool = JsonOpt,
    identity: str | None = typer.Option(None, "--identity", "-i", envvar="RECONCILER_IDENTITY",
                                           help="SSH private key (default: ~/.ssh defaults)."),
    concurrency: int | None = typer.Option(None, "--concurrency", min=1,
                                           help="Hosts at once (default: fleet.toml, 20)."),
    host: list[str] | None = typer.Option(None, "--host", "-H", help="Only these hosts (repeatable)."),
    label: list[str] | None = typer.Option(None, "--label", "-l", metavar="KEY=VALUE",
                                              help="Only hosts with this label (repeatable: all must match)."),
    retry: bool = typer.Option(False, "--retry", help="Re-apply quarantined (failed) service versions once more."),
    allow_rewind: bool = typer.Option(False, "--allow-rewind",
                                      help="Deploy a revision that does not descend from the one a host records "
                                           "as applied (an older commit, another repo)."),
    lock_wait: float = typer.Option(30.0, "--lock-wait", min=0, metavar="SECONDS",
                                    help="How long to wait for another run's lock on a host before reporting it "
                                         "Locked (exit 4)."),
    cache_dir: Path | None = CacheOpt,
    state_dir: Path | None = StateOpt,
) -> None:
    """Converge every host to the desired state at a revision (or preview it with --dry-run)."""
    if ctx.invoked_subcommand is not None:
        return
    where = f"{repo}@{rev or 'HEAD'}"
    try:
        snap, state = _load(repo, rev, path, cache_dir)
        rules = load_rules(snap)
    except (ConfigError, SourceError) as e:
        _fail_input(e, as_json, where)
        return
    try:
        selected = select_hosts(state, host, label)
    except SourceError as e:
        _fail_input(e, as_json, where)
        return
    console = _console()
    with PhaseView(_console(stderr=True)) as view:
        result = asyncio.run(reconcile_fleet(state, ssh_connector(identity), dry_run=dry_run,
                                             concurrency=concurrency, hosts=selected,
                                             render_at=render_at(snap), retry=retry, on_phase=view,
                                             rules=rules, lock_wait=lock_wait, descends=descends(snap.repo),
                                             allow_rewind=allow_rewind))
    if not dry_run:
        store = Store(state_dir)
        remember(store, result)
        store.close()
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print_result(console, result)
    raise typer.Exit(result.exit_code())


@app.command()
def validate(repo: str = RepoOpt, rev: str | None = RevOpt, path: str = PathOpt,
             as_json: bool = JsonOpt, cache_dir: Path | None = CacheOpt) -> None:
    """Check the desired state at a revision without contacting any host (exit 0 or 1)."""
    try:
        snap, state = _load(repo, rev, path, cache_dir)
        problems, warnings = check_desired(state, load_rules(snap))
        if problems:
            raise ConfigError(problems)
    except (ConfigError, SourceError) as e:
        _fail_input(e, as_json, f"{repo}@{rev or 'HEAD'}")
        return
    for w in warnings:
        Console(stderr=True, highlight=False).print(w)
    n_svc = sum(len(h.services) for h in state.hosts.values())
    if as_json:
        print(json.dumps({"revision": snap.revision, "valid": True, "hosts": len(state.hosts), "services": n_svc}))
    else:
        _console().print(f"{snap.short}: valid ({len(state.hosts)} hosts, {n_svc} services)")


@app.command()
def status(as_json: bool = JsonOpt, state_dir: Path | None = StateOpt) -> None:
    """The fleet at a glance: host, service, desired and running revision, health, last event."""
    store = Store(state_dir)
    rows = store.status()
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        print_status(_console(), rows)


@app.command()
def history(host: str = typer.Argument(..., help="Host name."), as_json: bool = JsonOpt,
            state_dir: Path | None = StateOpt,
            limit: int = typer.Option(50, "--limit", min=1)) -> None:
    """Every attempt on one host, newest first: revision, result, reason, journal line, duration."""
    rows = Store(state_dir).history(host, limit)
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        print_history(_console(), host, rows)


@app.command()
def watch(
    config: Path | None = typer.Option(None, "--config", help="Controller config (default /etc/reconciler/config.toml "
                                          "or $RECONCILER_CONFIG); RECONCILER_<KEY> env vars override it."),
    repo: str | None = typer.Option(None, "--repo", help="Override config: the desired-state repo."),
    branch: str | None = typer.Option(None, "--branch", help="Override config: the deploy branch."),
    interval: float | None = typer.Option(None, "--interval", help="Seconds between periodic runs."),
    identity: str | None = typer.Option(None, "--identity", "-i"),
    state_dir: Path | None = typer.Option(None, "--state-dir"),
    metrics: str | None = typer.Option(None, "--metrics", help="host:port of the Prometheus endpoint, '' = off."),
) -> None:
    """Run as a daemon: reconcile on every push (within a second), every interval, and on trigger."""
    from .config import load_config
    from .daemon import Daemon
    try:
        cfg = load_config(config)
    except ConfigError as e:
        _fail_input(e, False, str(config or "config"))
        return
    overrides = {k: v for k, v in dict(repo=repo, branch=branch, identity=identity,
                                       state_dir=str(state_dir) if state_dir else None, metrics=metrics).items()
                 if v is not None}
    cfg = cfg.model_copy(update=overrides)
    asyncio.run(Daemon(cfg, interval=interval).serve())


@app.command("init-repo")
def init_repo_cmd(
    path: Path = typer.Argument(..., help="Where to create the bare deploy repo."),
    branch: str = typer.Option("main", "--branch"),
    state_dir: Path | None = typer.Option(None, "--state-dir", envvar="RECONCILER_STATE_DIR",
                                             help="The daemon's state dir, for streaming results to the pusher."),
    stream: bool = typer.Option(False, "--stream", help="Always stream the deploy's outcome to the pusher."),
    shared: str | None = typer.Option(None, "--shared", metavar="GROUP",
                                      help="Share the repo with GROUP (the pushing users and the daemon): "
                                           "group-writable, setgid, core.sharedRepository=group; as root also "
                                           "marked safe.directory in the system git config."),
    owner: str | None = typer.Option(None, "--owner", metavar="USER", help="With --shared, as root: chown to USER."),
) -> None:
    """Create a bare repo with the pre-receive (validate) and post-receive (deploy) hooks installed."""
    from .hooks import init_repo
    if path.exists() and any(path.iterdir()):
        Console(stderr=True).print(f"[bold red]error:[/] {path} exists and is not empty")
        raise typer.Exit(1)
    try:
        notes = init_repo(path, branch=branch, state_dir=str(state_dir.resolve()) if state_dir else None,
                          stream=stream, group=shared, owner=owner)
    except (KeyError, PermissionError) as e:     # no such group/user, or not root for chown
        Console(stderr=True).print(f"[bold red]error:[/] {path}: cannot share with {shared!r}"
                                   f"{f' owned by {owner!r}' if owner else ''}: {e}")
        raise typer.Exit(1) from None
    out = _console()
    out.print(f"bare deploy repo at {path} (branch {branch}); hooks installed.")
    for n in notes:
        out.print(f"  {n}")
    out.print(f"  git remote add deploy {path.resolve()}\n  git push deploy {branch}")


def main() -> None:
    """Entry point of the `reconcile` console script."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
