"""The `reconcile` command line (click): the run, and its sub-commands.

Exit codes: docs/usage.md, "Exit codes".

Each command imports what it uses when it runs: parsing the arguments (and --help) loads click
alone, and a run loads only what it needs (the SSH stack when it connects, the rule pack when
pre-flight runs, the web stack in `watch` only).
"""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import ConfigError, SourceError
from ..loop.options import RunOptions, confirm_margin_from
from .output import console, escape, fail, fail_input, print_json, run_async
from .pull import pull
from .run import PATH, converge, json_opt, opened, path_opt, repo_opt, rev_opt, state_opt, trust_policy
from .secrets import secrets as secrets_group

cache_opt = click.option("--cache-dir", type=PATH, envvar="RECONCILER_CACHE_DIR", metavar="DIR",
                         help="Where URL repos are mirrored.")
age_opt = click.option("--age-identity", envvar="RECONCILER_AGE_IDENTITY", metavar="KEYFILE",
                       help="The controller's age identity, to decrypt the repo's age secrets (needed only when "
                            "the desired state has some).")
identity_opt = click.option("--identity", "-i", envvar="RECONCILER_IDENTITY", metavar="KEYFILE",
                            help="SSH private key (default: ~/.ssh defaults).")
concurrency_opt = click.option("--concurrency", type=click.IntRange(min=1), metavar="N",
                               help="Hosts at once (default: fleet.toml, 20).")
lock_wait_opt = click.option("--lock-wait", type=click.FloatRange(min=0), default=30.0, metavar="SECONDS",
                             help="How long to wait for another run's lock on a host before reporting it Locked "
                                  "(exit 4).")


def hosts_opt(f):  # type: ignore[no-untyped-def]
    f = click.option("--label", "-l", multiple=True, metavar="KEY=VALUE",
                     help="Only hosts with this label (repeatable: all must match).")(f)
    return click.option("--host", "-H", multiple=True, metavar="NAME", help="Only these hosts (repeatable).")(f)


@click.group(invoke_without_command=True, context_settings={"max_content_width": 120},
             help="GitOps for bare-metal GPU hosts: converge systemd model servers to a git revision.\n\n"
                  "Without a command: converge every host to the desired state at a revision (or preview "
                  "it with --dry-run).")
@repo_opt
@rev_opt
@path_opt
@click.option("--dry-run", "-n", is_flag=True, help="Show diffs and actions; change nothing and run nothing of the "
                                                  "revision on a host (the engine check only with --engine-check, or "
                                                  "for a revision verified by --require-signed).")
@click.option("--engine-check", is_flag=True, help="With --dry-run: run the engine check of an unsigned revision too "
                                                   "(it starts the revision's interpreter on the hosts, isolated and "
                                                   "sandboxed: docs/engine-check.md).")
@json_opt
@identity_opt
@concurrency_opt
@hosts_opt
@click.option("--retry", is_flag=True, help="Re-apply quarantined (failed) service versions once more.")
@click.option("--allow-rewind", is_flag=True, help="Deploy a revision that does not descend from the one a host "
                                                   "records as applied (an older commit, another repo).")
@lock_wait_opt
@age_opt
@cache_opt
@state_opt
@click.option("--notes", is_flag=True, help="Record the outcome as git notes (refs/notes/reconciler) on the "
                                            "deployed commit in --repo, a local repo, as the daemon does on its "
                                            "deploy repo (not on a dry run).")
@click.option("--require-signed", is_flag=True, help="Deploy only a revision signed by a key in --allowed-signers "
                                                     "(default /etc/reconciler/allowed_signers); rollback targets too. "
                                                     "As root, require_signed in config.toml applies as well.")
@click.option("--allowed-signers", metavar="FILE", help="An ssh allowed_signers file (ssh-keygen -Y verify); implies "
                                                        "--require-signed.")
@click.option("--allow-insecure-transport", is_flag=True, help="Fetch a URL over http:// or git:// (plaintext: "
                                                               "whoever is on the path chooses what deploys).")
@click.option("--drain-program", multiple=True, metavar="PROGRAM",
              help="A program a service's [drain] `controller` call may run here (repeatable; the daemon: "
                   "drain_programs in config.toml). The repo alone never names a program the controller runs.")
@click.pass_context
def app(ctx: click.Context, repo: str, rev: str | None, path: str, dry_run: bool, engine_check: bool, as_json: bool,
        identity: str | None, concurrency: int | None, host: tuple[str, ...], label: tuple[str, ...], retry: bool,
        allow_rewind: bool, lock_wait: float, age_identity: str | None, cache_dir: Path | None,
        state_dir: Path | None, notes: bool, require_signed: bool, allowed_signers: str | None,
        allow_insecure_transport: bool, drain_program: tuple[str, ...]) -> None:
    if ctx.invoked_subcommand is not None:
        return
    trust = trust_policy(require_signed, allowed_signers, allow_insecure_transport, as_json=as_json)
    opts = RunOptions(repo=repo, rev=rev, path=path, cache_dir=cache_dir, hosts=host, labels=label, dry_run=dry_run,
                      retry=retry, allow_rewind=allow_rewind, lock_wait=lock_wait, concurrency=concurrency,
                      identity=identity, age_identity=age_identity, confirm_margin=confirm_margin_from(), trust=trust,
                      engine_check=engine_check, drain_programs=drain_program)
    converge(opts, as_json=as_json, state_dir=state_dir, notes=notes)


@app.command()
@repo_opt
@rev_opt
@path_opt
@json_opt
@cache_opt
@click.option("--age-identity", envvar="RECONCILER_AGE_IDENTITY", metavar="KEYFILE",
              help="Also check that every age secret decrypts with this identity (the controller's).")
def validate(repo: str, rev: str | None, path: str, as_json: bool, cache_dir: Path | None,
             age_identity: str | None) -> None:
    """Check the desired state at a revision without contacting any host (exit 0 or 1)."""
    from ..desired import secrets
    from ..desired.cache import load_desired
    from ..loop.revision import snapshot_of
    from ..preflight import check_desired, load_rules, secret_problems
    decrypted = 0
    try:
        snap = snapshot_of(RunOptions(repo=repo, rev=rev, path=path, cache_dir=cache_dir))
        state = load_desired(snap, cache_dir)
        problems, warnings = check_desired(state, load_rules(snap), snap.read)
        identity = secrets.identity_path(age_identity)
        if identity and any(s.source == "age" for h in state.hosts.values() for svc in h.services.values()
                            for s in svc.secrets):
            state = secrets.Decryptor(identity).state(state)
            problems.extend(secret_problems(state, snap.read))
            decrypted = len({s.path for h in state.hosts.values() for svc in h.services.values()
                             for s in svc.secrets if s.source == "age" and s.problem is None})
        if problems:
            raise ConfigError(problems)
    except (ConfigError, SourceError) as e:
        fail_input(e, as_json, f"{repo}@{rev or 'HEAD'}")
    for w in warnings:
        console(stderr=True).print(escape(w), soft_wrap=True)
    n_svc = sum(len(h.services) for h in state.hosts.values())
    if as_json:
        print_json({"revision": snap.revision, "valid": True, "hosts": len(state.hosts), "services": n_svc,
                    "warnings": warnings})
    else:
        checked = f"; {decrypted} age secret file{'s' * (decrypted != 1)} decrypt" if decrypted else ""
        console().print(f"{snap.short}: valid ({len(state.hosts)} hosts, {n_svc} services{checked})")


@app.command()
@json_opt
@state_opt
@click.option("--live", is_flag=True, help="Read the records on the hosts over SSH (read-only, no lock) instead of "
                                           "the local state store: what runs where, from any machine. Adds "
                                           "systemd's ActiveState.")
@repo_opt
@click.option("--rev", metavar="REV", help="With --live: the revision whose hosts to read (default: HEAD).")
@path_opt
@hosts_opt
@identity_opt
@concurrency_opt
@age_opt
@cache_opt
def status(as_json: bool, state_dir: Path | None, live: bool, repo: str, rev: str | None, path: str,
           host: tuple[str, ...], label: tuple[str, ...], identity: str | None, concurrency: int | None,
           age_identity: str | None, cache_dir: Path | None) -> None:
    """The fleet at a glance: host, service, desired and running revision, health, last event;
    from the local state store, or with --live from the hosts' own records."""
    from ..controller.store import Store
    from ..loop.report import print_status
    if not live:
        if rev or host or label:
            fail("--rev, --host and --label choose what `status --live` reads from the hosts; without --live, "
                 "status shows the local state store")
        rows, at = Store(state_dir).status(), None
    else:
        from ..loop.fleet import run_fleet
        from ..loop.live import rows_of
        opts = RunOptions(repo=repo, rev=rev, path=path, cache_dir=cache_dir, hosts=host, labels=label, look=True,
                          concurrency=concurrency, identity=identity, age_identity=age_identity)
        snap, revision = opened(opts, as_json)
        rows, at = rows_of(run_async(run_fleet(revision, opts)), revision.state), snap.short
    if as_json:
        print_json(rows)
    else:
        print_status(console(), rows, live=at)


@app.command()
@click.argument("host")
@json_opt
@state_opt
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
def history(host: str, as_json: bool, state_dir: Path | None, limit: int) -> None:
    """Every attempt on one host, newest first: revision, result, reason, journal line, duration."""
    from ..controller.store import Store
    from ..loop.report import print_history
    rows = Store(state_dir).history(host, limit)
    if as_json:
        print_json(rows)
    else:
        print_history(console(), host, rows)


@app.command()
@click.option("--config", type=PATH, help="Controller config (default /etc/reconciler/config.toml or "
                                          "$RECONCILER_CONFIG); RECONCILER_<KEY> env vars override it.")
@click.option("--repo", help="Override config: the desired-state repo.")
@click.option("--branch", help="Override config: the deploy branch.")
@click.option("--interval", type=float, help="Seconds between periodic runs.")
@click.option("--identity", "-i", metavar="KEYFILE", help="Override config: the SSH private key.")
@click.option("--age-identity", metavar="KEYFILE", help="Override config: the age identity that decrypts the "
                                                        "repo's secrets.")
@click.option("--state-dir", type=PATH, metavar="DIR", help="Override config: the state directory.")
@click.option("--metrics", metavar="HOST:PORT", help="The Prometheus endpoint, '' = off. Not loopback only with "
                                                    "metrics_public = true in the config.")
@click.option("--web", metavar="HOST:PORT", help="The read-only fleet page, '' = off (default 127.0.0.1:9188). Not "
                                                "loopback only with web_public = true in the config.")
@click.option("--label", "-l", multiple=True, metavar="KEY=VALUE",
              help="Override config: only hosts with this label (repeatable: all must match), for several "
                   "controllers that share a fleet.")
def watch(config: Path | None, repo: str | None, branch: str | None, interval: float | None, identity: str | None,
          age_identity: str | None, state_dir: Path | None, metrics: str | None, web: str | None,
          label: tuple[str, ...]) -> None:
    """Run as a daemon: reconcile on every push (within a second), every interval, and on trigger."""
    import asyncio

    from ..controller.config import load_config
    from ..controller.daemon import Daemon
    overrides = {k: v for k, v in dict(repo=repo, branch=branch, identity=identity, age_identity=age_identity,
                                       state_dir=str(state_dir) if state_dir else None, metrics=metrics,
                                       web=web, labels=list(label) or None).items()
                 if v is not None}
    try:
        cfg = load_config(config, overrides)
    except ConfigError as e:
        fail_input(e, False, str(config or "config"))
    asyncio.run(Daemon(cfg, interval=interval).serve())


@app.command("init-repo")
@click.argument("path", type=PATH)
@click.option("--branch", default="main", show_default=True)
@click.option("--state-dir", type=PATH, envvar="RECONCILER_STATE_DIR", metavar="DIR",
              help="The daemon's state dir, for streaming results to the pusher.")
@click.option("--stream", is_flag=True, help="Always stream the deploy's outcome to the pusher.")
@click.option("--shared", metavar="GROUP", help="Share the repo with GROUP (the pushing users and the daemon): "
                                                "its objects/ and refs/ group-writable and setgid "
                                                "(core.sharedRepository=group); config, hooks and the directory "
                                                "stay yours.")
@click.option("--owner", metavar="USER", help="With --shared, as root: the daemon's user, owner of objects/, refs/ "
                                              "and the trigger file; marked safe.directory in USER's git config.")
def init_repo_cmd(path: Path, branch: str, state_dir: Path | None, stream: bool, shared: str | None,
                  owner: str | None) -> None:
    """Create a bare repo with the pre-receive (validate) and post-receive (deploy) hooks installed."""
    from ..controller.hooks import init_repo
    if path.exists() and any(path.iterdir()):
        fail(f"{path} exists and is not empty")
    try:
        notes = init_repo(path, branch=branch, state_dir=str(state_dir.resolve()) if state_dir else None,
                          stream=stream, group=shared, owner=owner)
    except (KeyError, PermissionError) as e:     # no such group/user, or not root for chown
        fail(f"{path}: cannot share with {shared!r}{f' owned by {owner!r}' if owner else ''}: {e}")
    out = console()
    out.print(f"bare deploy repo at {path} (branch {branch}); hooks installed.")
    for n in notes:
        out.print(f"  {n}")
    if shared:       # pushed to over SSH, as the pushing users (systemd/README.md, step 2 and 4)
        out.print(f"next, on a workstation (once a pushing user exists on this host):\n"
                  f"  git remote add deploy git@<this host>:{path.resolve()}\n  git push deploy {branch}")
    else:
        out.print(f"  git remote add deploy {path.resolve()}\n  git push deploy {branch}")


app.add_command(pull)
app.add_command(secrets_group)
