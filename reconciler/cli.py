"""The `reconcile` command: parse arguments, call the library, print, set the exit code.

Exit codes: 0 converged / in sync; 1 bad input or internal error (nothing applied);
2 --dry-run found changes; 3 a host was rolled back (reserved); 4 at least one host failed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from . import load, source
from .errors import ConfigError, SourceError
from .reconcile import reconcile_fleet, ssh_connector
from .report import print_config_error, print_result

app = typer.Typer(add_completion=False, no_args_is_help=False,
                  help="GitOps for bare-metal GPU hosts: converge systemd model servers to a git revision.")

RepoOpt = typer.Option(".", "--repo", envvar="RECONCILER_REPO",
                       help="Desired-state repo: a local path (clone or bare) or a URL.")
RevOpt = typer.Option(None, "--rev", help="Revision to deploy (default: HEAD of the branch).")
PathOpt = typer.Option("", "--path", envvar="RECONCILER_PATH",
                       help="Sub-directory of the repo that holds fleet.toml and hosts/.")
JsonOpt = typer.Option(False, "--json", help="Machine-readable output.")
CacheOpt = typer.Option(None, "--cache-dir", envvar="RECONCILER_CACHE_DIR", help="Where URL repos are mirrored.")


def _console() -> Console:
    return Console(highlight=False)


def _load(repo: str, rev: str | None, path: str, cache_dir: Optional[Path]):
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
        print_config_error(Console(stderr=True, highlight=False), err, where)
    else:
        Console(stderr=True, highlight=False).print(f"[bold red]error:[/] {err}")
    raise typer.Exit(1)


@app.callback(invoke_without_command=True)
def main_cmd(
    ctx: typer.Context,
    repo: str = RepoOpt,
    rev: Optional[str] = RevOpt,
    path: str = PathOpt,
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="Show diffs and actions; change nothing."),
    as_json: bool = JsonOpt,
    identity: Optional[str] = typer.Option(None, "--identity", "-i", envvar="RECONCILER_IDENTITY",
                                           help="SSH private key (default: ~/.ssh defaults)."),
    concurrency: Optional[int] = typer.Option(None, "--concurrency", min=1, help="Hosts at once (default: fleet.toml, 20)."),
    host: Optional[list[str]] = typer.Option(None, "--host", "-H", help="Only these hosts (repeatable)."),
    cache_dir: Optional[Path] = CacheOpt,
) -> None:
    """Converge every host to the desired state at a revision (or preview it with --dry-run)."""
    if ctx.invoked_subcommand is not None:
        return
    where = f"{repo}@{rev or 'HEAD'}"
    try:
        snap, state = _load(repo, rev, path, cache_dir)
    except (ConfigError, SourceError) as e:
        _fail_input(e, as_json, where)
        return
    unknown = sorted(set(host or []) - set(state.hosts))
    if unknown:
        _fail_input(SourceError(f"unknown host(s) {', '.join(unknown)} at {snap.short} "
                                f"(known: {', '.join(sorted(state.hosts))})"), as_json, where)
    result = asyncio.run(reconcile_fleet(state, ssh_connector(identity), dry_run=dry_run,
                                         concurrency=concurrency, hosts=host or None))
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print_result(_console(), result)
    raise typer.Exit(result.exit_code())


@app.command()
def validate(repo: str = RepoOpt, rev: Optional[str] = RevOpt, path: str = PathOpt,
             as_json: bool = JsonOpt, cache_dir: Optional[Path] = CacheOpt) -> None:
    """Check the desired state at a revision without contacting any host (exit 0 or 1)."""
    try:
        snap, state = _load(repo, rev, path, cache_dir)
    except (ConfigError, SourceError) as e:
        _fail_input(e, as_json, f"{repo}@{rev or 'HEAD'}")
        return
    n_svc = sum(len(h.services) for h in state.hosts.values())
    if as_json:
        print(json.dumps({"revision": snap.revision, "valid": True, "hosts": len(state.hosts), "services": n_svc}))
    else:
        _console().print(f"{snap.short}: valid ({len(state.hosts)} hosts, {n_svc} services)")


def main() -> None:
    """Entry point of the `reconcile` console script."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
